"""`serve --api-key` (auth.py) and OpenAI's `user` field, over real loopback HTTP.

A request without the key, with another scheme or with a wrong key gets 401 in OpenAI's error shape
and never reaches the engine (AsyncEngine.submit and Engine.add_request are watched, and /metrics
counts nothing); the openai client with the key works unchanged, streaming too; /health, /metrics
and the docs stay open as in vLLM; the key shows in no response, metric or log line, and the
server started from the command line takes it from VLLM_API_KEY. Tiny random float64 models: the
outputs are compared with LLM.generate token for token. Every wait is bounded in time.
"""

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import torch
from serving import (
    CONFIG,
    MAX_LEN,
    one_torch_thread,  # noqa: F401 (a fixture)
    reference,
)

from minicb import Engine, EngineConfig, SamplingParams
from minicb.model_executor.loader import load_model, save_tiny_model
from minicb.serve.app import build_app
from minicb.serve.auth import APIKeyAuth, api_keys_from
from minicb.serve.cli import ServerThread, is_loopback
from minicb.serve.engine_loop import AsyncEngine
from minicb.serve.metrics import parse_metrics

KEY = "sk-minicb-test-6f1d0c2a9e"
PROMPT = [5, 9, 2, 7]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("m"), seed=5, max_position_embeddings=MAX_LEN)


@pytest.fixture(scope="module")
def loaded(path):
    return load_model(path, torch.float64)


class Watched:
    """A server with a key whose engine records every call that reaches it."""

    def __init__(self, stack: ExitStack, loaded, api_key, log_level="warning"):
        self.engine = Engine(EngineConfig(model=loaded.name, **CONFIG), loaded)
        self.async_engine = AsyncEngine(self.engine, max_waiting=64, trace_steps=100)
        self.submitted, self.added = [], []  # the keywords of each call
        submit, add = self.async_engine.submit, self.engine.add_request

        async def watched_submit(*args, **kw):
            self.submitted.append(kw)
            return await submit(*args, **kw)

        def watched_add(*args, **kw):
            self.added.append(kw)
            return add(*args, **kw)

        self.async_engine.submit = watched_submit
        self.engine.add_request = watched_add
        app = build_app(self.async_engine, api_key=api_key)
        self.url = stack.enter_context(ServerThread(app, log_level=log_level))
        self.http = stack.enter_context(httpx.Client(base_url=self.url, timeout=30))

    def client(self, api_key=KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=30)

    def counted(self) -> float:
        """Requests /metrics has seen: finished ones, prompt tokens, engine steps."""
        metrics = parse_metrics(self.http.get("/metrics").text)
        counters = ("vllm:request_success_total", "vllm:prompt_tokens_total")
        counters += ("minicb:engine_steps_total",)
        return sum(v for k, v in metrics.items() if k.startswith(counters))


@contextmanager
def watched(loaded, api_key=KEY):
    with ExitStack() as stack:
        yield Watched(stack, loaded, api_key)


def assert_refused(r: httpx.Response) -> str:
    """A 401 in OpenAI's shape that shows neither the key nor a wrong one sent; its message."""
    assert r.status_code == 401, (r.status_code, r.text)
    assert r.headers["www-authenticate"] == "Bearer"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None, 401)
    assert KEY not in r.text and "sk-wrong" not in r.text
    return error["message"]


