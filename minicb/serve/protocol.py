"""The OpenAI API's request and response bodies, declared once as pydantic models.

FastAPI validates every request against these models before a handler runs, and publishes them
in /openapi.json, so the schema a client reads is the validation the server applies: every field
with its type and range, every status a route returns. Types are strict where OpenAI's are
(`"n": true` is not 1, `"temperature": "1"` is not a number), numbers are finite, and ranges are
OpenAI's and vLLM's where the engine can honour them (seeds and top_k as torch accepts them, see
sampling_params.py). What only holds across fields (best_of equal to n, top_logprobs needing
logprobs) is checked by `sampling_params()`, which raises ValueError naming the field. A field
minicb does not implement is declared with its OpenAI type and accepted only with its neutral
value, so a client that sends it gets a 400 that names it instead of silent ignorance.
Unknown extra fields are ignored, as vLLM does: clients send many newer OpenAI fields. (vLLM keeps
the same models in vllm/entrypoints/openai/protocol.py.)
"""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from ..sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_TOKEN_ID,
    MAX_TOP_K,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
    StructuredOutputsParams,
)

INT64_MAX = 2**63 - 1
MAX_N = 128  # OpenAI's bound on n; the engine also refuses more samples than max_num_seqs (400)
# a tenant's name (`user`): an id, not a text; the scheduler keeps one counter per name it meets
MAX_USER_CHARS = 256
# a JSON number (an int too), never a bool
Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]
TokenId = Annotated[StrictInt, Field(ge=0, le=MAX_TOKEN_ID)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Text = Annotated[StrictStr, Field(min_length=1)]
# top alternatives per token: the most the engine returns; a server may take fewer (--max-logprobs,
# limits.py, checked when a request comes)
NumLogprobs = Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)]
# OpenAI's range for presence and frequency penalties
Penalty = Annotated[Number, Field(ge=-2, le=2)]
# logit_bias keys: token ids as strings
TokenIdKey = Annotated[StrictStr, Field(pattern=r"^[0-9]{1,19}$")]

# Fields minicb does not implement: accepted only with the neutral value named here.
UNSUPPORTED = {
    "best_of": "null or the value of n; vLLM V1 dropped it",
    "suffix": "null",
    "tools": "null or []",
}


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIModel):
    include_usage: StrictBool = False  # a last chunk with the token counts
    # vLLM's: with include_usage, every chunk carries the counts so far
    continuous_usage_stats: StrictBool = False


class JsonSchemaFormat(OpenAIModel):
    """OpenAI's response_format.json_schema: a named schema the reply must follow."""

    name: Annotated[StrictStr, Field(min_length=1, max_length=64)]
    description: StrictStr | None = None
    json_schema: dict | None = Field(default=None, alias="schema")  # OpenAI's key is "schema"
    strict: StrictBool | None = None  # minicb always follows the schema: strict or not


class ResponseFormat(OpenAIModel):
    """OpenAI's response_format: text, any JSON object, or a JSON schema (structured outputs)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured_outputs(self) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            if self.json_schema is None:
                raise ValueError("response_format of type json_schema needs its json_schema")
            schema = self.json_schema.json_schema
            return StructuredOutputsParams(json={} if schema is None else schema)
        return None


class SamplingFields(OpenAIModel):
    """What both endpoints share: the model, sampling, penalties, stopping, streaming."""

    model: StrictStr | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1, le=INT64_MAX)] | None = None
    # samples per prompt (choices prompt_index * n + i)
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    temperature: Annotated[Number, Field(ge=0)] | None = None  # default 1.0
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    # vLLM's extension; 0 or -1: off
    top_k: Annotated[StrictInt, Field(ge=-1, le=MAX_TOP_K)] | None = None
    min_p: Annotated[Number, Field(ge=0, le=1)] | None = None  # vLLM's extension
    # sample i uses seed + i
    seed: Annotated[StrictInt, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: (
        Annotated[Number, Field(ge=1 / MAX_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)] | None
    ) = None
    logit_bias: (
        dict[TokenIdKey, Annotated[Number, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None
    ) = None
    # vLLM's extension: no EOS before these
    min_tokens: Annotated[StrictInt, Field(ge=0, le=INT64_MAX)] = 0
    stop: Text | list[Text] | None = None
    # vLLM's extension: keep the stop string in the text
    include_stop_str_in_output: StrictBool = False
    stop_token_ids: list[TokenId] | None = None  # vLLM's extension
    ignore_eos: StrictBool = False  # vLLM's extension: generate exactly max_tokens
    # vLLM's extension: per prompt token (whole responses only)
    prompt_logprobs: NumLogprobs | None = None
    # vLLM's: lowest served first
    priority: Annotated[StrictInt, Field(ge=-INT64_MAX, le=INT64_MAX)] = 0
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # OpenAI's: names the tenant, whom scheduling_policy="vtc" serves fairly (others ignore it)
    user: Annotated[StrictStr, Field(max_length=MAX_USER_CHARS)] | None = None
    # OpenAI's (json_object, json_schema) and vLLM's extra field (json, regex, choice, grammar)
    response_format: ResponseFormat | None = None
    structured_outputs: dict | None = None

    def sampling_fields(self, max_tokens: int) -> dict:
        """The SamplingParams fields both endpoints set the same way."""
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not available when streaming (as in vLLM)")
        return dict(
            max_tokens=max_tokens,
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias={int(t): b for t, b in self.logit_bias.items()} if self.logit_bias else None,
            min_tokens=self.min_tokens,
            stop=self.stop or None,
            include_stop_str_in_output=self.include_stop_str_in_output,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            prompt_logprobs=self.prompt_logprobs,
            structured_outputs=self.constraint(),
        )

    def constraint(self) -> StructuredOutputsParams | None:
        """The output's constraint: vLLM's structured_outputs or OpenAI's response_format."""
        fmt = self.response_format.structured_outputs() if self.response_format else None
        if fmt is not None and self.structured_outputs is not None:
            raise ValueError("set response_format or structured_outputs, not both")
        return fmt or StructuredOutputsParams.of(self.structured_outputs)


