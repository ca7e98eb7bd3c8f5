"""What a user gets back, shaped and named as vLLM's (vllm/outputs.py, vllm/logprobs.py).

RequestOutput holds one request: its prompt and one CompletionOutput per sample (n of them). The
engine's OutputProcessor (output_processor.py) makes them; each is a snapshot that a later step
never changes.
"""

from dataclasses import dataclass, field

from .metrics import RequestMetrics


@dataclass
class Logprob:
    """One token's log-probability at one position, as vLLM's `Logprob`."""

    logprob: float  # natural log of its probability (-inf when a processor forbade it)
    rank: int | None = None  # 1 + the number of tokens that were more likely
    decoded_token: str | None = None  # its text, when the model has a tokenizer


@dataclass
class CompletionOutput:
    """One generated sequence of a request, as vLLM's `CompletionOutput` (a request with n > 1
    has n of them). `text` and `token_ids` hold everything generated so far."""

    index: int  # which of the request's samples this is (0 while n == 1)
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs, when requested
    logprobs: list | None = None  # per token: {token id: logprob}, when requested
    finish_reason: str | None = None  # "stop" | "length" | "abort" (| "error") once finished
    # the stop token id (or string) that ended it; None for EOS
    stop_reason: int | str | None = None
    new_token_ids: list[int] = field(default_factory=list)  # minicb: the tokens added in this step

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What a user gets back for one request, shaped as vLLM's `RequestOutput`.

    A snapshot: the lists and the metrics are copies, so a later step never changes an output
    already handed out. Streaming yields one per step in which the request got a token."""

    request_id: str
    prompt: str | None  # the prompt text, when the prompt was given as text
    prompt_token_ids: list[int]
    prompt_logprobs: list | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=RequestMetrics)  # minicb: wall-clock times
    error: str | None = None  # minicb: what went wrong when the finish reason is "error"
    # vLLM's: prompt tokens its first admission found in a prefix cache, the device's or the CPU
    # tier's (None before it was admitted)
    num_cached_tokens: int | None = None

    def __repr__(self):
        outs = ", ".join(
            f"#{o.index}: {len(o.token_ids)} tokens {o.text[:40]!r}"
            + (f" ({o.finish_reason})" if o.finish_reason else "")
            for o in self.outputs
        )
        return (
            f"RequestOutput({self.request_id!r}, prompt={len(self.prompt_token_ids)} tokens, "
            f"finished={self.finished}, outputs=[{outs}])"
        )
