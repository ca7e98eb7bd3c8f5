"""Data parallelism behind one server: N whole engines, one API process (`serve
--data-parallel-size N`, vLLM V1's flag).

    API process (HTTP, tokenization, detokenization)               engine-core processes
      DataParallelEngine.submit(prompt)                               core 0: scheduler, KV cache
        Router.route(prompt, loads) -> i   --> AsyncEngine i --pipe-->  core 1: scheduler, KV cache
      /metrics: every replica's series, labelled engine="i"             ...

Each replica is a whole engine with the whole model: its own scheduler, KV cache, prefix cache and
metrics, and its own engine loop thread in this process (engine_loop.py). Nothing is shared between
them, so throughput grows with the replicas as long as each has its own cores or GPU, and a
request's tokens are the ones one replica alone would give it.

Which replica a request goes to is the router's choice (minicb/engine/router.py): round robin,
least loaded (vLLM V1's own: its client scores each engine by its waiting and running counts), or
cache-aware (the replica whose prefix cache is expected to hold most of the prompt, unless the
loads drift too far apart; SGLang's router). The loads are each replica's gauges as its loop last
published them, plus the requests handed to it and not yet accepted: between two steps a burst
of arrivals must not all see the same "least loaded" replica (vLLM's client counts what it sent
between the coordinator's updates the same way).

A replica that dies fails only the streams it held; the router forgets it and the others keep
serving. The server gives up (on_fatal) only when no replica is left. A full replica passes the
request to the next one the router would pick: 503 means the whole fleet is full.
"""

import asyncio
import itertools
import logging
from typing import TYPE_CHECKING, Callable

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import Metric

from ..engine.router import ReplicaLoad, make_router
from ..sampling_params import SamplingParams
from .engine_loop import AsyncEngine, QueueFullError
from .request_stream import RequestStream

if TYPE_CHECKING:
    from ..engine.llm_engine import Engine

log = logging.getLogger("minicb.server")