class CompletionRequest(SamplingFields):
    """POST /v1/completions. `prompt`: text, token ids, or a list of either (several prompts)."""

    prompt: (
        Text
        | TokenIds
        | Annotated[list[Text], Field(min_length=1)]
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    # 0: the prompt alone, no new tokens (with echo, its text and logprobs)
    max_tokens: Annotated[StrictInt, Field(ge=0, le=INT64_MAX)] | None = None
    echo: StrictBool = False  # the text (and logprobs) start with the prompt's
    logprobs: NumLogprobs | None = None  # per token: the chosen token's plus this many top ones
    # only null or n (see UNSUPPORTED)
    best_of: Annotated[StrictInt, Field(ge=1, le=MAX_N)] | None = None
    suffix: None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        return p if isinstance(p, list) and isinstance(p[0], (str, list)) else [p]

    @property
    def prompt_only(self) -> bool:
        """max_tokens 0: no new text, the prompt alone (with echo, its text and logprobs; without,
        an empty completion, and its prompt_logprobs if asked). The engine samples one token (it
        needs one), the reply drops it."""
        return self.max_tokens == 0

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The engine's SamplingParams (raises ValueError, naming the field, for what it
        refuses)."""
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(
                f"best_of is not supported by minicb (only {UNSUPPORTED['best_of']}), got "
                f"{self.best_of}"
            )
        if self.max_tokens == 0 and self.min_tokens:
            raise ValueError(f"min_tokens must be at most max_tokens (0), got {self.min_tokens}")
        fields = self.sampling_fields(
            1 if self.prompt_only else self.max_tokens or default_max_tokens
        )
        if (
            self.echo and self.logprobs is not None
        ):  # the echoed prompt's logprobs come from prefill
            fields["prompt_logprobs"] = max(self.logprobs, self.prompt_logprobs or 0)
        return SamplingParams(**fields, logprobs=self.logprobs)


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | Annotated[list[TextPart], Field(min_length=1)]
    name: StrictStr | None = None

    def text(self) -> str:
        return (
            self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        )


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions. Only text content; the model's chat template renders it."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    # the newer name
    max_completion_tokens: Annotated[StrictInt, Field(ge=1, le=INT64_MAX)] | None = None
    logprobs: StrictBool | None = None  # each generated token's logprob
    top_logprobs: NumLogprobs | None = None  # and this many top alternatives (needs logprobs: true)
    tools: Annotated[list[dict], Field(max_length=0)] | None = None

    @property
    def num_top_logprobs(self) -> int | None:
        """Top alternatives per generated token; None: no logprobs at all."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true (as in OpenAI's API)")
        # the newer name wins
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        return SamplingParams(**self.sampling_fields(max_tokens), logprobs=self.num_top_logprobs)


# ---------------------------------------------------------------------------------- responses
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


class Usage(BaseModel):
    prompt_tokens: int  # each prompt once, whatever n
    completion_tokens: int  # every sample's
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """OpenAI's completions format: one entry per token (the echoed prompt's first, then the
    generated)."""

    tokens: list[str]  # each token's text
    token_logprobs: list[float | None]  # null for the first prompt token, which nothing predicts
    top_logprobs: list[dict[str, float] | None]  # the chosen token and the top alternatives
    text_offset: list[int]  # where each token's text starts in the choice's text


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None  # the token's text in UTF-8


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """OpenAI's chat format."""

    content: list[TokenLogprob] | None


class PromptLogprob(BaseModel):  # vLLM's Logprob
    logprob: float
    rank: int | None
    decoded_token: str | None


# vLLM's: one per prompt token, keyed by token id
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class Choice(BaseModel):
    """What every kind of choice has; each adds its text as text, message or delta."""

    index: int  # prompt_index * n + sample index
    finish_reason: Literal["stop", "length", "abort"] | None
    token_ids: list[int] = []  # minicb: the generated ids (of this chunk, when streaming)


class CompletionChoice(Choice):
    text: str
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, when asked for


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None  # always in a whole response; in a stream only on the last chunk


class ChatMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(Choice):
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, when asked for


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(Choice):
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "minicb"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
