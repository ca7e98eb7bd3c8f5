"""StepExecutor: runs the model runner's steps on a thread of their own, one after another, and
hands back futures (vLLM V1's `execute_model(scheduler_output, non_block=True)`), so that the
engine's thread schedules the next step and processes the last one's outputs meanwhile.

The thread plays the device. Steps run on it in the order they were launched, as kernels run in
stream order on a GPU, so a step launched before the previous one has finished starts after it:
the K/V that step N writes is in the cache when step N+1 reads it, and blocks freed when N's outputs
are processed are reused only by steps launched later. On a CPU the overlap is real because torch
releases the GIL inside its operators: while the thread runs a layer's matmuls, the engine's thread
runs Python.

Two hand-offs keep an async step exact:
  - its placeholder tokens (PLACEHOLDER_TOKEN_ID: tokens the step before was still sampling when
    this one was scheduled) are filled here, from that step's sampled tokens as the thread left
    them, never passing through the engine's thread (vLLM V1 fills them on the GPU from
    `prev_sampled_token_ids`; minicb's sampler has already copied them to the host, where the next
    step's inputs are built);
  - its sampling waits until the step before has been processed (`wait_before_sampling`): sampling
    reads what processing writes (a grammar advanced by the last token, the output tokens that
    penalties count, the samples a request forked into).
"""

import time
from concurrent.futures import Future, ThreadPoolExecutor
from threading import Event

from ..core.scheduler_output import PLACEHOLDER_TOKEN_ID, SchedulerOutput
from ..trace import StepTimes
from .model_runner import HostInputs, ModelRunner, ModelRunnerOutput


def sampled_by_request(out: SchedulerOutput, result: ModelRunnerOutput) -> dict[str, int]:
    """{request id: the token its row sampled} (a row that forked its n samples gives its own, the
    first of its n; a failed sample gives none)."""
    tokens, i = {}, 0
    for row in out.scheduled:
        if row.do_sample:
            token = result.sampled_token_ids[i]
            if token is not None:
                tokens[row.request.request_id] = token
            i += row.request.num_seqs
    return tokens


def fill_placeholders(out: SchedulerOutput, h: HostInputs, sampled: dict[str, int]) -> int:
    """Write into h.input_ids each row's tokens that were placeholders when it was scheduled.
    Returns how many. A request whose token is missing (its step failed, and so did it) gets 0: its
    row's outputs are dropped."""
    filled = 0
    for row, start in zip(out.scheduled, h.row_starts):
        for j in range(start, start + row.num_tokens):
            if h.input_ids[j] == PLACEHOLDER_TOKEN_ID:
                h.input_ids[j] = sampled.get(row.request.request_id, 0)
                filled += 1
    return filled


class StepExecutor:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="minicb-device")
        self._sampled: dict[str, int] = {}  # the last step's tokens, read by the next one
        self.num_placeholders = 0  # tokens fed from a step before, never through the host's thread

    def execute_model(
        self,
        out: SchedulerOutput,
        h: HostInputs | None,
        times: StepTimes,
        wait_before_sampling: Event | None = None,
    ) -> "Future[tuple[ModelRunnerOutput, int | None, int | None]]":
        """Launch one step; its future gives (result, graph bucket, graph width)."""
        return self.pool.submit(self._run, out, h, times, wait_before_sampling)

    def _run(self, out, h, times: StepTimes, wait: Event | None):
        times.device_start = time.perf_counter()
        if h is not None:
            self.num_placeholders += fill_placeholders(out, h, self._sampled)

        def before_sampling():
            times.forward_end = time.perf_counter()
            if wait is not None:
                wait.wait()
            times.sample_start = time.perf_counter()

        self._sampled = {}  # if this step fails, its requests fail too: nothing to feed
        try:
            result = self.runner.execute(out, h, before_sampling)
        finally:
            times.device_end = time.perf_counter()
        self._sampled = sampled_by_request(out, result)
        return result, self.runner.last_graph_bucket, self.runner.last_graph_width

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True)
