"""RequestStream: what an HTTP handler holds for one accepted request, and how its outputs reach it.

The engine loop (engine_loop.py, its own thread) hands every step's outputs to the server's event
loop, which puts them in the stream of their HTTP request; the handler takes them with
`async for outputs in stream`. Two things keep one client from costing everyone else:

- Outputs are coalesced, not queued: an output holds everything its request made so far (text and
  tokens are cumulative), so a stream keeps only the newest output of each request. A client that
  reads slowly, or not at all, holds at most one output per request, never one per step.
- With vLLM's --stream-interval N, a request's output is handed over when N new tokens have come
  since the last one was (and its first and last at once): the same text in fewer chunks, each
  of which costs the API process its framing, JSON and socket write (`due`).
- The engine loop can tell a client that stopped reading: the stream records when its consumer
  last took outputs (`taken_at`), and the loop, each time it hands the stream more, how long
  outputs have waited for it (`stalled`). A stream whose outputs wait longer than the server's
  stall_timeout_s is aborted by the loop, so its slots and KV blocks go back to the others.
"""

import asyncio
import time
from typing import Callable


class StreamStalledError(RuntimeError):
    """The consumer of a stream took nothing for stall_timeout_s while outputs waited for it (its
    client stopped reading): the engine aborted its requests."""


class RequestStream:
    """The engine requests of one HTTP request, one per prompt (each with its n samples), and the
    newest output of each. `async for outputs in stream` yields, each time something arrives, the
    newest RequestOutput of every request that changed (a list), until all have finished. Leaving
    the loop early (a client disconnect cancels the handler) aborts every request that has not
    finished."""

    def __init__(
        self,
        stream_id: str,
        num_prompts: int,
        abort: Callable[[list[str]], None],
        interval: int = 1,
    ):
        self.id = stream_id
        # prompt i's engine request
        self.request_ids = [f"{stream_id}-{i}" for i in range(num_prompts)]
        self.prompt_index = {rid: i for i, rid in enumerate(self.request_ids)}
        self.unfinished = set(self.request_ids)
        self._abort_requests = abort  # AsyncEngine.abort: thread-safe
        # handed to the engine loop (parsed and tokenized already)
        self.received_at = time.perf_counter()
        # Touched in the event loop only (put, __aiter__): per request, its newest output not yet
        # taken; an error from the engine loop, which ends the stream.
        self._newest: dict[str, object] = {}
        self._error: Exception | None = None
        self._arrived = asyncio.Event()
        # When the consumer last took outputs, None while it waits for more (then no output waits
        # for it). Written in the event loop, read by the engine loop: one store of a float or
        # None, which a reader in another thread sees whole.
        self.taken_at: float | None = self.received_at
        # The engine loop's own: since when outputs have waited for the consumer (stalled()); and
        # per request, its tokens when it was last handed an output (due())
        self.waiting_since: float | None = None
        self.interval = interval
        self._handed: dict[str, int] = {}

    # ------------------------------------------------------------------ the event loop's side
    def put(self, item) -> None:
        """A RequestOutput (or an Exception) from the engine loop, run in the event loop."""
        if isinstance(item, Exception):
            self._error = self._error or item
        else:  # cumulative: the newest output of a request holds all the older ones
            self._newest[item.request_id] = item
        self._arrived.set()

    async def __aiter__(self):
        try:
            while self.unfinished:
                self.taken_at = None  # waiting: whatever arrives is taken at once
                await self._arrived.wait()
                self._arrived.clear()
                if not self.unfinished:  # aborted meanwhile (its client left)
                    return
                self.taken_at = time.perf_counter()
                if self._error is not None:
                    raise self._error
                outputs = list(self._newest.values())
                self._newest = {}
                for out in outputs:
                    if out.finished:
                        self.unfinished.discard(out.request_id)
                yield outputs
        finally:
            self.abort()  # cancelled or abandoned half-way: free the engine's resources

    @property
    def num_waiting(self) -> int:
        """Outputs waiting for the consumer: at most one per request, however long it waits."""
        return len(self._newest)

    def abort(self) -> None:
        """Abort every request that has not finished (safe to call more than once); an iteration
        waiting for outputs ends. Called in the event loop."""
        if self.unfinished:
            self._abort_requests(sorted(self.unfinished))
            self.unfinished.clear()
            self._arrived.set()

    # ------------------------------------------------------------------ the engine loop's side
    def due(self, out) -> bool:
        """Called by the engine loop with each output of its step: is it handed to this stream
        now? Every output with an interval of 1. Otherwise a request's first output, its last, and
        one each time `interval` new tokens (its longest sample's) have come since the last handed
        over. An output skipped loses nothing: the next holds everything so far."""
        if self.interval == 1:
            return True
        tokens = max(len(s.token_ids) for s in out.outputs)
        handed = self._handed.get(out.request_id)
        if handed is None or out.finished or tokens - handed >= self.interval:
            self._handed[out.request_id] = tokens
            return True
        return False

    def stalled(self, now: float, timeout_s: float) -> bool:
        """Called by the engine loop each time it hands this stream outputs: have outputs waited
        for the consumer longer than `timeout_s`? They wait from the first output handed over
        after the consumer last took; a consumer waiting for outputs, or one that took since then,
        has caught up (one that never started iterating took last when the stream was made)."""
        taken = self.taken_at
        caught_up = taken is None or self.waiting_since is None or taken >= self.waiting_since
        if caught_up:
            self.waiting_since = now
        return now - self.waiting_since > timeout_s

    def __repr__(self):
        return (
            f"RequestStream({self.id!r}, prompts={len(self.request_ids)}, "
            f"unfinished={len(self.unfinished)}, waiting={self.num_waiting})"
        )


# These run in the event loop (scheduled by the engine loop with call_soon_threadsafe): asyncio
# objects are not thread-safe.
def resolve(accepted: asyncio.Future, error: Exception | None) -> None:
    """Answer a submit(): the stream was accepted, or the error why not."""
    if accepted.cancelled():
        return
    if error is None:
        accepted.set_result(None)
    else:
        accepted.set_exception(error)


def deliver(items: list[tuple[RequestStream, object]]) -> None:
    """Hand each stream its output (or error) of a step."""
    for stream, item in items:
        stream.put(item)
