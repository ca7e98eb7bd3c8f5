"""The OpenAI API's request and response bodies, declared once as pydantic models.

FastAPI validates every request against these models before a handler runs, and publishes them
in /openapi.json, so the schema a client reads is the validation the server applies: every field
with its type and range, every status a route returns. Types are strict where OpenAI's are
(`"n": true` is not 1, `"temperature": "1"` is not a number), numbers are finite, and ranges are
the ones the engine can honour (seeds and top_k as torch accepts them, see sampling_params.py).
A field minicb does not implement is declared with its OpenAI type and accepted only with its
neutral value, so a client that sends it gets a 400 that names it instead of silent ignorance.
Unknown extra fields are ignored, as vLLM does: clients send many newer OpenAI fields.
(vLLM keeps the same models in vllm/entrypoints/openai/protocol.py.)
"""

import dataclasses
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator

from ..sampling_params import MAX_TOKEN_ID, MAX_TOP_K, SEED_MAX, SEED_MIN, SamplingParams

INT64_MAX = 2**63 - 1
Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]  # a JSON number (an int too), never a bool
TokenId = Annotated[StrictInt, Field(ge=0, le=MAX_TOKEN_ID)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]

# Fields minicb does not implement: accepted only with the neutral value named here.
UNSUPPORTED = {"n": "1", "best_of": "1", "echo": "false", "logprobs": "null, false or 0", "top_logprobs": "0",
               "suffix": "null", "presence_penalty": "0", "frequency_penalty": "0",
               "logit_bias": "null or {}", "tools": "null or []", "response_format": '{"type": "text"}'}


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIModel):
    include_usage: StrictBool = False  # a last chunk with the token counts
    continuous_usage_stats: StrictBool = False  # accepted for vLLM clients; minicb sends usage at the end


class SamplingFields(OpenAIModel):
    """What both endpoints share: the model, sampling, stopping, streaming."""

    model: StrictStr | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1, le=INT64_MAX)] | None = None
    temperature: Annotated[Number, Field(ge=0)] | None = None  # default 1.0
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1, le=MAX_TOP_K)] | None = None  # vLLM's extension; 0 or -1: off
    seed: Annotated[StrictInt, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    stop_token_ids: list[TokenId] | None = None  # vLLM's extension
    ignore_eos: StrictBool = False  # vLLM's extension: generate exactly max_tokens
    priority: Annotated[StrictInt, Field(ge=-INT64_MAX, le=INT64_MAX)] = 0  # vLLM's: lowest served first
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None  # accepted, unused
    # Declared with OpenAI's types, refused unless neutral (see UNSUPPORTED).
    n: Annotated[StrictInt, Field(ge=1, le=1)] = 1
    presence_penalty: Annotated[Number, Field(ge=0, le=0)] | None = None
    frequency_penalty: Annotated[Number, Field(ge=0, le=0)] | None = None
    stop: Annotated[StrictStr, Field(min_length=1)] | list[Annotated[StrictStr, Field(min_length=1)]] | None = None
    include_stop_str_in_output: StrictBool = False  # vLLM's extension: keep the stop string in the text
    logit_bias: dict[StrictStr, Number] | None = None

    @field_validator("echo", "logprobs", check_fields=False)
    @classmethod
    def _false_only(cls, v):
        if v:
            raise ValueError("not supported by minicb yet")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported by minicb yet")
        return v

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The engine's SamplingParams (raises ValueError, naming the field, for what it refuses)."""
        return SamplingParams(
            max_tokens=self.max_tokens or default_max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, seed=self.seed,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, stop=self.stop or None,
            include_stop_str_in_output=self.include_stop_str_in_output)


class CompletionRequest(SamplingFields):
    """POST /v1/completions. `prompt`: text, token ids, or a list holding one of those."""

    prompt: (Annotated[StrictStr, Field(min_length=1)] | TokenIds
             | Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(min_length=1, max_length=1)]
             | Annotated[list[TokenIds], Field(min_length=1, max_length=1)])
    echo: StrictBool = False
    logprobs: Annotated[StrictInt, Field(ge=0, le=0)] | None = None
    best_of: Annotated[StrictInt, Field(ge=1, le=1)] | None = None
    suffix: None = None

    def one_prompt(self) -> str | list[int]:
        p = self.prompt
        return p[0] if isinstance(p, list) and isinstance(p[0], (str, list)) else p


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | Annotated[list[TextPart], Field(min_length=1)]
    name: StrictStr | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions. Only text content; the model's chat template renders it."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1, le=INT64_MAX)] | None = None  # the newer name
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=0)] | None = None
    tools: Annotated[list[dict], Field(max_length=0)] | None = None
    response_format: dict | None = None

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v):
        if v not in (None, {"type": "text"}):
            raise ValueError("only {\"type\": \"text\"} is supported by minicb")
        return v

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        params = super().sampling_params(default_max_tokens)
        if self.max_completion_tokens is not None:  # the newer name wins
            params = dataclasses.replace(params, max_tokens=self.max_completion_tokens)
        return params


# ---------------------------------------------------------------------------------- responses
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Choice(BaseModel):
    """What every kind of choice has; each adds its text as text, message or delta."""

    index: int
    logprobs: None = None
    finish_reason: Literal["stop", "length", "abort"] | None
    token_ids: list[int] = []  # minicb: the generated ids (of this chunk, when streaming)


class CompletionChoice(Choice):
    text: str


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


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(Choice):
    delta: ChatDelta


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
