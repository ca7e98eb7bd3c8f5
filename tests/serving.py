"""Shared helpers of the server tests: a running server on loopback with a sync client, the
offline reference its outputs are compared with, and the one-thread fixture (a test module that
imports `one_torch_thread` gets it). Every wait below is bounded in time."""

import json
import socket
import time
from contextlib import ExitStack, contextmanager

import httpx
import pytest
import torch

from minicb import LLM, Engine, EngineConfig
from minicb.serve.app import build_app
from minicb.serve.cli import ServerThread
from minicb.serve.engine_loop import AsyncEngine
from minicb.serve.metrics import parse_metrics

CONFIG = dict(dtype="float64", block_size=4, num_blocks=1024, max_num_seqs=8)
MAX_LEN = 2048  # the tiny models' max_position_embeddings: long enough to outlive a disconnect
NODELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]  # no Nagle delay between headers and body


class Served:
    """A running server on loopback, its engine, and a sync httpx client."""

    def __init__(
        self,
        stack: ExitStack,
        loaded,
        max_waiting=64,
        trace_steps=5000,
        stream_interval=1,
        **config,
    ):
        self.engine = Engine(EngineConfig(model=loaded.name, **{**CONFIG, **config}), loaded)
        self.async_engine = AsyncEngine(
            self.engine,
            max_waiting=max_waiting,
            trace_steps=trace_steps,
            stream_interval=stream_interval,
        )
        self.url = stack.enter_context(ServerThread(build_app(self.async_engine)))
        self.http = stack.enter_context(
            httpx.Client(
                base_url=self.url, timeout=30, transport=httpx.HTTPTransport(socket_options=NODELAY)
            )
        )
        self.name = loaded.name

    def metrics(self) -> dict[str, float]:
        """GET /metrics as {'vllm:num_requests_running': 1.0, ...} (labels other than model_name
        kept)."""
        return parse_metrics(self.http.get("/metrics").text)

    def wait_idle(self, timeout=60.0) -> dict[str, float]:
        """Metrics once nothing runs or waits and every KV block is free (fails after `timeout`)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (
                m["vllm:num_requests_running"]
                == m["vllm:num_requests_waiting"]
                == m["minicb:kv_blocks_used"]
                == 0
            ):
                return m
            assert time.monotonic() < deadline, f"server not idle after {timeout} s: {m}"
            time.sleep(0.02)


@contextmanager
def serve(loaded, **kw):
    with ExitStack() as stack:
        yield Served(stack, loaded, **kw)


def reference(loaded, prompts, params):
    """Token ids from the offline LLM on the same weights (float64: exact)."""
    llm = LLM.from_loaded(loaded, **{**CONFIG, "max_num_seqs": 1})
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def sse_events(response) -> list:
    """The `data:` payloads of a server-sent-event stream (the last one must be [DONE])."""
    events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    # Tiny models gain nothing from intra-op threads, and on a busy 2-core machine OpenMP threads
    # that wait for each other can stretch a ~1 ms step to ~50 ms.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
