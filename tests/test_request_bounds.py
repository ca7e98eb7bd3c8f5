"""No request or connection may take the service from everyone else (issue 37), on the API
process's side: every bound on what a request may ask is a 400 that names the field and the limit,
and the server keeps serving; a request is refused before the work that grows with its input
(tokenizing, the echo's detokenization, parsing on the event loop); a client that hangs up on a
stream that produces nothing aborts it; connections that send nothing are closed and their number
is bounded; and the smaller items (the 413 and the double framing close the connection, the schema
and the behaviour of response_format and max_tokens 0 agree, the JSON depth counts containers, a
dead engine core is named on /health and /v1/models). Every wait is bounded in time.
"""

import argparse
import json
import logging
import socket
import subprocess
import sys
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from reference import add_word_tokenizer
from serving import CONFIG, NODELAY, Served, one_torch_thread  # noqa: F401 (a fixture)

import minicb.serve.app as app_module
import minicb.serve.prompts as prompts_module
from minicb import Engine, EngineConfig
from minicb.config import StepCost
from minicb.model_executor.loader import load_model, save_tiny_model
from minicb.serve.app import build_app
from minicb.serve.cli import ServerThread, add_arguments, engine_config
from minicb.serve.connections import ConnectionLimits
from minicb.serve.engine_core import RemoteEngine
from minicb.serve.engine_loop import AsyncEngine
from minicb.serve.limits import RequestLimits, max_chars_per_token
from minicb.serve.validation import DEFAULT_MAX_REQUEST_BYTES

MAX_LEN = 256
HI = [{"role": "user", "content": "w5 w6"}]


