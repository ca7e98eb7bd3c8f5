"""What one request may ask: bounds that keep any one request from taking the service from
everyone else.

A request that the schema allows can still cost every other client: 700,000 stop strings are
searched for after every token, a 2-million-id prompt is walked by the parser, pydantic and the
tokenizer before the engine finds it far too long, and n=8 at eight slots stops
first-come-first-served admission behind it for its whole run. So the server bounds what a request
may ask (RequestLimits), each bound a 400 that names the field, the limit and the flag that raises
it, each default far above what a normal client sends. (vLLM bounds logprobs with --max-logprobs,
20; OpenAI's API takes up to 4 stop sequences.) What connections may hold is connections.py's.

The checks are cheap and run before the work they protect (app.py lists the order):
RequestBounds.check_sizes reads only the lengths of the top-level lists and strings of the parsed
JSON, before pydantic walks them; the other checks read the validated fields before tokenizing.
"""

from dataclasses import dataclass, replace

from ..sampling_params import MAX_LOGPROBS
from .validation import APIError


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask (`python -m minicb serve --max-stop-strings ...`)."""

    # Stop strings are searched for in the text after every token: their number and length bound
    # that search (OpenAI's API takes 4; lm-eval sends one or two)
    max_stop_strings: int = 16
    max_stop_string_chars: int = 1024
    # Stop token ids are looked up for every token and masked while min_tokens holds
    max_stop_token_ids: int = 256
    # Every biased token is added to the logits of every step
    max_logit_bias: int = 1024
    # vLLM's --max-logprobs: alternatives per token for logprobs, top_logprobs and
    # prompt_logprobs; each is a row of the response. At most sampling_params.MAX_LOGPROBS
    max_logprobs: int = MAX_LOGPROBS
    # n x prompts: slots one request holds at once (n samples are admitted together). None: three
    # quarters of max_num_seqs (at least 1), so one request never takes every slot and a newcomer
    # still gets one; 6 of 8 slots is what a request of 3 prompts x n=2 holds
    max_seats_per_request: int | None = None
    # n x prompts x max_tokens: the tokens one request may ask the engine for. None: 4 x
    # max_model_len (n=4 at the longest reply, or 16 short replies)
    max_tokens_per_request: int | None = None

    def __post_init__(self):
        for name in ("max_stop_strings", "max_stop_string_chars", "max_stop_token_ids"):
            positive(name, getattr(self, name))
        positive("max_logit_bias", self.max_logit_bias)
        for name in ("max_seats_per_request", "max_tokens_per_request"):
            if getattr(self, name) is not None:
                positive(name, getattr(self, name))
        is_valid_logprobs = isinstance(self.max_logprobs, int) and (
            0 <= self.max_logprobs <= MAX_LOGPROBS
        )
        if not is_valid_logprobs:
            raise ValueError(
                f"max_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.max_logprobs!r}"
            )

    def for_engine(self, max_num_seqs: int, max_model_len: int) -> "RequestLimits":
        """These limits with every None replaced by its default for this engine."""
        seats = self.max_seats_per_request or max(1, max_num_seqs * 3 // 4)
        tokens = self.max_tokens_per_request or 4 * max_model_len
        return replace(self, max_seats_per_request=seats, max_tokens_per_request=tokens)


def positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


# A text with what tokenizers tend to drop or fold: runs of spaces, tabs, newlines, an accent
# written as a combining mark, CJK, an emoji.
PROBE = "Hi  there,\tworld\n\ne\u0301t\u00e9 \u4e2d\u6587 \U0001f600 ok"


def max_chars_per_token(tokenizer) -> int | None:
    """The most characters of text one token can stand for: its longest vocabulary entry. A text
    longer than max_model_len times this is too long without tokenizing it. None where that does
    not hold: no tokenizer, or one that does not give the probe text back exactly (it drops
    whitespace or maps unknown words to one token, as word-level tokenizers do). Byte-level BPE
    gives it back: each token is a few bytes of the text, and its entry spells each byte as one
    character."""
    if tokenizer is None:
        return None
    ids = tokenizer.encode(PROBE, add_special_tokens=False)
    if tokenizer.decode(ids) != PROBE:
        return None
    return max(len(token) for token in tokenizer.get_vocab())


class RequestBounds:
    """RequestLimits applied to one engine: max_model_len, the slots, what the server holds
    (capacity) and the characters a token can stand for. Every check raises APIError(400)."""

    def __init__(self, limits: RequestLimits, config, capacity: int, chars_per_token: int | None):
        self.limits = limits.for_engine(config.max_num_seqs, config.max_model_len)
        self.max_model_len = config.max_model_len
        self.max_num_seqs = config.max_num_seqs
        # a request never holds more than the server holds
        self.max_seats = min(self.limits.max_seats_per_request, capacity)
        self.max_text_chars = (
            None if chars_per_token is None else self.max_model_len * chars_per_token
        )

    # ------------------------------------------------------------ the parsed JSON, before pydantic
    def check_sizes(self, body) -> None:
        """Refuse from their lengths alone the lists and texts too large to take, before pydantic
        walks them. Only top-level fields are read, and only where their type is right (pydantic
        names a wrong type)."""
        if not isinstance(body, dict):
            return
        lim = self.limits
        stop = body.get("stop")
        if isinstance(stop, list):
            too_many("stop", len(stop), lim.max_stop_strings, "stop strings", "--max-stop-strings")
        for s in [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []:
            if isinstance(s, str) and len(s) > lim.max_stop_string_chars:
                raise APIError(
                    400,
                    f"a stop string has {len(s)} characters, but this server takes at most "
                    f"{lim.max_stop_string_chars} (--max-stop-string-chars)",
                    "stop",
                )
        ids = body.get("stop_token_ids")
        if isinstance(ids, list):
            too_many(
                "stop_token_ids", len(ids), lim.max_stop_token_ids, "ids", "--max-stop-token-ids"
            )
        bias = body.get("logit_bias")
        if isinstance(bias, dict):
            too_many("logit_bias", len(bias), lim.max_logit_bias, "entries", "--max-logit-bias")
        self._check_prompts(body.get("prompt"))
        self._check_messages(body.get("messages"))

    def _check_prompts(self, prompt) -> None:
        is_several = isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))
        if not is_several:
            self._check_prompt(prompt, "prompt")
            return
        if len(prompt) > self.max_seats:  # n >= 1: every prompt takes a slot at least
            raise APIError(
                400,
                f"{len(prompt)} prompts in one request, but one request may hold at most "
                f"{self.max_seats} slots (--max-seats-per-request)",
                "prompt",
            )
        for i, p in enumerate(prompt):
            self._check_prompt(p, f"prompt {i}: prompt")

    def _check_prompt(self, prompt, name: str) -> None:
        # a prompt needs room for at least one new token within max_model_len
        room = self.max_model_len - 1
        if isinstance(prompt, list) and len(prompt) > room:
            raise APIError(
                400,
                f"{name} has {len(prompt)} tokens, and with one new token that exceeds "
                f"max_model_len {self.max_model_len}",
                "prompt",
            )
        is_long_text = isinstance(prompt, str) and self.max_text_chars is not None
        if is_long_text and len(prompt) > self.max_text_chars:
            raise APIError(
                400,
                f"{name} has {len(prompt)} characters: more than max_model_len "
                f"{self.max_model_len} tokens can hold (at most {self.max_text_chars} characters "
                "with this vocabulary)",
                "prompt",
            )

    def _check_messages(self, messages) -> None:
        if not isinstance(messages, list):
            return
        # a chat template marks where each message starts: at least one token each
        if len(messages) > self.max_model_len:
            raise APIError(
                400,
                f"'messages' has {len(messages)} messages, more than max_model_len "
                f"{self.max_model_len} tokens can hold",
                "messages",
            )
        if self.max_text_chars is None:
            return
        chars = sum(text_length(m.get("content")) for m in messages if isinstance(m, dict))
        if chars > self.max_text_chars:
            raise APIError(
                400,
                f"'messages' hold {chars} characters: more than max_model_len {self.max_model_len} "
                f"tokens can hold (at most {self.max_text_chars} characters with this vocabulary)",
                "messages",
            )

    # ------------------------------------------------------------ the validated fields
    def check_logprobs(self, **fields: int | None) -> None:
        """logprobs, top_logprobs, prompt_logprobs: alternatives per token, at most
        --max-logprobs."""
        most = self.limits.max_logprobs
        for name, value in fields.items():
            if value is not None and value > most:
                raise APIError(
                    400,
                    f"'{name}' is {value}, but this server returns at most {most} alternatives "
                    "per token (--max-logprobs)",
                    name,
                )

    def check_seats(self, n: int, num_prompts: int) -> None:
        seats = n * num_prompts
        if seats > self.max_seats:
            raise APIError(
                400,
                f"n={n} samples x {plural(num_prompts, 'prompt')} = {seats} slots, but one request "
                f"may hold at most {self.max_seats} of the {self.max_num_seqs} slots "
                "(--max-seats-per-request)",
                "n",
            )

    def check_tokens(self, n: int, num_prompts: int, max_tokens: int) -> None:
        if max_tokens >= self.max_model_len:
            raise APIError(
                400,
                f"max_tokens is {max_tokens}, and with at least one prompt token that exceeds "
                f"max_model_len {self.max_model_len}",
                "max_tokens",
            )
        asked = n * num_prompts * max_tokens
        most = self.limits.max_tokens_per_request
        if asked > most:
            raise APIError(
                400,
                f"n={n} x {plural(num_prompts, 'prompt')} x max_tokens={max_tokens} = {asked} "
                f"tokens, but one request may ask for at most {most} (--max-tokens-per-request)",
                "max_tokens",
            )

    def default_max_tokens(self, n: int, room: int) -> int:
        """A chat reply's max_tokens when the client sets none: the room max_model_len leaves,
        within the request's share of --max-tokens-per-request."""
        return max(1, min(room, self.limits.max_tokens_per_request // n))


def too_many(field: str, count: int, most: int, what: str, flag: str) -> None:
    if count > most:
        raise APIError(
            400,
            f"'{field}' has {count} {what}, but this server takes at most {most} ({flag})",
            field,
        )


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def text_length(content) -> int:
    """Characters of a chat message's content: a string, or a list of text parts."""
    if isinstance(content, str):
        return len(content)
    if not isinstance(content, list):
        return 0
    texts = [p.get("text") for p in content if isinstance(p, dict)]
    return sum(len(t) for t in texts if isinstance(t, str))