class DataParallelEngine:
    """AsyncEngine's surface (what build_app uses) over N replicas, each an AsyncEngine."""

    def __init__(
        self,
        engines: list["Engine"],
        routing_policy: str = "least_loaded",
        balance_threshold: int | None = None,
        on_fatal: Callable[[str], None] | None = None,
        **async_engine_kwargs,
    ):
        """`engines`: one per replica, each an Engine or a RemoteEngine (its own core process).
        `on_fatal(message)`: called once, when the last replica died. The other keyword arguments
        go to every replica's AsyncEngine (max_waiting, trace_steps, ...)."""
        if not engines:
            raise ValueError("a data-parallel engine needs at least one replica, got none")
        blocks = {e.config.block_size for e in engines}
        if len(blocks) > 1:
            raise ValueError(f"the replicas must share one block_size, got {sorted(blocks)}")
        ids = itertools.count()  # one count: no two streams of the server share an id
        self.replicas = [
            AsyncEngine(
                e,
                on_fatal=lambda message, i=i: self._replica_died(i, message),
                stream_ids=ids,
                **async_engine_kwargs,
            )
            for i, e in enumerate(engines)
        ]
        self.routing_policy = routing_policy
        router_kwargs = (
            {} if balance_threshold is None else {"balance_threshold": balance_threshold}
        )
        if engines[0].config.num_blocks:  # cache_aware remembers about what a replica can cache
            router_kwargs["capacity_blocks"] = engines[0].config.num_blocks
        self.router = make_router(
            routing_policy, len(engines), block_size=engines[0].config.block_size, **router_kwargs
        )
        self._on_fatal = on_fatal
        self._pending = [0] * len(engines)  # handed to a replica, not yet accepted by its loop
        self._dead: set[int] = set()
        self.registry = CollectorRegistry()
        self.registry.register(_Replicas(self.replicas))
        self.routed = Counter(
            "minicb:router_requests",
            "Requests the router sent to each replica (data parallelism).",
            ["model_name", "engine"],
            registry=self.registry,
        )
        name = self.replicas[0].metrics.model_name
        for i in range(len(engines)):
            self.routed.labels(name, str(i))
        # a replica's own vllm:admission_rejections counts what it refused, some of which the next
        # replica took; this counts the 503s: every replica was full
        self.rejected = Counter(
            "minicb:fleet_admission_rejections",
            "Requests refused because every replica was full (HTTP 503).",
            ["model_name"],
            registry=self.registry,
        )
        self.rejected.labels(name)
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ what build_app uses
    @property
    def engine(self) -> "Engine":
        """A replica's engine, for what they all share: tokenizer, config, model name."""
        return self.replicas[0].engine

    @property
    def capacity(self) -> int:
        """What one request may hold: a request runs whole on one replica."""
        return self.replicas[0].capacity

    @property
    def fatal_error(self) -> str | None:
        """None while a replica can serve; once none can, why each stopped."""
        failures = [r.failure() for r in self.replicas]
        if any(f is None for f in failures):
            return None
        return "; ".join(f"replica {i}: {f}" for i, f in enumerate(failures))

    def failure(self) -> str | None:
        return self.fatal_error

    @property
    def is_running(self) -> bool:
        return any(r.is_running for r in self.replicas)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        for r in self.replicas:
            r.start(loop)

    def stop(self, timeout: float = 10.0) -> None:
        for r in self.replicas:
            r.stop(timeout)

    def metrics_text(self) -> str:
        """Every replica's series with an `engine` label (vLLM V1's label for data-parallel
        engines), and the router's counts."""
        return generate_latest(self.registry).decode()

    # ------------------------------------------------------------------ routing
    def loads(self) -> list[ReplicaLoad]:
        loads = []
        for i, r in enumerate(self.replicas):
            running, waiting = r.load()
            loads.append(ReplicaLoad(running, waiting + self._pending[i]))
        return loads

    def _live(self) -> None:
        """Forget replicas found dead since the last request (a core that died while idle)."""
        for i, r in enumerate(self.replicas):
            if i not in self._dead and r.failure() is not None:
                self._forget(i, r.failure())

    async def submit(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        priority: int = 0,
        user: str | None = None,
    ) -> RequestStream:
        """Route the request (its first prompt decides) and hand it to that replica; a full
        replica passes it to the next the router picks. Raises what AsyncEngine.submit raises,
        QueueFullError only when every live replica is full."""
        self._live()
        if len(self._dead) == len(self.replicas):
            raise RuntimeError(self.fatal_error or "no replica can serve")
        tried: list[int] = []
        full = None
        while len(set(tried) | self._dead) < len(self.replicas):
            loads = self.loads()
            for i in tried:  # a replica found full looks infinitely loaded to the next choice
                loads[i] = ReplicaLoad(loads[i].num_running, 1 << 30)
            if tried:
                i = _least_loaded(loads, tried + sorted(self._dead))
            else:
                i = self.router.route(prompts[0], loads)
            if i in tried or i in self._dead:
                break
            self._pending[i] += len(prompts)
            try:
                stream = await self.replicas[i].submit(prompts, params, priority, user)
            except QueueFullError as e:
                tried.append(i)
                full = e
                continue
            except RuntimeError:
                why = self.replicas[i].failure()
                if why is None:  # this request's own failure: no other replica would do better
                    raise
                self._forget(i, why)  # it died just now: the next replica takes the request
                continue
            finally:
                self._pending[i] -= len(prompts)
            if tried and hasattr(self.router, "remember"):  # not where the router thought
                self.router.remember(i, prompts[0])
            self.routed.labels(self.replicas[i].metrics.model_name, str(i)).inc()
            return stream
        if full is not None:
            self.rejected.labels(self.replicas[0].metrics.model_name).inc()
            raise QueueFullError(f"every replica is full; {full}")
        raise RuntimeError(self.fatal_error or "no replica can serve")

    # ------------------------------------------------------------------ a replica's death
    def _forget(self, i: int, message: str) -> None:
        """On the event loop only (submit and the router run there): replica i serves no more."""
        if i in self._dead:
            return
        self._dead.add(i)
        self.router.forget(i)
        log.error("replica %d can serve no more (%s); the others go on", i, message)
        if len(self._dead) == len(self.replicas) and self._on_fatal is not None:
            self._on_fatal(self.fatal_error or message)

    def _replica_died(self, i: int, message: str) -> None:
        """Called on replica i's loop thread, once, after its loop failed its streams: the
        bookkeeping moves to the event loop, which routes, so no request sees it half done."""
        self._loop.call_soon_threadsafe(self._forget, i, message)

    def __repr__(self):
        parts = ", ".join(f"{i}: {r!r}" for i, r in enumerate(self.replicas))
        return f"DataParallelEngine({self.routing_policy}, dead={sorted(self._dead)}, {parts})"


def _least_loaded(loads: list[ReplicaLoad], skip: list[int]) -> int:
    """After a full replica: the least loaded of those not tried."""
    return min((i for i in range(len(loads)) if i not in skip), key=lambda i: loads[i].score)


class _Replicas:
    """A prometheus_client collector: each replica's families, every sample labelled with its
    replica's index, merged into one family per name (a name may appear once in a scrape)."""

    def __init__(self, replicas: list[AsyncEngine]):
        self.replicas = replicas

    def collect(self):
        merged: dict[str, Metric] = {}
        for i, r in enumerate(self.replicas):
            for family in r.metrics.families():
                into = merged.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type)
                )
                into.samples += [
                    s._replace(labels={**s.labels, "engine": str(i)}) for s in family.samples
                ]
        yield from merged.values()
