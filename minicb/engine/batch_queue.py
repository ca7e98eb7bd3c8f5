"""BatchQueue: the engine loop of async scheduling, two steps deep (vLLM V1's batch queue,
EngineCore.step_with_batch_queue, with max_concurrent_batches = 2).

A synchronous step is schedule -> inputs -> forward -> sample -> update -> outputs, and the device
idles during the first two and the last two. Here one call of Engine.step() does:

    schedule step N+1      the AsyncScheduler counts step N's tokens as placeholders
    launch step N+1        on the executor's thread (the device), which runs it after step N
    collect step N         wait for its sampled tokens, update(), detokenize, stop strings
    (mark N processed)     step N+1 may sample now: its grammar and penalties see N's tokens

so that the host's work for N+1 and for N's outputs runs while the device computes. The price is
what vLLM pays too: outputs come one call later, and a request that finishes in step N has a row in
step N+1 whose token is thrown away.

A step whose sampling reads nothing that processing writes (no grammar, no logits processor) samples
right after its forward pass instead: waiting for step N's processing would hand the device thread
back to the engine's thread through the GIL, and on an H100 the device idled meanwhile. (A request
forking its n samples needs no wait either: AsyncScheduler keeps it out of the next step.)
"""

import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from threading import Event

from ..outputs import RequestOutput
from ..trace import StepTimes
from ..worker.executor import StepExecutor
from ..worker.kv_cache import block_transfers
from ..worker.model_runner import host_inputs


@dataclass
class InFlightStep:
    """A step launched whose outputs are not processed yet."""

    out: object  # its SchedulerOutput
    future: Future  # (ModelRunnerOutput, graph bucket, graph width), from the executor
    processed: Event  # set once its outputs are processed: the next step may sample then
    times: StepTimes
    row_tables: dict  # its rows' block tables as scheduled (the trace draws them)


def reads_processing(out) -> bool:
    """Does the step's sampling read what processing the step before writes: a grammar advanced
    by its token, or the output tokens that min_tokens and the penalties count?"""
    params = [row.request.params for row in out.scheduled if row.do_sample]
    return any(p.structured_outputs or p.processes_logits for p in params)


class BatchQueue:
    def __init__(self, engine):
        # a proxy: an engine dropped without shutdown() is freed by reference counting, not left to
        # the garbage collector, which cannot reach the heap the engine froze when it was built
        self.engine = weakref.proxy(engine)
        self.executor = StepExecutor(engine.runner)
        self.in_flight: InFlightStep | None = None

    def step(self) -> list[RequestOutput]:
        """Schedule and launch step N+1, then process step N's outputs while N+1 runs."""
        eng = self.engine
        times = StepTimes(schedule_start=time.perf_counter())
        out = eng._schedule(times)
        has_work = out.scheduled or any(block_transfers(out))
        launched = None
        if has_work:
            h = host_inputs(out, eng.config.block_size) if out.scheduled else None
            tables = {r.request.request_id: tuple(r.block_table) for r in out.scheduled}
            before = self.in_flight
            wait = before.processed if before is not None and reads_processing(out) else None
            times.launch = time.perf_counter()
            future = self.executor.execute_model(out, h, times, wait)
            launched = InFlightStep(out, future, Event(), times, tables)
        before, self.in_flight = self.in_flight, launched
        return self._collect(before) if before is not None else []

    def drain(self) -> list[RequestOutput]:
        """Process the step in flight and launch no other: nothing runs on the device after it."""
        before, self.in_flight = self.in_flight, None
        return self._collect(before) if before is not None else []

    def _collect(self, step: InFlightStep) -> list[RequestOutput]:
        """Wait for a launched step's tokens and process them; then the step after it may sample."""
        bucket = width = None
        try:
            result, bucket, width = step.future.result()
        except Exception as e:  # its forward pass failed: its rows cannot be told apart
            result = self.engine._failed_step(step.out, e)
        try:
            return self.engine._process(
                step.out, result, step.times, bucket, width, step.row_tables
            )
        finally:
            step.processed.set()

    def shutdown(self) -> None:
        """Stop the executor's thread once the step it runs is done."""
        self.executor.shutdown()
