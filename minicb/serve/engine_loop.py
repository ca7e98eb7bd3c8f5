"""AsyncEngine: one engine loop in a background thread, shared by every HTTP request.

The Engine is single-threaded on purpose (its scheduler and block manager are plain Python data),
so exactly one thread, the *engine loop*, ever calls add_request / step / abort_request. HTTP
handlers live in the asyncio event loop and talk to it through queues:

    handler --inbox (queue.Queue, thread-safe)--> engine loop          "add these", "abort those"
    engine loop --loop.call_soon_threadsafe--> one asyncio.Queue per HTTP request    each
    RequestOutput

The engine is an Engine in this process (tests, notebooks, `serve --engine-in-process`) or, by
default, a RemoteEngine whose core runs in its own process (engine_core.py): the loop below is the
same for both, and with a RemoteEngine its step() waits for the core's next step instead of
computing it.

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
import json
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING

from ..sampling_params import SamplingParams
from .engine_core import RemoteEngine
from .metrics import ServerMetrics, engine_stats, request_record

if TYPE_CHECKING:  # the engine pulls in torch; this module is imported by the CLI's --help
    from ..engine.llm_engine import Engine

log = logging.getLogger("minicb.server")


class QueueFullError(Exception):
    """The server already holds max_num_seqs + max_waiting unfinished requests: come back later
    (HTTP 503)."""


class RequestStream:
    """What a handler holds for one accepted HTTP request: its engine requests, one per prompt (each
    with its n samples), and one queue they all deliver into. `async for outputs in stream` yields,
    each time something arrives, the newest RequestOutput of every request that changed (a list),
    until all have finished. Leaving the loop early (a client disconnect cancels the handler)
    aborts every request that has not finished."""

    def __init__(self, async_engine: "AsyncEngine", stream_id: str, num_prompts: int):
        self.id = stream_id
        # prompt i's engine request
        self.request_ids = [f"{stream_id}-{i}" for i in range(num_prompts)]
        self.prompt_index = {rid: i for i, rid in enumerate(self.request_ids)}
        self.queue: asyncio.Queue = asyncio.Queue()  # RequestOutput, or an Exception from the loop
        self.unfinished = set(self.request_ids)
        self._async_engine = async_engine
        # handed to the engine loop (parsed and tokenized already)
        self.received_at = time.perf_counter()

    async def __aiter__(self):
        try:
            while self.unfinished:
                items = [await self.queue.get()]
                while not self.queue.empty():  # a whole step arrives at once: take it all
                    items.append(self.queue.get_nowait())
                newest = {}
                for item in items:
                    if isinstance(item, Exception):
                        raise item
                    # outputs are cumulative: the newest holds the older
                    newest[item.request_id] = item
                    if item.finished:
                        self.unfinished.discard(item.request_id)
                yield list(newest.values())
        finally:
            self.abort()  # cancelled or abandoned half-way: free the engine's resources

    def abort(self) -> None:
        """Abort every request that has not finished (safe to call more than once)."""
        if self.unfinished:
            self._async_engine.abort(sorted(self.unfinished))
            self.unfinished.clear()


class AsyncEngine:
    def __init__(
        self,
        engine: "Engine",
        max_waiting: int = 64,
        trace_steps: int = 1000,
        request_log: str | None = None,
        served_model_name: str | None = None,
    ):
        if not isinstance(max_waiting, int) or max_waiting < 1:
            raise ValueError(f"max_waiting must be a positive integer, got {max_waiting!r}")
        self.engine = engine
        self.max_waiting = max_waiting
        if not isinstance(engine, RemoteEngine):  # the core process keeps its own trace
            # a server runs for days: keep only the newest steps
            engine.trace.max_steps = trace_steps
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, RequestStream] = {}  # touched by the engine loop only
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # written by the loop, read by /metrics
        self.metrics = ServerMetrics(served_model_name or engine.model_name)
        # One JSON line per finished request with the server's own times (python -m minicb serve
        # --request-log): what a client's measurements are compared with (bench/clients/compare.py).
        self.request_log = open(request_log, "a", buffering=1) if request_log else None
        self.metrics.publish_gauges(self._gauges())

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
        if isinstance(self.engine, RemoteEngine):
            self.engine.shutdown(timeout)

    @property
    def is_running(self) -> bool:
        """The engine loop runs, and so does the engine core if it has a process of its own."""
        alive = self.engine.is_alive() if isinstance(self.engine, RemoteEngine) else True
        return self._thread is not None and self._thread.is_alive() and alive

    # ------------------------------------------------------------------ called from the event loop
    async def submit(
        self, prompts: list[list[int]], params: SamplingParams, priority: int = 0
    ) -> RequestStream:
        """Hand the prompts of one HTTP request to the engine loop, one engine request each, all or
        nothing. Raises ValueError (the engine refuses one, e.g. too long for max_model_len) or
        QueueFullError; in both cases nothing was queued."""
        if not self.is_running:
            dead_core = isinstance(self.engine, RemoteEngine) and not self.engine.is_alive()
            raise RuntimeError(
                "the engine core process died" if dead_core else "the engine loop is not running"
            )
        stream = RequestStream(self, str(next(self._ids)), len(prompts))
        accepted = self._loop.create_future()
        self._inbox.put(("add", stream, prompts, params, priority, accepted))
        try:
            await accepted
        except asyncio.CancelledError:  # the client left before the engine answered
            self.abort(stream.request_ids)
            raise
        return stream

    def abort(self, request_ids: list[str]) -> None:
        """Thread-safe: ask the engine loop to abort requests (a no-op for those already
        finished)."""
        self._inbox.put(("abort", request_ids))

    # ------------------------------------------------------------------ the engine loop (its own
    # thread)
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
                for request_id in cmd[1]:
                    self._abort(request_id)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return True

    @property
    def capacity(self) -> int:
        """Unfinished requests the server holds at most: every batch slot, plus max_waiting."""
        return self.engine.config.max_num_seqs + self.max_waiting

    def _add(
        self,
        stream: RequestStream,
        prompts: list[list[int]],
        params,
        priority,
        accepted: asyncio.Future,
    ) -> None:
        error = None
        held = sum(
            not all(s.is_finished for s in group)  # every unfinished request, running or not
            for group in self.engine.output_processor.samples.values()
        )
        if held + len(prompts) > self.capacity:
            more = f" and this request has {len(prompts)} prompts" if len(prompts) > 1 else ""
            error = QueueFullError(
                f"server full: it holds {held} unfinished requests{more} (max_num_seqs="
                f"{self.engine.config.max_num_seqs} + max_waiting={self.max_waiting}); retry later"
            )
            self.metrics.count_rejected()
        else:
            added = []
            try:
                for request_id, prompt_token_ids in zip(stream.request_ids, prompts):
                    self.engine.add_request(
                        prompt_token_ids, params, priority, request_id=request_id
                    )
                    added.append(request_id)
            except (
                Exception
            ) as e:  # all or nothing: no step ran since the first was added, undo them
                for request_id in added:
                    self.engine.abort_request(request_id)
                where = f"prompt {len(added)}: " if len(prompts) > 1 else ""
                if isinstance(e, ValueError):  # the scheduler refused it; its state is unchanged
                    error = ValueError(where + str(e))
                else:  # a bug must not kill the engine loop
                    log.exception("add_request failed")
                    error = RuntimeError(
                        f"{where}the engine could not add this request: {type(e).__name__}: {e}"
                    )
            else:
                self._streams.update(dict.fromkeys(stream.request_ids, stream))
        # first, so that /metrics already counts a request its client sees accepted
        self.metrics.publish_gauges(self._gauges())
        self._loop.call_soon_threadsafe(_resolve, accepted, error)

    def _abort(self, request_id: str) -> None:
        out = self.engine.abort_request(request_id)  # None if it finished in the meantime
        stream = self._streams.pop(request_id, None)
        if out is not None:
            self.metrics.record_finished([out])
            if stream is not None:
                self._loop.call_soon_threadsafe(_deliver, [(stream.queue, out)])
        self.metrics.publish_gauges(self._gauges())

    def _step(self) -> None:
        try:
            # Aborted requests also come back from step() without a token; _abort has
            # already delivered and counted those.
            outputs = self.engine.step()
        except Exception as e:  # a bug outside the model (the engine stops failed requests itself)
            log.exception(
                "engine step failed; aborting the %d requests in flight", len(self._streams)
            )
            self._fail_all(e)
            return
        # Requests stopped for an error get it delivered; aborted ones were delivered by _abort.
        failed = [o for o in outputs if o.error is not None]
        outputs = [
            o for o in outputs if o.error is None and any(s.new_token_ids for s in o.outputs)
        ]
        rows, num_preempted = self._step_info(outputs)
        if (
            not isinstance(self.engine, RemoteEngine) or self.engine.stepped
        ):  # not a wait that saw no step
            self.metrics.record_step(
                rows, sum(len(s.new_token_ids) for o in outputs for s in o.outputs), num_preempted
            )
        self.metrics.record_finished([o for o in outputs if o.finished] + failed)
        deliveries = []
        for out in failed:
            stream = self._streams.pop(out.request_id, None)
            if stream is not None:
                deliveries.append(
                    (
                        stream.queue,
                        RuntimeError(
                            f"this request failed in the engine and was stopped: {out.error}"
                        ),
                    )
                )
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                deliveries.append((stream.queue, out))
                if out.finished:
                    del self._streams[out.request_id]
                    if self.request_log is not None:  # the server's view of it (--request-log)
                        self.request_log.write(
                            json.dumps(request_record(out, stream.id, stream.received_at)) + "\n"
                        )
        # first, so that a client reading /metrics after its last token sees it freed
        self.metrics.publish_gauges(self._gauges())
        if deliveries:
            self._loop.call_soon_threadsafe(_deliver, deliveries)

    def _fail_all(self, error: Exception) -> None:
        failure = RuntimeError(
            f"the engine failed while running this request: {type(error).__name__}: {error}"
        )
        for rid, stream in list(self._streams.items()):
            self.engine.abort_request(rid)
            self.metrics.count_error()
            self._loop.call_soon_threadsafe(_deliver, [(stream.queue, failure)])
        self._streams.clear()
        for req in list(self.engine.output_processor.samples):  # anything left without a listener
            self.engine.abort_request(req)
        self.metrics.publish_gauges(self._gauges())

    def _step_info(self, outputs) -> tuple[int, int]:
        """(rows in the batch, requests preempted) of the step just run, from the trace or the
        core."""
        if isinstance(self.engine, RemoteEngine):
            return self.engine.last_step_rows, self.engine.last_step_preempted
        rec = (
            self.engine.trace.steps[-1]
            if self.engine.config.record_trace and self.engine.trace.steps
            else None
        )
        return (
            (len(rec.rows), len(rec.preempted) + len(rec.swapped_out)) if rec else (len(outputs), 0)
        )

    def _gauges(self) -> dict:
        return (
            self.engine.stats
            if isinstance(self.engine, RemoteEngine)
            else engine_stats(self.engine)
        )

    def metrics_text(self) -> str:
        return self.metrics.text()

    def __repr__(self):
        g = self.metrics.gauges
        return (
            f"AsyncEngine(running={g['num_requests_running']}, waiting={g['num_requests_waiting']}"
            f"/{self.max_waiting}, swapped={g['num_requests_swapped']}, kv_blocks_used="
            f"{g['kv_blocks_used']}/{g['kv_blocks_total']}, steps={self.metrics.num_steps}, "
            f"loop={'running' if self.is_running else 'stopped'})"
        )


# These run in the event loop (scheduled with call_soon_threadsafe): asyncio objects are not thread-
# safe.
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
