"""What a step costs in time, not only in tokens: the scheduler's estimate of a batch's duration.

`max_num_batched_tokens` bounds the tokens of a step, but two steps of 256 tokens can differ in
time by ten times: a prefill chunk attends to its whole context, so 256 tokens at 7,000 tokens of
context cost far more than 256 at the start of a prompt (on a 2-core EPYC, SmolLM2-135M: 0.6 s
against 5.9 s), and a request that asks for prompt log-probabilities runs the LM head and a
log-softmax over the vocabulary for every prompt position. Every decode that shares the step waits
for all of it. Sarathi-Serve (Agrawal et al., OSDI 2024) sizes chunks from a time target measured
on the hardware; StepCost is that measurement, as a linear model of a step's time:

    time = step_s                                    (launches, reading every weight once)
         + token_s         x tokens                  (the linear layers, per token)
         + context_token_s x sum over tokens of the positions each one attends to
         + logits_row_s    x LM-head rows beyond the one sampled (prompt log-probabilities)
         + position_s      x sum over rows of the positions of context each one reads

The last term is per row, not per token: before it attends, a row gathers its whole context's
cached keys and values from its block table and streams them through memory, as much work for a
chunk of one token as for a chunk of 64. On a CPU it is what a short chunk deep in a long prompt
costs (SmolLM2-135M on a 2-core EPYC: about 20 us per position, so a one-token chunk at 8k of
context costs about 160 ms, twice a decode step of three streams).

StepCost (config.py) holds the five numbers; the engine fits them on its own machine when it
starts (engine/step_cost.py). With `max_decode_slowdown` set, the scheduler gives a prefill chunk
only the tokens that keep the step's estimate within that many times the estimate of the decodes
it carries alone (StepTimer, below). Pure Python.
"""

from ..config import StepCost
from .request import Request, RequestStatus
from .scheduler_output import ScheduledRequest


class StepTimer:
    """One step's estimate while schedule() builds it: the decodes set the target (`slowdown`
    times their own estimate), every other row spends from what is left."""

    def __init__(self, cost: StepCost, slowdown: float):
        self.cost = cost
        self.slowdown = slowdown
        self.decode_s = cost.step_s  # the step itself, plus each decode row
        self.other_s = 0.0  # prefill chunks, recomputes, swapped-in rows

    def add(self, seconds: float, is_decode: bool) -> None:
        if is_decode:
            self.decode_s += seconds
        else:
            self.other_s += seconds

    def add_row(self, row: ScheduledRequest) -> None:
        self.add(self.row_s(row), is_decode=not row.is_prefill)

    def take_back(self, row: ScheduledRequest) -> None:
        """A row scheduled earlier in this step whose request was then preempted."""
        self.add(-self.row_s(row), is_decode=not row.is_prefill)

    def row_s(self, row: ScheduledRequest) -> float:
        # prompt log-probabilities: an LM-head row for every prompt position fed
        with_logits = row.request.params.prompt_logprobs is not None and row.is_prefill
        return self.cost.row_s(row.num_tokens, row.start, row.num_tokens if with_logits else 0)

    @property
    def left_s(self) -> float:
        return self.slowdown * self.decode_s - self.decode_s - self.other_s

    def tokens_that_fit(
        self, most: int, context: int, logits_per_token: int, share: float = 1.0
    ) -> int:
        """The largest chunk of at most `most` tokens whose estimate fits `share` of what is left
        (0 if none does). The estimate grows with the chunk, so a binary search finds it."""
        lo, hi = 0, most
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.cost.row_s(mid, context, mid * logits_per_token) <= share * self.left_s:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def chunk_that_fits(
        self, req: Request, computed: int, num_new: int, others_wait: bool = False
    ) -> int:
        """The part of `req`'s next chunk (`num_new` tokens after `computed`) that fits what is
        left. A prompt already part-way through takes half of it when requests wait to be admitted
        (a long prompt's chunks come first in the step, and would leave a short newcomer one token
        a step). The first chunk of a step always gets at least one token, so that a prompt
        advances even beside a full batch of decodes."""
        logits_per_token = int(
            req.params.prompt_logprobs is not None and req.num_output_tokens == 0
        )
        share = 0.5 if others_wait and req.status == RequestStatus.RUNNING else 1.0
        fits = self.tokens_that_fit(num_new, computed, logits_per_token, share)
        is_first_chunk = self.other_s == 0
        if fits == 0 and is_first_chunk:
            return 1
        return fits

    def __repr__(self):
        return (
            f"StepTimer(decodes={self.decode_s * 1e3:.1f} ms, others={self.other_s * 1e3:.1f} ms, "
            f"left={self.left_s * 1e3:.1f} ms of x{self.slowdown})"
        )
