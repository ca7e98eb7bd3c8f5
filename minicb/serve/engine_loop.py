"""AsyncEngine: one engine loop in a background thread, shared by every HTTP request.

The Engine is single-threaded on purpose (its scheduler and block manager are plain Python data),
so exactly one thread, the *engine loop*, ever calls add_request / step / abort_request. HTTP
handlers live in the asyncio event loop and talk to it through queues:

    handler --inbox (queue.Queue, thread-safe)--> engine loop       "add these", "abort those"
    engine loop --loop.call_soon_threadsafe--> the request's RequestStream     its RequestOutputs

The engine is an Engine in this process (tests, notebooks, `serve --engine-in-process`) or, by
default, a RemoteEngine whose core runs in its own process (engine_core.py), whose step() waits
for the core's next step (a command in the inbox ends the wait). The loop drains its inbox between
two steps, so a request that arrives while a step runs joins the very next step: continuous
batching (Orca, Yu et al., OSDI 2022) as seen from the network. It also keeps GET /metrics' data.

Four ways the engine protects itself from its users: a bound on the requests it holds (one that
arrives when max_num_seqs + max_waiting are unfinished is refused, QueueFullError, HTTP 503);
aborts (a client that goes away aborts its request, which frees its slot and KV blocks at once);
stalls (a client that stops reading its stream for stall_timeout_s has its requests aborted too,
request_stream.py); and isolation (a request whose own inputs break a step is stopped alone by the
engine, its client gets the error, every other stream goes on).

What it cannot survive is said everywhere: once the core's process dies (or this loop breaks),
`fatal_error` says why, the gauges read 0 (minicb:engine_alive too), new requests are refused,
and `on_fatal` is called once: the server exits for a supervisor to restart (as vLLM's does).
"""

import asyncio
import itertools
import json
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterator

from ..sampling_params import SamplingParams
from .engine_core import RemoteEngine
from .metrics import ServerMetrics, request_record, server_stats, stopped_stats
from .request_stream import RequestStream, StreamStalledError, deliver, resolve

if TYPE_CHECKING:  # the engine pulls in torch; this module is imported by the CLI's --help
    from ..engine.llm_engine import Engine

log = logging.getLogger("minicb.server")


class QueueFullError(Exception):
    """The server holds max_num_seqs + max_waiting unfinished requests: come back later (503)."""


