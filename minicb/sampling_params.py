"""SamplingParams (vLLM's name, vLLM's module name): how one request turns logits into tokens, and when it stops.

Pure data, validated on construction, so a bad value is refused when the request is made and
never reaches the model. The torch code that applies these parameters is `minicb.sampler`.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16  # generated tokens at most (the request finishes with reason "length")
    temperature: float = 1.0  # 0 means greedy; higher flattens the distribution
    top_k: int = 0  # keep only the k most likely tokens; 0 turns it off
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    seed: int | None = None  # per-request generator: same tokens whatever else is in the batch
    stop_token_ids: tuple[int, ...] | None = None  # extra tokens that end the request ("stop")
    ignore_eos: bool = False  # keep generating past EOS (benchmarks want exact lengths)

    def __post_init__(self):
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if not self.temperature >= 0:  # also refuses NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.stop_token_ids is not None:
            if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
                raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
            ids = tuple(self.stop_token_ids)
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
            object.__setattr__(self, "stop_token_ids", ids)  # a list given by the user becomes a tuple

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
