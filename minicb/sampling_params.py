"""SamplingParams (vLLM's name, vLLM's module name): how one request turns logits into tokens, and
when it stops.

Pure data, validated on construction, so a bad value is refused when the request is made and
never reaches the model. The torch code that applies these parameters is `minicb.sample.sampler`.
"""

import copy
import enum
import math
from dataclasses import dataclass

from .structured_outputs_params import StructuredOutputsParams

# The limits the engine can honour, so that a request that passes validation can never fail a step.
# larger than any vocabulary: a top_k above the vocabulary size keeps every token
MAX_TOP_K = 2**31 - 1
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
MAX_TOKEN_ID = 2**63 - 1  # token ids are int64 tensors
# alternatives per position, as vLLM's default max_logprobs (OpenAI allows 20 too)
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for one logit_bias value: [-100, 100]
# [1/100, 100]: vLLM takes any r > 0, but logit / 1e-40 overflows to NaN
MAX_REPETITION_PENALTY = 100.0


class RequestOutputKind(enum.IntEnum):
    """Which steps hand out a RequestOutput for a request (vLLM's enum; its DELTA, outputs holding
    only what is new, is CUMULATIVE's CompletionOutput.new_token_ids here)."""

    CUMULATIVE = 0  # every step in which it got a token, holding everything so far (streaming)
    # its last only: LLM.generate's, which then builds no snapshot of a running request, a copy
    # of its prompt and of its tokens per step that the host pays for between two device steps
    FINAL_ONLY = 2


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(
    v,
) -> bool:  # bools are ints in Python, never numbers here; NaN fails every range check
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16  # generated tokens at most (the request finishes with reason "length")
    temperature: float = 1.0  # 0 means greedy; higher flattens the distribution
    # keep only the k most likely tokens; 0 (or -1, as vLLM also accepts) turns it off
    top_k: int = 0
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    seed: int | None = None  # per-request generator: same tokens whatever else is in the batch
    stop_token_ids: tuple[int, ...] | None = None  # extra tokens that end the request ("stop")
    # strings that end it, found in the text; not shown (vLLM's)
    stop: tuple[str, ...] | None = None
    include_stop_str_in_output: bool = False  # keep the stop string at the end of the text
    ignore_eos: bool = False  # keep generating past EOS (benchmarks want exact lengths)
    # Several samples of one prompt. The prompt is computed once; the samples fork after prefill and
    # share its KV blocks by reference count (copy-on-write). Sample i of a seeded request uses
    # seed + i, as vLLM does, so it equals a separate request with that seed.
    n: int = 1
    # Logits processors, applied in vLLM's order before temperature: min_tokens, logit_bias, then
    # the repetition, frequency and presence penalties. Their neutral values change nothing, not one
    # bit.
    # EOS and stop tokens are forbidden, stop strings not looked for, until this many are out
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    # CTRL's: a seen token's logit is divided (if > 0) or multiplied by it
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0  # minus this times the token's count in the output so far
    presence_penalty: float = 0.0  # minus this once the token appeared in the output
    # after temperature, drop tokens with probability < min_p * the top probability
    min_p: float = 0.0
    # Log-probabilities (from the processed logits, before temperature; see sampler.py).
    logprobs: int | None = None  # per generated token: the sampled token's plus this many top ones
    # per prompt token (the first has none); no prefix-cache hits
    prompt_logprobs: int | None = None
    # a JSON schema, regex, choice or grammar the output must follow (vLLM's structured outputs)
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self):
        check, integer, number = self._require, _is_int, _is_number
        check("max_tokens", integer(self.max_tokens) and self.max_tokens > 0, "a positive integer")
        check(
            "temperature",
            number(self.temperature) and 0 <= self.temperature < math.inf,
            "a finite number >= 0",
        )
        check(
            "top_k",
            integer(self.top_k) and -1 <= self.top_k <= MAX_TOP_K,
            f"an integer in [-1, {MAX_TOP_K}] (0 or -1 disables it)",
        )
        check("top_p", number(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]")
        check(
            "seed",
            self.seed is None or integer(self.seed) and SEED_MIN <= self.seed <= SEED_MAX,
            "an integer in [-2**63, 2**64 - 1] (what torch.Generator accepts) or None",
        )
        check("n", integer(self.n) and self.n >= 1, "an integer >= 1")
        check(
            "seed",
            self.seed is None or self.seed + self.n - 1 <= SEED_MAX,
            "<= 2**64 - n (sample i uses seed + i)",
        )
        check(
            "min_tokens",
            integer(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            f"an integer in [0, max_tokens={self.max_tokens}]",
        )
        for name, low, high in (
            ("presence_penalty", -2, 2),
            ("frequency_penalty", -2, 2),
            ("min_p", 0, 1),
        ):
            value = getattr(self, name)
            check(name, number(value) and low <= value <= high, f"a number in [{low}, {high}]")
        r, top = self.repetition_penalty, MAX_REPETITION_PENALTY
        check(
            "repetition_penalty",
            number(r) and 1 / top <= r <= top,
            f"a number in [{1 / top:g}, {top:g}] (1 turns it off)",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value, expected = getattr(self, name), f"an integer in [0, {MAX_LOGPROBS}] or None"
            check(name, value is None or integer(value) and 0 <= value <= MAX_LOGPROBS, expected)
        kinds = "RequestOutputKind.CUMULATIVE or RequestOutputKind.FINAL_ONLY"
        check("output_kind", isinstance(self.output_kind, RequestOutputKind), kinds)
        ids = self.stop_token_ids
        check(
            "stop_token_ids",
            ids is None
            or not isinstance(ids, (str, bytes, dict))
            and hasattr(ids, "__iter__")
            and all(integer(t) and 0 <= t <= MAX_TOKEN_ID for t in ids),
            "a list of integers in [0, 2**63 - 1]",
        )
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        check(
            "stop",
            stop is None
            or not isinstance(stop, dict)
            and hasattr(stop, "__iter__")
            and all(isinstance(s, str) and s for s in stop),
            "a non-empty string or a list of them",
        )
        bias = self.logit_bias
        check(
            "logit_bias",
            bias is None
            or isinstance(bias, dict)
            and all(
                integer(t) and 0 <= t <= MAX_TOKEN_ID and number(b) and abs(b) <= MAX_LOGIT_BIAS
                for t, b in bias.items()
            ),
            f"a map from token ids to numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
        )
        object.__setattr__(
            self, "structured_outputs", StructuredOutputsParams.of(self.structured_outputs)
        )
        # Given lists become tuples and the bias a copy, so later edits by the caller change
        # nothing.
        object.__setattr__(self, "stop_token_ids", None if ids is None else tuple(ids))
        object.__setattr__(self, "stop", None if stop is None else tuple(stop))
        object.__setattr__(self, "logit_bias", dict(bias) if bias else None)

    def _require(self, name: str, ok: bool, expected: str) -> None:
        if not ok:
            raise ValueError(f"{name} must be {expected}, got {getattr(self, name)!r}")

    @property
    def processes_logits(self) -> bool:
        """Does any logits processor change this request's logits?"""
        return bool(
            self.min_tokens
            or self.logit_bias
            or self.repetition_penalty != 1
            or self.frequency_penalty
            or self.presence_penalty
        )

    def for_sample(self, index: int) -> "SamplingParams":
        """The parameters of sample `index` of an n-sample request: n=1 and, if seeded, seed +
        index."""
        seed = None if self.seed is None else self.seed + index
        # checked once: the samples share the request's lists (checking again took ~1 s at n = 8)
        sample = copy.copy(self)
        object.__setattr__(sample, "n", 1)
        object.__setattr__(sample, "seed", seed)
        return sample
