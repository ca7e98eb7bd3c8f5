"""SamplingParams (vLLM's name, vLLM's module name): how one request turns logits into tokens, and when it stops.

Pure data, validated on construction, so a bad value is refused when the request is made and
never reaches the model. The torch code that applies these parameters is `minicb.sampler`.
"""

import math
from dataclasses import dataclass

# The limits the engine can honour, so that a request that passes validation can never fail a step.
MAX_TOP_K = 2**31 - 1  # larger than any vocabulary: a top_k above the vocabulary size keeps every token
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
MAX_TOKEN_ID = 2**63 - 1  # token ids are int64 tensors


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16  # generated tokens at most (the request finishes with reason "length")
    temperature: float = 1.0  # 0 means greedy; higher flattens the distribution
    top_k: int = 0  # keep only the k most likely tokens; 0 (or -1, as vLLM also accepts) turns it off
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    seed: int | None = None  # per-request generator: same tokens whatever else is in the batch
    stop_token_ids: tuple[int, ...] | None = None  # extra tokens that end the request ("stop")
    stop: tuple[str, ...] | None = None  # strings that end it, found in the text; not shown (vLLM's)
    include_stop_str_in_output: bool = False  # keep the stop string at the end of the text
    ignore_eos: bool = False  # keep generating past EOS (benchmarks want exact lengths)

    def __post_init__(self):
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):  # also refuses NaN
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not -1 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be an integer in [-1, {MAX_TOP_K}] (0 or -1 disables it), got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64 - 1] (what torch.Generator accepts) "
                             f"or None, got {self.seed!r}")
        if self.stop_token_ids is not None:
            if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
                raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
            ids = tuple(self.stop_token_ids)
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in ids):
                raise ValueError(f"stop_token_ids must be integers in [0, 2**63 - 1], got {self.stop_token_ids!r}")
            object.__setattr__(self, "stop_token_ids", ids)  # a list given by the user becomes a tuple
        if self.stop is not None:
            stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
            if not all(isinstance(s, str) and s for s in stop):
                raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
            object.__setattr__(self, "stop", stop)
