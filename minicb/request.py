"""Request: one prompt's life inside the engine, and RequestOutput: what a user gets back.

A request is a list of token ids (prompt, then generated tokens) plus one counter that drives
everything: `num_computed_tokens`, how many of those tokens already have K/V in the cache.
Each step the scheduler gives a request `num_tokens - num_computed_tokens` tokens or fewer
(a prompt chunk, a whole prompt, or the single newest token of a decode), the same rule that
vLLM v1 uses, so prefill, chunked prefill, decode and recompute after preemption are one code path.
"""

import dataclasses
import enum
from dataclasses import dataclass, field

from .sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted by recompute)
    RUNNING = "running"  # holds a slot and KV blocks on the device
    SWAPPED = "swapped"  # preempted by swap: its KV blocks sit in CPU memory
    FINISHED_STOPPED = "stop"  # produced EOS or a stop token
    FINISHED_LENGTH = "length"  # reached max_tokens (add_request keeps prompt + max_tokens <= max_model_len)
    FINISHED_ABORTED = "abort"  # aborted by the user (or a disconnected client)
    FINISHED_ERROR = "error"  # its own inputs broke a step (sampling, detokenizing): it alone is stopped

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


@dataclass
class RequestMetrics:
    """Wall-clock times (time.perf_counter seconds) filled in by the engine."""

    arrival_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    _times: list[float] = field(default_factory=list, repr=False)  # only ever grows; snapshots share it
    _seen: int | None = field(default=None, repr=False)  # a snapshot sees only its first _seen entries

    @property
    def token_times(self) -> list[float]:
        """When each output token came out, in order (inter-token latency is their differences)."""
        return self._times if self._seen is None else self._times[:self._seen]

    def record_token(self, t: float) -> None:
        self._times.append(t)

    def snapshot(self) -> "RequestMetrics":
        """A copy that later tokens do not change. O(1) per step, not O(tokens so far): it shares the
        list of times, which only grows, and remembers how much of it existed."""
        return dataclasses.replace(self, _seen=len(self._times))

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None or self.arrival_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival until the first generated token exists."""
        if self.first_token_time is None or self.arrival_time is None:
            return None
        return self.first_token_time - self.arrival_time


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_index: int = 0,
        eos_token_ids: frozenset[int] = frozenset(),
        prompt: str | None = None,
    ):
        self.request_id = request_id
        self.prompt = prompt  # the text, when the prompt was given as text
        self.token_ids = list(prompt_token_ids)  # prompt + generated, grows by one per sample
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.priority = priority  # scheduling_policy="priority" serves the lowest value first, as vLLM
        self.arrival_index = arrival_index  # order of arrival: FIFO key and tie-breaker
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V is in the cache (0 again after recompute)
        self.slot: int | None = None  # row of the batch it occupies while running (for pictures)
        # Stop ids: the model's EOS (unless ignored) and the user's stop tokens.
        self.eos_token_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.stop_token_ids = self.eos_token_ids | frozenset(params.stop_token_ids or ())
        self.stop_reason: int | str | None = None  # the user's stop token that ended it (vLLM's stop_reason)
        self.error: str | None = None  # why it finished with "error"
        self.block_hashes: list[int] = []  # hash chain of this request's full blocks (prefix cache)
        self.num_preemptions = 0
        self.admitted_step: int | None = None
        self.first_token_step: int | None = None
        self.finish_step: int | None = None
        self.metrics = RequestMetrics()
        self.generator = None  # per-request torch.Generator for seeded sampling (set by the engine)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def append_output_token(self, token: int) -> "RequestStatus | None":
        """Append a sampled token; return the finished status it causes, if any (vLLM's check_stop).
        A stop token (EOS, unless ignored, or one of the user's) stops first; then max_tokens, which
        the config keeps within max_model_len."""
        self.token_ids.append(token)
        if token in self.stop_token_ids:
            self.stop_reason = None if token in self.eos_token_ids else token  # vLLM: None for EOS
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    @property
    def max_total_tokens(self) -> int:
        """Tokens whose K/V may ever be cached: the last generated token is never fed back."""
        return self.num_prompt_tokens + self.params.max_tokens - 1

    def __repr__(self):
        return (
            f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}/{self.params.max_tokens}, "
            f"computed={self.num_computed_tokens}, slot={self.slot}, priority={self.priority})"
        )


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
    stop_reason: int | str | None = None  # the stop token id (or string) that ended it; None for EOS
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

    def __repr__(self):
        outs = ", ".join(f"#{o.index}: {len(o.token_ids)} tokens {o.text[:40]!r}"
                         + (f" ({o.finish_reason})" if o.finish_reason else "") for o in self.outputs)
        return (f"RequestOutput({self.request_id!r}, prompt={len(self.prompt_token_ids)} tokens, "
                f"finished={self.finished}, outputs=[{outs}])")
