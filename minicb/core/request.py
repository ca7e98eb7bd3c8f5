"""Request: one prompt's life inside the engine (what a user gets back is in outputs.py).

A request is a list of token ids (prompt, then generated tokens) plus one counter that drives
everything: `num_computed_tokens`, how many of those tokens already have K/V in the cache.
Each step the scheduler gives a request `num_tokens - num_computed_tokens` tokens or fewer
(a prompt chunk, a whole prompt, or the single newest token of a decode), the same rule that
vLLM v1 uses, so prefill, chunked prefill, decode and recompute after preemption are one code path.
"""

import enum

from ..metrics import RequestMetrics  # wall-clock times of one request (TTFT, token times)
from ..sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted by recompute)
    # its grammar (structured outputs) is being compiled: held by the engine, not yet queued (vLLM
    # V1's name; WAITING_FOR_FSM in its earlier versions)
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = "waiting_for_structured_output_grammar"
    RUNNING = "running"  # holds a slot and KV blocks on the device
    SWAPPED = "swapped"  # preempted by swap: its KV blocks sit in CPU memory
    FINISHED_STOPPED = "stop"  # produced EOS or a stop token
    # reached max_tokens (add_request keeps prompt + max_tokens <= max_model_len)
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"  # aborted by the user (or a disconnected client)
    # its own inputs broke a step (sampling, detokenizing): it alone is stopped
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        # the members themselves, compared by identity: asked four times per request per step,
        # `self.value` (an enum descriptor in Python) was a visible part of a batch-256 step
        return self in _FINISHED


_FINISHED = (
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
)


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
        sample_index: int = 0,
        user: str | None = None,
    ):
        self.request_id = request_id
        self.prompt = prompt  # the text, when the prompt was given as text
        self.token_ids = list(prompt_token_ids)  # prompt + generated, grows by one per sample
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        # scheduling_policy="priority" serves the lowest value first, as vLLM
        self.priority = priority
        self.arrival_index = arrival_index  # order of arrival: FIFO key and tie-breaker
        self.user = user  # the tenant (OpenAI's field), served fairly by scheduling_policy="vtc"
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V is in the cache (0 again after recompute)
        # Async scheduling (vLLM V1's name): tokens sampled by a step still in flight, not yet in
        # token_ids. The scheduler counts them as if they were there; the model runner feeds them
        # from that step's sampled tokens. Always 0 with synchronous steps.
        self.num_output_placeholders = 0
        # Async scheduling: its row in flight verifies drafts or forks its n samples, so its length
        # or its sequences are unknown until that step's tokens land; it sits out the next step.
        self.waits_for_step = False
        # drafts its next decode verifies (spec_decode.py; vLLM's name)
        self.spec_token_ids: list[int] = []
        # tokens the last step that touched it appended: 1, or more with accepted drafts
        self.num_new_tokens = 0
        self.slot: int | None = None  # row of the batch it occupies while running (for pictures)
        # Stop ids: the model's EOS (unless ignored) and the user's stop tokens.
        self.eos_token_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.stop_token_ids = self.eos_token_ids | frozenset(params.stop_token_ids or ())
        # the user's stop token that ended it (vLLM's stop_reason)
        self.stop_reason: int | str | None = None
        self.error: str | None = None  # why it finished with "error"
        self.block_hashes: list[int] = []  # hash chain of this request's full blocks (prefix cache)
        self.num_preemptions = 0
        # requests admitted before it while it waited for seats (Scheduler._next_to_admit)
        self.num_passed = 0
        self.admitted_step: int | None = None
        # prompt tokens the prefix cache held at its first admission; -1 before (vLLM V1's name)
        self.num_cached_tokens = -1
        self.first_token_step: int | None = None
        self.finish_step: int | None = None
        self.metrics = RequestMetrics()
        self.generator = None  # per-request torch.Generator for seeded sampling (set by the engine)
        # structured outputs: its matcher (structured_output.RequestGrammar), set once compiled
        self.grammar = None
        # its min_tokens and logit_bias ids as tensors, built once (sample/penalties.py)
        self.processor_tensors = None
        # Samples 1..n-1 of an n-sample request, made at arrival but kept out of the scheduler until
        # the prompt is computed; then they fork from this request (Scheduler.fork) and run as
        # requests of their own that share its prompt blocks. Empty for n == 1 and after the fork.
        self.forks: list[Request] = []
        # which sample of its prompt this is (CompletionOutput.index)
        self.sample_index = sample_index
        # {id: Logprob} per token
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        # [None, then one {token id: Logprob} per prompt token]: the first token has no context.
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_seqs(self) -> int:
        """Batch rows (slots) it needs: n until its samples have forked, then 1 each."""
        return 1 + len(self.forks)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Its tokens, counting those in flight (async scheduling): what the scheduler feeds."""
        return len(self.token_ids) + self.num_output_placeholders

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

    def append_output_tokens(self, tokens: list[int]) -> "RequestStatus | None":
        """Append one step's tokens (one; or the drafts it accepted, then the model's own) up to the
        first that finishes the request, and return the finished status it causes, if any (vLLM's
        check_stop). A stop token (EOS, unless ignored, or one of the user's) stops first; then
        max_tokens, which the config keeps within max_model_len. `num_new_tokens` counts the tokens
        appended."""
        self.num_new_tokens = 0
        for token in tokens:
            self.token_ids.append(token)
            self.num_new_tokens += 1
            if token in self.stop_token_ids:
                # vLLM: None for EOS
                self.stop_reason = None if token in self.eos_token_ids else token
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
            f"computed={self.num_computed_tokens}, slot={self.slot}, priority={self.priority}"
            + (f", user={self.user!r})" if self.user is not None else ")")
        )