class AsyncEngine:
    def __init__(
        self,
        engine: "Engine",
        max_waiting: int = 64,
        trace_steps: int = 1000,
        request_log: str | None = None,
        served_model_name: str | None = None,
        stall_timeout_s: float = 60.0,
        on_fatal: Callable[[str], None] | None = None,
        stream_ids: Iterator[int] | None = None,
        stream_interval: int = 1,
    ):
        """`stall_timeout_s`: a stream whose outputs wait this long for a client that takes none is
        aborted (60 s: far above a reading client's pauses, short against a long request's life).
        `stream_interval`: vLLM's --stream-interval, tokens per output handed (RequestStream.due).
        `on_fatal(message)`: called once, on the engine loop's thread, when fatal_error is set.
        `stream_ids`: where the streams' ids come from (data-parallel replicas share one count, so
        that no two responses of the server have the same id)."""
        if not isinstance(max_waiting, int) or max_waiting < 1:
            raise ValueError(f"max_waiting must be a positive integer, got {max_waiting!r}")
        if not isinstance(stall_timeout_s, (int, float)) or not stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be a number > 0, got {stall_timeout_s!r}")
        if not isinstance(stream_interval, int) or stream_interval < 1:
            raise ValueError(f"stream_interval must be a positive integer, got {stream_interval!r}")
        self.stream_interval = stream_interval
        self.engine = engine
        self.max_waiting = max_waiting
        self.stall_timeout_s = stall_timeout_s
        self.fatal_error: str | None = None  # why the engine cannot serve (its core died, ...)
        self._on_fatal = on_fatal
        if not isinstance(engine, RemoteEngine):  # a server runs for days: the newest steps only
            engine.trace.max_steps = trace_steps
        self._inbox: queue.Queue = queue.Queue()
        self._wake = engine.wake if isinstance(engine, RemoteEngine) else lambda: None
        self._streams: dict[str, RequestStream] = {}  # touched by the engine loop only
        self._ids = stream_ids if stream_ids is not None else itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # written by the loop, read by /metrics
        self.metrics = ServerMetrics(served_model_name or engine.model_name)
        # --request-log: a JSON line per finished request, the server's times (clients/compare.py)
        self.request_log = open(request_log, "a", buffering=1) if request_log else None
        self.metrics.publish_gauges(self._gauges())

    # ------------------------------------------------------------------ lifecycle
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the engine loop; outputs are handed to `loop` (the server's event loop)."""
        self._loop = loop
        if not isinstance(self.engine, RemoteEngine) and self.engine.runner.device.type == "cpu":
            from ..worker.executor import release_openmp_threads

            release_openmp_threads()
        self._thread = threading.Thread(target=self._run, name="minicb-engine-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._inbox.put(("stop",))
            self._wake()
            self._thread.join(timeout)
        if isinstance(self.engine, RemoteEngine):
            self.engine.shutdown(timeout)

    @property
    def is_running(self) -> bool:
        """The engine loop runs, and so does the engine core if it has a process of its own."""
        return self.failure() is None

    def failure(self) -> str | None:
        """Why this engine cannot serve, None while it can: its fatal error, its core process found
        dead (while idle, no step noticed it yet), or its loop not running."""
        if self.fatal_error is not None:
            return self.fatal_error
        if isinstance(self.engine, RemoteEngine) and not self.engine.is_alive():
            return f"the engine core process died (exit code {self.engine.process.exitcode})"
        loop_runs = self._thread is not None and self._thread.is_alive()
        return None if loop_runs else "the engine loop is not running"

    def load(self) -> tuple[int, int]:
        """(running, waiting) for a router: the gauges as the engine loop last published them,
        with every other unfinished request this process holds counted as waiting (a core reports
        a request only after its next step; vLLM V1's client counts what it sent meanwhile the
        same way). Swapped requests wait too."""
        g = self.metrics.gauges
        running = g.get("num_requests_running", 0)
        waiting = g.get("num_requests_waiting", 0) + g.get("num_requests_swapped", 0)
        held = len(self.engine.output_processor.samples)  # a dict's len: safe from this thread
        return running, max(waiting, held - running)

    # ------------------------------------------------------------------ called from the event loop
    async def submit(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        priority: int = 0,
        user: str | None = None,
    ) -> RequestStream:
        """Hand the prompts of one HTTP request to the engine loop, one engine request each, all or
        nothing. `user` names the tenant (OpenAI's field; scheduling_policy="vtc" is fair between
        tenants, the other policies ignore it). Raises ValueError (the engine refuses one, e.g. too
        long for max_model_len) or QueueFullError; in both cases nothing was queued."""
        failure = self.failure()
        if failure is not None:
            raise RuntimeError(failure)
        stream = RequestStream(str(next(self._ids)), len(prompts), self.abort, self.stream_interval)
        accepted = self._loop.create_future()
        self._inbox.put(("add", stream, prompts, params, priority, user, accepted))
        self._wake()
        try:
            await accepted
        except asyncio.CancelledError:  # the client left before the engine answered
            self.abort(stream.request_ids)
            raise
        return stream

    def abort(self, request_ids: list[str]) -> None:
        """Thread-safe: ask the engine loop to abort requests (a no-op for finished ones)."""
        self._inbox.put(("abort", request_ids))
        self._wake()

    # ------------------------------------------------------ the engine loop (in its own thread)
    def _run(self) -> None:
        try:
            while True:
                # after a fatal error: wait on the inbox (refusing what comes), never spin
                can_step = self.fatal_error is None and self.engine.has_unfinished_requests()
                if not self._drain_inbox(block=not can_step):
                    break
                if self.fatal_error is None and self.engine.has_unfinished_requests():
                    self._step()
            for rid in list(self._streams):  # shutting down: nobody will finish these
                self._abort(rid)
        except Exception as e:  # a bug in the loop itself: nobody would answer any more
            log.exception("the engine loop stopped")
            why = f"the engine loop stopped: {type(e).__name__}: {e}"
            self._fail_streams(RuntimeError(why))
            self._fatal(why)

    def _fatal(self, message: str) -> None:
        """The engine can serve no more: say so everywhere, once (on the engine loop's thread)."""
        if self.fatal_error is not None:
            return
        self.fatal_error = message
        log.error("%s: the server cannot serve any more requests", message)
        self.metrics.publish_gauges(self._gauges())  # stopped_stats from now on
        if self._on_fatal is not None:
            self._on_fatal(message)

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
        user: str | None,
        accepted: asyncio.Future,
    ) -> None:
        error = None
        held = sum(
            not all(s.is_finished for s in group)  # every unfinished request, running or not
            for group in self.engine.output_processor.samples.values()
        )
        if self.fatal_error is not None:  # it came in as the engine died: nothing can run it now
            error = RuntimeError(self.fatal_error)
        elif held + len(prompts) > self.capacity:
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
                        prompt_token_ids, params, priority, request_id=request_id, user=user
                    )
                    added.append(request_id)
            except Exception as e:  # all or nothing: no step ran since the first was added
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
        self._loop.call_soon_threadsafe(resolve, accepted, error)

    def _abort(self, request_id: str) -> None:
        out = self.engine.abort_request(request_id)  # None if it finished in the meantime
        stream = self._streams.pop(request_id, None)
        if out is not None:
            self.metrics.record_finished([out])
            if stream is not None:
                self._loop.call_soon_threadsafe(deliver, [(stream, out)])
        self.metrics.publish_gauges(self._gauges())

    def _step(self) -> None:
        try:
            # (aborted requests come back without a token: _abort delivered and counted them)
            outputs = self.engine.step()
        except Exception as e:  # a bug outside the model (the engine stops failed requests itself)
            log.exception(
                "engine step failed; aborting the %d requests in flight", len(self._streams)
            )
            why = f"the engine failed while running this request: {type(e).__name__}: {e}"
            self._fail_streams(RuntimeError(why))
            if isinstance(self.engine, RemoteEngine) and self.engine.dead:  # its core is gone
                self._fatal(str(e))
            return
        # Requests stopped for an error get it delivered; aborted ones were delivered by _abort.
        failed = [o for o in outputs if o.error is not None]
        outputs = [
            o for o in outputs if o.error is None and any(s.new_token_ids for s in o.outputs)
        ]
        rows, num_preempted = self._step_info(outputs)
        is_a_step = not isinstance(self.engine, RemoteEngine) or self.engine.stepped
        if is_a_step:  # not a wait for the core that saw no step
            self.metrics.record_step(
                rows, sum(len(s.new_token_ids) for o in outputs for s in o.outputs), num_preempted
            )
        self.metrics.record_finished([o for o in outputs if o.finished] + failed)
        deliveries = []
        for out in failed:
            stream = self._streams.pop(out.request_id, None)
            if stream is not None:
                why = f"this request failed in the engine and was stopped: {out.error}"
                deliveries.append((stream, RuntimeError(why)))
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None and stream.due(out):  # every output, or every N tokens
                deliveries.append((stream, out))
                if out.finished:
                    del self._streams[out.request_id]
                    if self.request_log is not None:  # the server's view of it (--request-log)
                        self.request_log.write(
                            json.dumps(request_record(out, stream.id, stream.received_at)) + "\n"
                        )
        deliveries = self._stop_stalled(deliveries)
        # first, so that a client reading /metrics after its last token sees it freed
        self.metrics.publish_gauges(self._gauges())
        if deliveries:
            self._loop.call_soon_threadsafe(deliver, deliveries)

    def _stop_stalled(self, deliveries: list[tuple[RequestStream, object]]) -> list[tuple]:
        """Abort the requests of every stream whose outputs have waited stall_timeout_s for a
        client that takes none (it stopped reading), freeing their slots and KV blocks for others;
        such a stream gets an error, which goes before its outputs. Returns the deliveries."""
        now = time.perf_counter()
        for stream in dict.fromkeys(stream for stream, _ in deliveries):
            held = [rid for rid in stream.request_ids if self._streams.get(rid) is stream]
            if held and stream.stalled(now, self.stall_timeout_s):
                log.warning(
                    "stream %s took no output in %g s: aborted", stream.id, self.stall_timeout_s
                )
                for request_id in held:
                    self._abort(request_id)
                why = (
                    f"the client took no output for {self.stall_timeout_s:g} s while outputs waited"
                )
                deliveries.append((stream, StreamStalledError(f"{why}: aborted (stall_timeout_s)")))
        return deliveries

    def _fail_streams(self, failure: Exception) -> None:
        """Give every stream in flight `failure` and abort every request the engine holds."""
        for rid, stream in list(self._streams.items()):
            self.engine.abort_request(rid)
            self.metrics.count_error()
            self._loop.call_soon_threadsafe(deliver, [(stream, failure)])
        self._streams.clear()
        for req in list(self.engine.output_processor.samples):  # anything left without a listener
            self.engine.abort_request(req)
        self.metrics.publish_gauges(self._gauges())

    def _step_info(self, outputs) -> tuple[int, int]:
        """(rows in the batch, requests preempted) of the step just run, from the trace or the
        core."""
        if isinstance(self.engine, RemoteEngine):
            return self.engine.last_step_rows, self.engine.last_step_preempted
        if not (self.engine.config.record_trace and self.engine.trace.steps):
            return len(outputs), 0
        rec = self.engine.trace.steps[-1]
        return len(rec.rows), len(rec.preempted) + len(rec.swapped_out)

    def _gauges(self) -> dict:
        remote = isinstance(self.engine, RemoteEngine)
        stats = self.engine.stats if remote else server_stats(self.engine)
        # once dead, the last state it saw is not the state it is in
        return stats if self.fatal_error is None else stopped_stats(stats)

    def metrics_text(self) -> str:
        return self.metrics.text()

    def __repr__(self):
        g = self.metrics.gauges
        return (
            f"AsyncEngine(running={g['num_requests_running']}, waiting={g['num_requests_waiting']}"
            f"/{self.max_waiting}, swapped={g['num_requests_swapped']}, kv_blocks_used="
            f"{g['kv_blocks_used']}/{g['kv_blocks_total']}, steps={self.metrics.num_steps}, "
            f"loop={'running' if self.is_running else 'stopped'}"
            f"{f', fatal_error={self.fatal_error!r}' if self.fatal_error else ''})"
        )
