"""What connections may hold: a bounded number of sockets, none of them slow to send its request
for long, and none kept from a client that sends a request by one that sends none.

uvicorn (its HTTP/1.1 protocol, uvicorn/protocols/http/h11_impl.py) leaves two things open. Its
limit_concurrency answers 503 only when a request comes, so a connection that sends nothing keeps
its socket meanwhile; and its only timer runs after a response (timeout_keep_alive), so a
connection that never sends a whole request is never closed. 20,000 such sockets held every
file descriptor of the server: no new client got in, and asyncio logged every accept that failed
(the log grew 180 MB in 30 s). BoundedH11Protocol, uvicorn's protocol with these two bounds:

- at most limit_concurrency connections are open. When one more comes, the connection that has
  waited longest for a request head (idle: it has no request in flight) is closed to make room;
  only when every connection has a request in flight is the newcomer answered 503 and closed.
  Idle sockets, however many, never keep out a client that sends a request;
- a request, head and body, must arrive within timeout_request seconds of connecting (or of its
  first byte after a response), as nginx's client_header_timeout and client_body_timeout bound
  them: a client that trickles a byte at a time holds its socket that long at most.

File descriptors then stay under limit_concurrency + backlog (asyncio accepts a backlog's worth
before any is closed), which `serve` checks against the process's limit when it starts.
"""

import asyncio
import functools
import json
import logging
import time
from dataclasses import dataclass

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("minicb.server")

# the model's files, the engine core's pipes, threads' wake-up pipes, the log
FD_HEADROOM = 256


@dataclass(frozen=True)
class ConnectionLimits:
    """uvicorn's settings, by uvicorn's names, and one of minicb's (`serve --limit-concurrency`)."""

    # uvicorn's name and meaning: connections open at most (see the module's docstring for what
    # happens to one more)
    limit_concurrency: int = 512
    # uvicorn's: seconds an idle keep-alive connection stays open after a response
    timeout_keep_alive: float = 5.0
    # Seconds from connecting (or from the first byte after a response) to a whole request, head
    # and body; uvicorn has no such timer. A normal request (KBs) takes milliseconds
    timeout_request: float = 10.0
    # uvicorn's: connections the kernel queues before the server accepts them
    backlog: int = 2048

    def __post_init__(self):
        for name in ("limit_concurrency", "backlog"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("timeout_keep_alive", "timeout_request"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")

    def uvicorn_config(self, app, **kwargs) -> uvicorn.Config:
        """A uvicorn.Config for `app` whose connections are bounded so (kwargs: host, port...)."""
        protocol = functools.partial(
            BoundedH11Protocol,
            max_connections=self.limit_concurrency,
            timeout_request=self.timeout_request,
            idle=IdleConnections(self.limit_concurrency),
        )
        return uvicorn.Config(
            app,
            http=protocol,
            timeout_keep_alive=self.timeout_keep_alive,
            backlog=self.backlog,
            **kwargs,
        )

    @property
    def file_descriptors(self) -> int:
        """Descriptors the server may need: every connection, a full accept queue, the rest."""
        return self.limit_concurrency + self.backlog + FD_HEADROOM


class IdleConnections:
    """The connections of one server that have no request in flight, the longest-waiting first;
    and the newcomers refused, logged at most every LOG_EVERY_S (one line per refused socket
    would flood the log exactly when someone opens thousands)."""

    LOG_EVERY_S = 10.0

    def __init__(self, limit: int):
        self.limit = limit
        self.waiting: dict[BoundedH11Protocol, None] = {}  # insertion order: the oldest first
        self.num_refused = 0
        self.logged_at = -self.LOG_EVERY_S

    def add(self, conn: "BoundedH11Protocol") -> None:
        self.waiting.setdefault(conn, None)

    def discard(self, conn: "BoundedH11Protocol") -> None:
        self.waiting.pop(conn, None)

    def oldest(self) -> "BoundedH11Protocol | None":
        return next(iter(self.waiting), None)

    def refused(self) -> bytes:
        """Count a refused newcomer; the bytes of its 503."""
        self.num_refused += 1
        now = time.monotonic()
        if now - self.logged_at >= self.LOG_EVERY_S:
            self.logged_at = now
            log.warning(
                "%d connections refused so far: %d were open, each with a request in flight "
                "(--limit-concurrency)",
                self.num_refused,
                self.limit,
            )
        error = {
            "message": f"server busy: {self.limit} requests in flight (--limit-concurrency); "
            "retry later",
            "type": "overloaded",
            "param": None,
            "code": 503,
        }
        body = json.dumps({"error": error}).encode()
        head = (
            "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            f"connection: close\r\nretry-after: 1\r\ncontent-length: {len(body)}\r\n\r\n"
        )
        return head.encode() + body


class BoundedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, bounded as the module's docstring says. A connection is idle
    (closed first to make room) from connecting, and again from the end of each response, until a
    request head arrives; its request timer runs from connecting, or from a request's first byte,
    until the request's body has arrived whole."""

    def __init__(self, *args, max_connections: int, timeout_request: float, idle, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_connections = max_connections
        self.timeout_request = timeout_request
        self.idle: IdleConnections = idle  # shared by every connection of the server
        self.request_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:  # the set holds this one too
            oldest = self.idle.oldest()
            if oldest is None:  # every other connection has a request in flight
                self.connections.discard(self)  # a refused socket counts against nobody
                transport.write(self.idle.refused())
                transport.close()
                return
            oldest.close_now()
        self.idle.add(self)
        self.start_timer()  # the clock runs from connecting

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        is_idle = self.cycle is None or self.cycle.response_complete
        if is_idle:  # a request head has begun, or more of it came
            self.start_timer()
        elif self.cycle.more_body:  # the head came, the body is coming
            self.idle.discard(self)
            self.start_timer()
        else:  # the whole request is in: the app has its time
            self.idle.discard(self)
            self.stop_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # arms uvicorn's keep-alive timer
        is_idle = self.cycle.response_complete  # (a pipelined request may have begun)
        if is_idle and not self.transport.is_closing():
            self.idle.add(self)

    def connection_lost(self, exc) -> None:
        super().connection_lost(exc)
        self.idle.discard(self)
        self.stop_timer()

    def start_timer(self) -> None:
        if self.request_timer is None:
            self.request_timer = self.loop.call_later(self.timeout_request, self.close_now)

    def stop_timer(self) -> None:
        if self.request_timer is not None:
            self.request_timer.cancel()
            self.request_timer = None

    def close_now(self) -> None:
        """Close this connection: its request came too slowly, or a newcomer needs its place."""
        self.idle.discard(self)
        self.stop_timer()
        self.connections.discard(self)  # out of the count at once: its socket is closing
        self.transport.close()