# ---------------------------------------------------------------------- refused
def before_the_body(url: str, request_line: bytes, *headers: bytes) -> bytes:
    """What the server answers to a request whose head is sent and whose body never comes (the
    server closes the connection once it has answered; a 10 s timeout otherwise)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"\r\n".join([request_line + b" HTTP/1.1", b"Host: minicb", *headers]))
        sock.sendall(b"\r\n\r\n")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


BAD_HEADERS = {
    "none": [],
    "a wrong key": [("Authorization", "Bearer sk-wrong")],
    "the key's prefix": [("Authorization", "Bearer " + KEY[:-1])],
    "the key and more": [("Authorization", "Bearer " + KEY + "x")],
    "another scheme": [("Authorization", "Basic " + KEY)],
    "the bare key": [("Authorization", KEY)],
    "no token": [("Authorization", "Bearer")],
    "two spaces": [("Authorization", "Bearer  " + KEY)],
    "two headers": [("Authorization", "Bearer sk-wrong"), ("Authorization", "Bearer " + KEY)],
    "the key elsewhere": [("X-API-Key", KEY), ("api-key", KEY)],
    "not ASCII": [("Authorization", "Bearer \u00e9\u00e8".encode("latin-1"))],
}


def test_a_request_without_the_right_key_gets_401_and_never_reaches_the_engine(loaded):
    with watched(loaded) as s:
        for headers in BAD_HEADERS.values():
            body = {"prompt": PROMPT, "max_tokens": 4}
            assert_refused(s.http.post("/v1/completions", json=body, headers=headers))
            chat = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
            assert_refused(s.http.post("/v1/chat/completions", json=chat, headers=headers))
            assert_refused(s.http.get("/v1/models", headers=headers))
        # the key is checked first: before the body's size, its JSON, the route
        answer = before_the_body(s.url, b"POST /v1/completions", b"Content-Length: 1000000000")
        assert answer.startswith(b"HTTP/1.1 401 ") and b"connection: close" in answer.lower()
        assert_refused(s.http.post("/v1/completions", content=b"not json"))
        assert_refused(s.http.get("/v1/no-such-route"))
        assert_refused(s.http.get("/v1/models/"))  # no redirect to the route either
        assert_refused(s.http.get("/V1/models"))
        assert_refused(s.http.get("/health/"))  # only the exact open paths are open
        assert s.submitted == s.added == []
        assert s.counted() == 0
        # the openai client without the key, or with a wrong one: its AuthenticationError
        for api_key in ("sk-wrong", KEY.upper()):
            with pytest.raises(openai.AuthenticationError) as refused:
                s.client(api_key).completions.create(model=loaded.name, prompt=PROMPT)
            assert refused.value.status_code == 401
        assert s.submitted == s.added == []
        assert s.counted() == 0


def test_messages_say_what_is_missing_without_the_key():
    # (a message for each way of getting it wrong, so a student can tell them apart)
    headers = {
        "none": [],
        "scheme": [(b"authorization", b"Basic x")],
        "wrong": [(b"authorization", b"Bearer x")],
    }
    auth = APIKeyAuth(app=None, keys=[KEY])
    said = {why: auth.refusal(h) for why, h in headers.items()}
    assert "requires an API key" in said["none"] and "Bearer" in said["none"]
    assert "must be one 'Bearer <key>'" in said["scheme"]
    assert said["wrong"] == "the API key is not valid for this server"
    assert auth.refusal([(b"authorization", b"Bearer " + KEY.encode())]) is None
    assert auth.refusal([(b"authorization", b"bearer " + KEY.encode())]) is None  # RFC 7235
    assert all(KEY not in m for m in said.values())
    assert KEY.encode() not in repr(vars(auth)).encode()  # only digests are kept


# ---------------------------------------------------------------------- with the key
def test_the_openai_client_with_the_key_works_unchanged_streaming_too(loaded):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = reference(loaded, [PROMPT], params)[0]
    with watched(loaded) as s:
        client = s.client()
        assert [m.id for m in client.models.list().data] == [loaded.name]
        asked = dict(model=loaded.name, prompt=PROMPT, max_tokens=6, temperature=0.0)
        asked["extra_body"] = {"ignore_eos": True}
        whole = client.completions.create(**asked)
        assert whole.choices[0].token_ids == expected
        streamed = [
            token
            for chunk in client.completions.create(**asked, stream=True)
            for token in chunk.choices[0].token_ids
        ]
        assert streamed == expected
        assert len(s.submitted) == len(s.added) == 2 and s.counted() > 0


def test_any_one_of_several_keys_will_do(loaded):
    with watched(loaded, api_key=["sk-class-a", "sk-class-b"]) as s:
        for key in ("sk-class-a", "sk-class-b"):
            r = s.http.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
        assert_refused(s.http.get("/v1/models", headers={"Authorization": "Bearer sk-class-c"}))


def test_health_metrics_and_the_docs_stay_open_as_in_vllm(loaded):
    with watched(loaded) as s:
        assert s.http.get("/health").json() == {"status": "ok"}
        metrics = s.http.get("/metrics")
        assert metrics.status_code == 200 and "vllm:num_requests_running" in metrics.text
        for path in ("/docs", "/redoc"):
            assert s.http.get(path).status_code == 200
        schema = s.http.get("/openapi.json").json()
        # /docs asks for the key (HTTP Bearer) on the guarded routes only
        assert schema["components"]["securitySchemes"]["APIKey"]["scheme"] == "bearer"
        completions = schema["paths"]["/v1/completions"]["post"]
        assert completions["security"] == [{"APIKey": []}] and "401" in completions["responses"]
        assert "security" not in schema["paths"]["/health"]["get"]
        # a browser's CORS preflight carries no key (vLLM lets OPTIONS through): 405, not 401
        assert s.http.options("/v1/completions").status_code == 405
        assert s.submitted == []


def test_without_a_key_the_server_is_open_and_documents_no_auth(loaded):
    with watched(loaded, api_key=None) as s:
        assert s.http.get("/v1/models").status_code == 200
        schema = s.http.get("/openapi.json").json()
        assert "securitySchemes" not in schema.get("components", {})


# ---------------------------------------------------------------------- the user field
def test_the_user_field_names_the_tenant(loaded):
    with watched(loaded) as s:
        client = s.client()
        client.completions.create(model=loaded.name, prompt=PROMPT, max_tokens=2, user="alice")
        client.completions.create(model=loaded.name, prompt=PROMPT, max_tokens=2)
        assert [kw["user"] for kw in s.submitted] == ["alice", None]
        assert [kw.get("user") for kw in s.added] == ["alice", None]
        body = {"prompt": PROMPT, "max_tokens": 2, "user": "x" * 257}
        r = s.http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "user", r.text
        assert "256" in r.json()["error"]["message"]


# ---------------------------------------------------------------------- the keys' sources
def test_the_flag_wins_over_vllm_api_key_and_bad_keys_are_refused_unshown():
    env = {"VLLM_API_KEY": "sk-from-env"}
    assert api_keys_from(None, env) == ("sk-from-env",)
    assert api_keys_from(["sk-a", "sk-b"], env) == ("sk-a", "sk-b")
    assert api_keys_from(None, {}) == () == api_keys_from(None, {"VLLM_API_KEY": ""})
    for flag, env, source in (
        (["has space"], {}, "--api-key"),
        (None, {"VLLM_API_KEY": "tab\there"}, "VLLM_API_KEY"),
        ([""], {}, "--api-key"),
    ):
        with pytest.raises(ValueError) as bad:
            api_keys_from(flag, env)
        assert bad.value.args[0].startswith(source)
        assert "tab\there" not in bad.value.args[0] and "has space" not in bad.value.args[0]
    with pytest.raises(ValueError, match="^api_key must be printable ASCII"):
        build_app(AsyncEngine.__new__(AsyncEngine), api_key="caf\u00e9")


def test_loopback_hosts():
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "10.1.2.3", "example.org"):
        assert not is_loopback(host), host


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(self.format(record))  # the message, with its traceback if any


def test_the_key_shows_in_no_log_line_and_no_metric(loaded):
    # uvicorn at debug level (serve runs it at info: its access log), the engine loop's logger
    with ExitStack() as stack:
        s = Watched(stack, loaded, KEY, log_level="debug")
        lines = Lines()
        loggers = [logging.getLogger(n) for n in ("", "uvicorn", "uvicorn.access", "minicb")]
        levels = [logger.level for logger in loggers]
        for logger in loggers:
            logger.addHandler(lines)
            logger.setLevel(logging.DEBUG)
        try:
            right = {"Authorization": f"Bearer {KEY}"}
            for headers in [right, *BAD_HEADERS.values()]:
                s.http.post("/v1/completions", json={"prompt": PROMPT}, headers=headers)
                s.http.post("/v1/completions", json={"prompt": []}, headers=headers)  # a 400
            metrics = s.http.get("/metrics").text
        finally:
            for logger, level in zip(loggers, levels):
                logger.removeHandler(lines)
                logger.setLevel(level)
    logged = "\n".join(lines.lines)
    assert '"POST /v1/completions HTTP/1.1" 401' in logged, logged  # the access log was read
    assert '"POST /v1/completions HTTP/1.1" 200' in logged, logged
    assert KEY not in logged and "sk-wrong" not in logged
    assert KEY not in metrics and len(s.added) == 1


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow  # a fresh interpreter imports torch and the model's code: ~15 s on 2 busy cores
def test_serve_takes_the_key_from_vllm_api_key_and_never_prints_it(path):
    # the command line as an operator runs it, at serve's own log level: uvicorn's access log on
    port = free_port()
    flags = ["--model", str(path), "--dtype", "float64", "--num-blocks", "64"]
    flags += ["--engine-in-process", "--max-decode-slowdown", "0", "--port", str(port)]
    serve = subprocess.Popen(
        [sys.executable, "-m", "minicb", "serve", *flags],
        cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "VLLM_API_KEY": KEY},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert serve.poll() is None and time.monotonic() < deadline, serve.stdout.read()
            time.sleep(0.1)
        assert_refused(httpx.get(url + "/v1/models", headers={"Authorization": "Bearer sk-x"}))
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=30)
        out = client.completions.create(model=str(path), prompt=PROMPT, max_tokens=3)
        assert out.usage.completion_tokens == 3
        assert KEY not in httpx.get(url + "/metrics").text
    finally:
        serve.send_signal(signal.SIGTERM)  # uvicorn shuts down gracefully
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait(10)
    output = serve.stdout.read()
    assert "an API key required" in output and "POST /v1/completions" in output, output
    assert "401" in output and "warning" not in output, output  # loopback: no warning
    assert KEY not in output
