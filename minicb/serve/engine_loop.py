"""AsyncEngine: one engine loop in a background thread, shared by every HTTP request.

The Engine is single-threaded on purpose (its scheduler and block manager are plain Python data),
so exactly one thread, the *engine loop*, ever calls add_request / step / abort_request. HTTP
handlers live in the asyncio event loop and talk to it through queues:

    handler --inbox (queue.Queue, thread-safe)--> engine loop          "add this", "abort that"
    engine loop --loop.call_soon_threadsafe--> one asyncio.Queue per request    each RequestOutput

The engine loop drains its inbox between two steps, so a request that arrives while a step runs
joins the batch in the very next step: continuous batching (Orca, Yu et al., OSDI 2022) as seen
from the network. The loop also keeps the serving metrics that GET /metrics shows.

Three ways the engine protects itself from its users: a bound on the requests it holds (a request
arriving when max_num_seqs + max_waiting are unfinished is refused with QueueFullError, HTTP 503,
rather than piling up without limit); aborts (a client that goes away aborts its request, which
frees its slot and KV blocks at once); and isolation (a request whose own inputs break a step is
stopped alone by the engine, its client gets the error, every other stream goes on).
"""

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque

from typing import TYPE_CHECKING

from .metrics import tpot
from .request import RequestOutput
from .sampling_params import SamplingParams

if TYPE_CHECKING:  # the engine pulls in torch; this module is imported by the CLI's --help
    from .engine import Engine

log = logging.getLogger("minicb.server")

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)  # seconds
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)  # seconds per token
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # rows in one step
THROUGHPUT_WINDOW_S = 10.0  # tokens/s is averaged over the last few seconds


class QueueFullError(Exception):
    """The server already holds max_num_seqs + max_waiting unfinished requests: come back later (HTTP 503)."""


class Histogram:
    """A Prometheus histogram: cumulative bucket counts, a sum and a count."""

    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)  # observations <= bucket bound (cumulative)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6f}",
                      f"{name}_count {self.count}"]


class RequestStream:
    """What a handler holds for one accepted request: `async for out in stream` yields a
    RequestOutput per new token, the last one with `.finished`. Leaving the loop early
    (a client disconnect cancels the handler) aborts the request in the engine."""

    def __init__(self, async_engine: "AsyncEngine", request_id: str):
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()  # RequestOutput, or an Exception from the loop
        self.finished = False
        self._async_engine = async_engine

    async def __aiter__(self):
        try:
            while not self.finished:
                item = await self.queue.get()
                if isinstance(item, Exception):
                    self.finished = True
                    raise item
                self.finished = item.finished
                yield item
        finally:
            self.abort()  # cancelled or abandoned half-way: free the engine's resources

    def abort(self) -> None:
        """Abort the request unless it already finished (safe to call more than once)."""
        if not self.finished:
            self.finished = True
            self._async_engine.abort(self.request_id)