@pytest.fixture(scope="module")
def worded(tmp_path_factory):
    path = save_tiny_model(
        tmp_path_factory.mktemp("bounds"), seed=7, max_position_embeddings=MAX_LEN
    )
    return load_model(add_word_tokenizer(path), torch.float64)


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    """A tiny model over the 256 byte tokens of a byte-level BPE with no merges: every token is
    one character of its vocabulary entry, so a text needs at least a token per character."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    path = save_tiny_model(
        tmp_path_factory.mktemp("bytes"),
        seed=4,
        vocab_size=256,
        bos_token_id=0,
        eos_token_id=1,
        max_position_embeddings=MAX_LEN,
    )
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    return load_model(path, torch.float64)


class Bounded(Served):
    """Served, with the request and connection limits given (and the app at hand)."""

    def __init__(self, stack, loaded, limits=None, connections=None, wrap=None, **kw):
        max_request_bytes = kw.pop("max_request_bytes", DEFAULT_MAX_REQUEST_BYTES)
        config = {**CONFIG, "max_model_len": MAX_LEN, **kw}
        self.engine = Engine(EngineConfig(model=loaded.name, **config), loaded)
        self.async_engine = AsyncEngine(self.engine)
        self.app = build_app(self.async_engine, None, max_request_bytes, limits)
        served = self.app if wrap is None else wrap(self.app)
        self.url = stack.enter_context(ServerThread(served, connections=connections))
        transport = httpx.HTTPTransport(socket_options=NODELAY)
        self.http = stack.enter_context(
            httpx.Client(base_url=self.url, timeout=30, transport=transport)
        )
        self.name = loaded.name

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").split(":")
        return host, int(port)


@contextmanager
def bounded(loaded, **kw):
    with ExitStack() as stack:
        yield Bounded(stack, loaded, **kw)


def error_of(r, status=400) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and "Traceback" not in r.text
    return error


def still_serves(s) -> None:
    r = s.http.post("/v1/completions", json={"prompt": "w5 w6", "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) >= 1


# ---------------------------------------------------------------------- bounds: 400 each
LIMITS = RequestLimits(max_logprobs=5, max_tokens_per_request=100)
ROWS = [  # (path, body, param, words of the message: the limit and its flag)
    ("c", {"stop": ["w1"] * 17}, "stop", "at most 16 (--max-stop-strings)"),
    ("c", {"stop": "x" * 1025}, "stop", "at most 1024 (--max-stop-string-chars)"),
    ("c", {"stop": ["w1", "x" * 1025]}, "stop", "at most 1024 (--max-stop-string-chars)"),
    ("c", {"stop_token_ids": [1] * 257}, "stop_token_ids", "at most 256 (--max-stop-token-ids)"),
    (
        "c",
        {"logit_bias": {str(i): 1 for i in range(1025)}},
        "logit_bias",
        "at most 1024 (--max-logit-bias)",
    ),
    ("c", {"logprobs": 6}, "logprobs", "at most 5 alternatives per token (--max-logprobs)"),
    ("c", {"prompt_logprobs": 6}, "prompt_logprobs", "at most 5 alternatives"),
    ("chat", {"logprobs": True, "top_logprobs": 6}, "top_logprobs", "at most 5 alternatives"),
    ("chat", {"prompt_logprobs": 6}, "prompt_logprobs", "(--max-logprobs)"),
    ("c", {"n": 7}, "n", "at most 6 of the 8 slots (--max-seats-per-request)"),
    ("c", {"prompt": ["w5", "w6"], "n": 4}, "n", "2 prompts = 8 slots, but one request may hold"),
    ("c", {"prompt": ["w5"] * 7}, "prompt", "at most 6 slots (--max-seats-per-request)"),
    ("chat", {"n": 7}, "n", "(--max-seats-per-request)"),
    ("c", {"n": 2, "max_tokens": 60}, "max_tokens", "120 tokens, but one request may ask for at"),
    ("chat", {"n": 2, "max_tokens": 60}, "max_tokens", "at most 100 (--max-tokens-per-request)"),
    ("chat", {"max_completion_tokens": 101}, "max_tokens", "(--max-tokens-per-request)"),
    ("c", {"max_tokens": MAX_LEN}, "max_tokens", f"exceeds max_model_len {MAX_LEN}"),
    ("c", {"prompt": [5] * MAX_LEN}, "prompt", f"exceeds max_model_len {MAX_LEN}"),
    ("c", {"prompt": [[5], [5] * MAX_LEN]}, "prompt", "prompt 1: prompt has 256 tokens"),
    # refused from its length, before pydantic meets the string at its end
    ("c", {"prompt": [5] * 300 + ["w5"]}, "prompt", "prompt has 301 tokens"),
    ("chat", {"messages": HI * (MAX_LEN + 1)}, "messages", "257 messages, more than max_model_len"),
]


def test_every_bound_is_a_400_naming_the_field_and_its_limit(worded):
    with bounded(worded, limits=LIMITS) as s:
        for path, body, param, words in ROWS:
            if path == "c":
                r = s.http.post("/v1/completions", json={"prompt": "w5", **body})
            else:
                r = s.http.post("/v1/chat/completions", json={"messages": HI, **body})
            error = error_of(r)
            assert error["param"] == param and words in error["message"], (body, error)
        # at the bounds themselves: accepted
        ok = {"prompt": "w5", "stop": ["w1"] * 16, "stop_token_ids": [1] * 256, "logprobs": 5}
        assert s.http.post("/v1/completions", json={**ok, "max_tokens": 2}).status_code == 200
        three = {"prompt": ["w5", "w6", "w7"], "n": 2, "max_tokens": 16}  # 6 slots, 96 tokens
        assert s.http.post("/v1/completions", json=three).status_code == 200
        still_serves(s)
        s.wait_idle()


def test_a_chat_reply_by_default_takes_its_share_of_the_token_bound(worded):
    # No max_tokens: a reply fills the room max_model_len leaves, but never asks for more than
    # --max-tokens-per-request over its n samples (here 100 / 2).
    with bounded(worded, limits=LIMITS) as s:
        body = {"messages": HI, "n": 2, "temperature": 0, "ignore_eos": True}
        r = s.http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert [len(c["token_ids"]) for c in r.json()["choices"]] == [50, 50]


def test_request_limits_are_checked_when_made():
    with pytest.raises(ValueError, match="max_logprobs must be an integer in"):
        RequestLimits(max_logprobs=21)
    with pytest.raises(ValueError, match="max_stop_strings must be a positive integer"):
        RequestLimits(max_stop_strings=0)
    resolved = RequestLimits().for_engine(max_num_seqs=32, max_model_len=8192)
    assert (resolved.max_seats_per_request, resolved.max_tokens_per_request) == (24, 4 * 8192)
    assert RequestLimits().for_engine(1, 16).max_seats_per_request == 1
    with pytest.raises(ValueError, match="timeout_request must be a number of seconds"):
        ConnectionLimits(timeout_request=0)


# ---------------------------------------------------------------------- refuse before working
class Spy:
    """Wraps a function: counts its calls and the threads it ran on."""

    def __init__(self, fn):
        self.fn, self.threads = fn, []

    def __call__(self, *args, **kw):
        self.threads.append(threading.current_thread().name)
        return self.fn(*args, **kw)


def test_a_huge_echo_body_is_refused_before_tokenizing_or_detokenizing(worded, monkeypatch):
    # The fuzzing report's body: 2 million token ids with echo, 4 MB (under --max-request-bytes).
    # It is parsed in a worker thread and refused from its length alone: nothing tokenizes it, and
    # nothing detokenizes it for the echo.
    with bounded(worded) as s:
        echo = Spy(prompts_module.echoed_prompt)
        monkeypatch.setattr(prompts_module, "echoed_prompt", echo)
        tokenize = Spy(s.engine.tokenize)
        monkeypatch.setattr(s.engine, "tokenize", tokenize)
        sizes = Spy(s.app.state.check_sizes)
        s.app.state.check_sizes = sizes
        raw = b'{"echo": true, "max_tokens": 1, "prompt": [' + b"5," * 1_999_999 + b"5]}"
        assert len(raw) < DEFAULT_MAX_REQUEST_BYTES
        t0 = time.perf_counter()
        r = s.http.post(
            "/v1/completions", content=raw, headers={"content-type": "application/json"}
        )
        print(f"a 4 MB body of 2M ids refused in {1e3 * (time.perf_counter() - t0):.0f} ms")
        error = error_of(r)
        assert error["param"] == "prompt" and "prompt has 2000000 tokens" in error["message"]
        assert sizes.threads and sizes.threads[0] != "minicb-uvicorn"  # off the event loop
        assert not tokenize.threads and not echo.threads
        # Tokenized, then too long with its max_tokens: refused before the echo's detokenization.
        body = {"prompt": [5] * 200, "max_tokens": 100, "echo": True}
        error = error_of(s.http.post("/v1/completions", json=body))
        assert "300 exceeds max_model_len 256" in error["message"]
        assert len(tokenize.threads) == 1 and not echo.threads
        # a small body is parsed on the event loop (a thread hop would cost more than parsing it)
        r = s.http.post("/v1/completions", json={**body, "max_tokens": 2})
        assert r.status_code == 200 and len(echo.threads) == 1
        assert sizes.threads[-1] == "minicb-uvicorn"


def test_a_text_too_long_for_any_tokenization_is_refused_without_tokenizing(
    byte_level, worded, monkeypatch
):
    # With a byte-level vocabulary a token stands for at most its entry's characters (here 1):
    # a text over max_model_len characters can only be too long.
    assert max_chars_per_token(byte_level.tokenizer) == 1
    # a word-level tokenizer maps any unknown word to one token: no such bound
    assert max_chars_per_token(worded.tokenizer) is None
    with bounded(byte_level) as s:
        tokenize = Spy(s.engine.tokenize)
        monkeypatch.setattr(s.engine, "tokenize", tokenize)
        error = error_of(s.http.post("/v1/completions", json={"prompt": "a" * 300}))
        assert error["param"] == "prompt" and "prompt has 300 characters" in error["message"]
        assert not tokenize.threads
        parts = [{"type": "text", "text": "a" * 200}] * 2
        chat = {"messages": [{"role": "user", "content": parts}]}
        error = error_of(s.http.post("/v1/chat/completions", json=chat))
        assert error["param"] == "messages" and "hold 400 characters" in error["message"]
        r = s.http.post("/v1/completions", json={"prompt": "a" * 200, "max_tokens": 2})
        assert r.status_code == 200 and len(tokenize.threads) == 1


def test_a_whole_response_is_built_off_the_event_loop(worded, monkeypatch):
    build = Spy(app_module.whole_response)
    monkeypatch.setattr(app_module, "whole_response", build)
    with bounded(worded) as s:
        body = {"prompt": ["w5 w6", "w7"], "echo": True, "logprobs": 5, "max_tokens": 4}
        r = s.http.post("/v1/completions", json=body)
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
        assert r.json()["choices"][0]["logprobs"]["top_logprobs"][1]  # the model's fields, all
        assert build.threads and build.threads[0] != "minicb-uvicorn"


# ---------------------------------------------------------------------- a client that leaves
def asgi_spec_2_4(app):
    """The app as a server that speaks ASGI 2.4 sees it: there, Starlette's StreamingResponse no
    longer listens for the disconnect itself (uvicorn's h11 says 2.3, and it does)."""

    async def served(scope, receive, send):
        if scope["type"] == "http":
            scope = {**scope, "asgi": {**scope["asgi"], "spec_version": "2.4"}}
        await app(scope, receive, send)

    return served


@pytest.fixture(scope="module")
def long_lived(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("long"), seed=7, max_position_embeddings=2048)
    return load_model(path, torch.float64)


def test_hanging_up_on_a_stream_that_produces_nothing_aborts_it_at_once(long_lived):
    # One slot: a long stream runs, a second waits for the slot (nothing to send). Its client
    # hangs up: the waiting request is aborted now, not once the slot frees and a write fails.
    long = {"prompt": [7], "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
    with bounded(long_lived, wrap=asgi_spec_2_4, max_num_seqs=1, max_model_len=2048) as s:
        aborted = 'vllm:request_success_total{finished_reason="abort"}'
        with s.http.stream("POST", "/v1/completions", json={**long, "stream": True}) as first:
            lines = first.iter_lines()  # kept: a discarded iterator would close the connection
            next(line for line in lines if line.startswith("data: "))
            with httpx.Client(base_url=s.url, timeout=30) as other:
                with other.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
                    assert r.status_code == 200
                    deadline = time.monotonic() + 30
                    while s.metrics()["vllm:num_requests_waiting"] < 1:
                        assert time.monotonic() < deadline
                        time.sleep(0.01)
            t0 = time.perf_counter()  # the second client has closed its connection
            deadline = time.monotonic() + 30
            while (m := s.metrics())["vllm:num_requests_waiting"] > 0:
                assert time.monotonic() < deadline, m
                time.sleep(0.01)
            print(f"the waiting request was aborted {1e3 * (time.perf_counter() - t0):.0f} ms ")
            assert m[aborted] == 1 and m["vllm:num_requests_running"] == 1  # the first runs on


# ---------------------------------------------------------------------- connections
def raw(s, data: bytes = b"", timeout: float = 30.0) -> socket.socket:
    sock = socket.create_connection(s.address, timeout=timeout)
    if data:
        sock.sendall(data)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (bounded by the timeout)."""
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    return got


HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def test_a_connection_that_sends_no_whole_request_is_closed(worded):
    with bounded(worded, connections=ConnectionLimits(timeout_request=0.5)) as s:
        t0 = time.perf_counter()
        with (
            raw(s) as silent,
            raw(s, HEAD) as slow_head,  # a head sent a few bytes at a time never ends
            raw(s, HEAD + b"Content-Length: 40\r\n\r\n" + b'{"prompt": "w5"') as slow_body,
        ):
            slow_head.sendall(b"Content-")
            assert read_until_closed(silent) == b""
            assert read_until_closed(slow_head) == b""
            assert not read_until_closed(slow_body).startswith(b"HTTP/1.1 200")
        print(f"closed after {time.perf_counter() - t0:.2f} s (timeout_request 0.5 s)")
        # a client that sends its request is served, and its keep-alive connection reused
        assert s.http.get("/health").status_code == s.http.get("/health").status_code == 200
        still_serves(s)


def busy(s) -> socket.socket:
    """A connection with a request in flight: its head came, its body never does. The server's
    100 Continue says it has the request."""
    sock = raw(s, HEAD + b"Content-Length: 40\r\nExpect: 100-continue\r\n\r\n")
    assert sock.recv(100).startswith(b"HTTP/1.1 100 ")
    return sock


def test_idle_connections_never_keep_a_client_with_a_request_out(worded, caplog):
    with bounded(worded, connections=ConnectionLimits(limit_concurrency=4)) as s:
        s.http.close()  # a connection of its own would count
        idle = [raw(s) for _ in range(20)]  # at most 4 open: a newcomer takes the oldest's place
        assert all(read_until_closed(sock) == b"" for sock in idle[:16])
        for sock in idle[16:]:
            sock.settimeout(0.2)
            with pytest.raises(TimeoutError):  # still open
                sock.recv(1)
        assert httpx.get(s.url + "/health").status_code == 200  # it took an idle one's place
        # Only when every connection has a request in flight is a newcomer refused.
        held = [busy(s) for _ in range(4)]
        with caplog.at_level(logging.WARNING, logger="minicb.server"):
            refused = [read_until_closed(raw(s)) for _ in range(20)]
        assert all(r.startswith(b"HTTP/1.1 503 ") and b"connection: close" in r for r in refused)
        body = json.loads(refused[0].split(b"\r\n\r\n", 1)[1])
        assert "--limit-concurrency" in body["error"]["message"]
        warnings = [r for r in caplog.records if "connections refused" in r.getMessage()]
        assert len(warnings) == 1  # not one line per refused socket
        for sock in idle + held:
            sock.close()
        deadline = time.monotonic() + 30  # the server notices the closes
        while True:
            try:
                if httpx.get(s.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_a_413_for_a_chunked_body_closes_the_connection(worded):
    with bounded(worded, max_request_bytes=1024) as s:
        chunked = HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + b"800\r\n" + b"x" * 2048 + b"\r\n"
        with raw(s, chunked) as sock:  # ... and it would go on sending 100 MiB
            reply = read_until_closed(sock)
        assert reply.startswith(b"HTTP/1.1 413 ") and b"connection: close" in reply.lower()
        with raw(s, HEAD + b"Content-Length: 5000\r\n\r\n") as sock:
            reply = read_until_closed(sock)
        assert reply.startswith(b"HTTP/1.1 413 ") and b"connection: close" in reply.lower()
        still_serves(s)


def test_content_length_with_transfer_encoding_is_refused_and_closed(worded):
    with bounded(worded) as s:
        body = b'{"prompt": "w5", "max_tokens": 2}'
        both = (
            HEAD
            + f"Content-Length: {len(body)}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
            + f"{len(body):x}\r\n".encode()
            + body
            + b"\r\n0\r\n\r\n"
        )
        with raw(s, both) as sock:
            reply = read_until_closed(sock)
        assert reply.startswith(b"HTTP/1.1 400 ") and b"connection: close" in reply.lower()
        assert b"both Content-Length and Transfer-Encoding" in reply
        still_serves(s)


# ---------------------------------------------------------------------- schema and behaviour
def test_response_format_and_max_tokens_0_do_what_the_schema_says(worded):
    with bounded(worded) as s:
        spec = s.http.get("/openapi.json").json()["components"]["schemas"]
        assert spec["ResponseFormat"]["required"] == ["type"]
        kinds = spec["ResponseFormat"]["properties"]["type"]["enum"]
        assert kinds == ["text", "json_object", "json_schema"]
        chat = {"messages": HI, "max_tokens": 2}
        error = error_of(s.http.post("/v1/chat/completions", json={**chat, "response_format": {}}))
        assert error["param"] == "response_format"
        assert "'response_format.type' is required" in error["message"]
        text = {**chat, "response_format": {"type": "text"}}
        assert s.http.post("/v1/chat/completions", json=text).status_code == 200
        # max_tokens 0 (the schema's minimum): the prompt alone, without echo an empty completion
        minimum = spec["CompletionRequest"]["properties"]["max_tokens"]["anyOf"][0]["minimum"]
        assert minimum == 0
        body = {"prompt": "w5 w6 w7", "max_tokens": 0, "prompt_logprobs": 1}
        r = s.http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice, usage = r.json()["choices"][0], r.json()["usage"]
        assert (choice["text"], choice["token_ids"], choice["finish_reason"]) == ("", [], "length")
        assert len(choice["prompt_logprobs"]) == 3 and usage["completion_tokens"] == 0


def test_the_json_depth_limit_counts_containers(worded):
    with bounded(worded) as s:

        def nested(containers: int) -> bytes:  # the body's object, then lists inside an extra field
            lists = containers - 1
            return b'{"prompt": "w5", "max_tokens": 1, "x": ' + b"[" * lists + b"]" * lists + b"}"

        post = lambda raw: s.http.post(
            "/v1/completions", content=raw, headers={"content-type": "application/json"}
        )
        assert post(nested(16)).status_code == 200
        assert "nested more than 16 levels" in error_of(post(nested(17)))["message"]


# ---------------------------------------------------------------------- a dead engine core
def test_a_dead_core_is_named_on_health_and_models(tmp_path):
    path = add_word_tokenizer(save_tiny_model(tmp_path, seed=6, max_position_embeddings=MAX_LEN))
    config = EngineConfig(
        model=str(path), dtype="float64", block_size=4, num_blocks=128, max_num_seqs=4
    )
    engine = RemoteEngine(config, core_threads=1)
    with ServerThread(build_app(AsyncEngine(engine))) as url, httpx.Client(base_url=url) as http:
        assert http.get("/v1/models").status_code == 200
        engine.process.kill()
        deadline = time.monotonic() + 30
        while (health := http.get("/health")).status_code == 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        message = error_of(health, 503)["message"]
        assert "engine core process died (exit code -9)" in message, message
        assert "core process died" in error_of(http.get("/v1/models"), 503)["message"]


@pytest.mark.slow  # two interpreters start (the server, its core): ~20 s on 2 busy cores
def test_serve_exits_with_an_error_when_its_engine_core_dies(tmp_path):
    # A supervisor (systemd, Kubernetes) restarts a process that exits: the API process must not
    # live on without an engine.
    path = save_tiny_model(tmp_path / "m", seed=6, max_position_embeddings=MAX_LEN)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    flags = ["--model", str(path), "--dtype", "float64", "--num-blocks", "64", "--core-threads"]
    flags += ["1", "--max-decode-slowdown", "0"]  # no step-cost calibration at start: fast
    serve = subprocess.Popen(
        [sys.executable, "-m", "minicb", "serve", "--port", str(port), *flags],
        cwd=Path(__file__).resolve().parents[1],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert serve.poll() is None and time.monotonic() < deadline, serve.stdout.read()
            time.sleep(0.1)
        children = psutil.Process(serve.pid).children()
        # (multiprocessing's resource tracker is a child too)
        (core,) = [c for c in children if "resource_tracker" not in " ".join(c.cmdline())]
        core.kill()
        code = serve.wait(60)
        output = serve.stdout.read()
        assert code != 0 and "exited because the engine died" in output, output
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait(10)


# ---------------------------------------------------------------------- the flags
def test_the_serve_flags_make_the_limits_and_the_engine_config():
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args([])
    assert engine_config(args).max_decode_slowdown == 2.0  # serve's default
    cost = {"step_s": 0.02, "token_s": 1e-4, "context_token_s": 1e-8, "logits_row_s": 1e-4}
    args = p.parse_args(["--max-decode-slowdown", "0", "--step-cost", json.dumps(cost)])
    config = engine_config(args)
    assert config.max_decode_slowdown is None and config.step_cost == StepCost(**cost)
    args = p.parse_args(["--max-logprobs", "5", "--max-stop-strings", "4", "--backlog", "64"])
    assert (args.max_logprobs, args.max_stop_strings, args.max_seats_per_request) == (5, 4, None)
    assert (args.backlog, args.limit_concurrency, args.timeout_request) == (64, 512, 10.0)