class AsyncEngine:
    def __init__(self, engine: "Engine", max_waiting: int = 64, trace_steps: int = 1000):
        if not isinstance(max_waiting, int) or max_waiting < 1:
            raise ValueError(f"max_waiting must be a positive integer, got {max_waiting!r}")
        self.engine = engine
        self.max_waiting = max_waiting
        engine.trace.max_steps = trace_steps  # a server runs for days: keep only the newest steps
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, RequestStream] = {}  # touched by the engine loop only
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # Metrics: written by the engine loop, read by GET /metrics, both under this lock.
        self._lock = threading.Lock()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.batch_size = Histogram(BATCH_BUCKETS)
        self.num_steps = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.finished_total = {"stop": 0, "length": 0, "abort": 0, "error": 0}
        self.rejected_total = 0
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps
        self.gauges: dict[str, int] = {}
        self._publish_gauges()

    # ------------------------------------------------------------------ lifecycle
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the engine loop; outputs are handed to `loop` (the server's event loop)."""
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="minicb-engine-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._inbox.put(("stop",))
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ called from the event loop
    async def submit(self, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0) -> RequestStream:
        """Hand a request to the engine loop. Raises ValueError (the engine refuses it, e.g. too long
        for max_model_len) or QueueFullError; in both cases nothing was queued."""
        if not self.is_running:
            raise RuntimeError("the engine loop is not running")
        stream = RequestStream(self, str(next(self._ids)))
        accepted = self._loop.create_future()
        self._inbox.put(("add", stream, prompt_token_ids, params, priority, accepted))
        try:
            await accepted
        except asyncio.CancelledError:  # the client left before the engine answered
            self.abort(stream.request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Thread-safe: ask the engine loop to abort a request (a no-op if it already finished)."""
        self._inbox.put(("abort", request_id))

    # ------------------------------------------------------------------ the engine loop (its own thread)
    def _run(self) -> None:
        while True:
            idle = not self.engine.has_unfinished_requests()
            if not self._drain_inbox(block=idle):
                break
            if self.engine.has_unfinished_requests():
                self._step()
        for rid in list(self._streams):  # shutting down: nobody will finish these
            self._abort(rid)

    def _drain_inbox(self, block: bool) -> bool:
        """Handle every waiting command (when idle, wait a little for the first). False: stop."""
        try:
            cmd = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd[0] == "stop":
                return False
            if cmd[0] == "add":
                self._add(*cmd[1:])
            else:
                self._abort(cmd[1])
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return True

    @property
    def capacity(self) -> int:
        """Unfinished requests the server holds at most: every batch slot, plus max_waiting."""
        return self.engine.config.max_num_seqs + self.max_waiting

    def _add(self, stream: RequestStream, prompt_token_ids, params, priority, accepted: asyncio.Future) -> None:
        error = None
        held = len(self.engine.scheduler.requests)  # every unfinished request, running or not
        if held >= self.capacity:
            error = QueueFullError(f"server full: it holds {held} unfinished requests (max_num_seqs="
                                   f"{self.engine.config.max_num_seqs} + max_waiting={self.max_waiting}); retry later")
            with self._lock:
                self.rejected_total += 1
        else:
            try:
                self.engine.add_request(prompt_token_ids, params, priority, request_id=stream.request_id)
                self._streams[stream.request_id] = stream
            except ValueError as e:  # the scheduler refused it; its state is unchanged
                error = e
            except Exception as e:  # a bug must not kill the engine loop
                log.exception("add_request failed")
                error = RuntimeError(f"the engine could not add this request: {type(e).__name__}: {e}")
        self._publish_gauges()  # first, so that /metrics already counts a request its client sees accepted
        self._loop.call_soon_threadsafe(_resolve, accepted, error)

    def _abort(self, request_id: str) -> None:
        out = self.engine.abort_request(request_id)  # None if it finished in the meantime
        stream = self._streams.pop(request_id, None)
        if out is not None:
            self._record_finished([out])
            if stream is not None:
                self._loop.call_soon_threadsafe(_deliver, [(stream.queue, out)])
        self._publish_gauges()

    def _step(self) -> None:
        try:
            # Aborted requests also come back from step() without a token; _abort has
            # already delivered and counted those.
            outputs = self.engine.step()
        except Exception as e:  # a bug outside the model (the engine stops failed requests itself)
            log.exception("engine step failed; aborting the %d requests in flight", len(self._streams))
            self._fail_all(e)
            return
        # Requests stopped for an error get it delivered; aborted ones were delivered by _abort.
        failed = [o for o in outputs if o.error is not None]
        outputs = [o for o in outputs if o.outputs[0].new_token_ids]
        now = time.perf_counter()
        trace = self.engine.trace
        rows = len(trace.steps[-1].rows) if self.engine.config.record_trace and trace.steps else len(outputs)
        with self._lock:
            self.num_steps += 1
            self.batch_size.observe(rows)
            self.generation_tokens_total += len(outputs)  # one new token per output
            self._recent.append((now, len(outputs)))
            while self._recent and self._recent[0][0] < now - THROUGHPUT_WINDOW_S:
                self._recent.popleft()
        self._record_finished([o for o in outputs if o.finished] + failed)
        deliveries = []
        for out in failed:
            stream = self._streams.pop(out.request_id, None)
            if stream is not None:
                deliveries.append((stream.queue, RuntimeError(f"this request failed in the engine and was "
                                                              f"stopped: {out.error}")))
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                deliveries.append((stream.queue, out))
                if out.finished:
                    del self._streams[out.request_id]
        self._publish_gauges()  # first, so that a client reading /metrics after its last token sees it freed
        if deliveries:
            self._loop.call_soon_threadsafe(_deliver, deliveries)

    def _fail_all(self, error: Exception) -> None:
        failure = RuntimeError(f"the engine failed while running this request: {type(error).__name__}: {error}")
        for rid, stream in list(self._streams.items()):
            self.engine.abort_request(rid)
            with self._lock:
                self.finished_total["error"] += 1
            self._loop.call_soon_threadsafe(_deliver, [(stream.queue, failure)])
        self._streams.clear()
        for req in list(self.engine.scheduler.requests):  # anything left without a listener
            self.engine.abort_request(req)
        self._publish_gauges()

    def _record_finished(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            for out in outputs:
                self.finished_total[out.outputs[0].finish_reason] += 1
                self.prompt_tokens_total += len(out.prompt_token_ids)
                if out.metrics.ttft is not None:
                    self.ttft.observe(out.metrics.ttft)
                t = tpot(out.metrics, len(out.outputs[0].token_ids))
                if t is not None:
                    self.tpot.observe(t)

    def _publish_gauges(self) -> None:
        sched = self.engine.scheduler
        bm = sched.block_manager
        gauges = dict(num_requests_running=len(sched.running), num_requests_waiting=len(sched.waiting),
                      num_requests_swapped=len(sched.swapped), kv_blocks_used=bm.num_used_blocks,
                      kv_blocks_free=bm.num_free_blocks, kv_blocks_total=bm.num_blocks)
        with self._lock:
            self.gauges = gauges

    def __repr__(self):
        g = self.gauges
        return (f"AsyncEngine(running={g['num_requests_running']}, waiting={g['num_requests_waiting']}"
                f"/{self.max_waiting}, swapped={g['num_requests_swapped']}, kv_blocks_used="
                f"{g['kv_blocks_used']}/{g['kv_blocks_total']}, steps={self.num_steps}, "
                f"loop={'running' if self.is_running else 'stopped'})")

    # ------------------------------------------------------------------ Prometheus text format
    def metrics_text(self) -> str:
        with self._lock:
            window = sum(n for _, n in self._recent)
            lines = []
            for name, value in self.gauges.items():
                lines += [f"# TYPE minicb_{name} gauge", f"minicb_{name} {value}"]
            lines += ["# HELP minicb_generation_tokens_per_second output tokens/s over the last "
                      f"{THROUGHPUT_WINDOW_S:.0f} s", "# TYPE minicb_generation_tokens_per_second gauge",
                      f"minicb_generation_tokens_per_second {window / THROUGHPUT_WINDOW_S:.3f}"]
            for name, value in (("engine_steps", self.num_steps), ("prompt_tokens", self.prompt_tokens_total),
                                ("generation_tokens", self.generation_tokens_total),
                                ("requests_rejected", self.rejected_total)):
                lines += [f"# TYPE minicb_{name}_total counter", f"minicb_{name}_total {value}"]
            lines.append("# TYPE minicb_requests_finished_total counter")
            lines += [f'minicb_requests_finished_total{{finish_reason="{k}"}} {v}'
                      for k, v in self.finished_total.items()]
            for name, hist, about in (("time_to_first_token_seconds", self.ttft, "arrival to first token"),
                                      ("time_per_output_token_seconds", self.tpot, "mean decode pace"),
                                      ("batch_size", self.batch_size, "requests in one engine step")):
                lines += [f"# HELP minicb_{name} {about}", f"# TYPE minicb_{name} histogram"]
                lines += hist.lines(f"minicb_{name}")
        return "\n".join(lines) + "\n"


# These run in the event loop (scheduled with call_soon_threadsafe): asyncio objects are not thread-safe.
def _resolve(future: asyncio.Future, error: Exception | None) -> None:
    if future.cancelled():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _deliver(items: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in items:
        q.put_nowait(item)
