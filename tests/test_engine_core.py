"""The engine core in its own process (minicb/serve/engine_core.py), the server's default: the same
answers as the engine in the server's process, byte for byte; the core's death noticed within
seconds; and what the HTTP side keeps (detokenization, stop strings, aborts) working across the
pipe."""

import json
import threading
import time
from contextlib import ExitStack, contextmanager

import httpx
import pytest
import torch
from reference import add_word_tokenizer
from serving import one_torch_thread, sse_events  # noqa: F401

from minicb import LLM, Engine, EngineConfig, SamplingParams
from minicb.model_executor.loader import load_model, save_tiny_model
from minicb.serve.app import build_app
from minicb.serve.cli import ServerThread
from minicb.serve.engine_core import RemoteEngine
from minicb.serve.engine_loop import AsyncEngine

MAX_LEN = 512


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return add_word_tokenizer(
        save_tiny_model(tmp_path_factory.mktemp("core"), seed=6, max_position_embeddings=MAX_LEN)
    )


def config(model_dir, **kw):
    return EngineConfig(
        **{
            **dict(
                model=str(model_dir),
                dtype="float64",
                block_size=4,
                num_blocks=512,
                max_num_seqs=8,
                max_model_len=MAX_LEN,
            ),
            **kw,
        }
    )


@contextmanager
def server(engine):
    with ExitStack() as stack:
        url = stack.enter_context(ServerThread(build_app(AsyncEngine(engine))))
        yield stack.enter_context(httpx.Client(base_url=url, timeout=30))


@pytest.fixture(scope="module")
def both(model_dir):
    """(client of a server with the engine in its process, client of one with an engine-core
    process)"""
    # a core for the API process, on a small CI machine
    remote = RemoteEngine(config(model_dir), core_threads=1)
    with server(Engine(config(model_dir))) as local_http, server(remote) as remote_http:
        yield local_http, remote_http, remote


BODIES = {
    "chat": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "w10 w11"}], "max_tokens": 12, "temperature": 0},
    ),
    "n=2 seeded": (
        "/v1/completions",
        {
            "prompt": "w20 w21 w22",
            "n": 2,
            "max_tokens": 10,
            "temperature": 1.0,
            "seed": 4,
            "ignore_eos": True,
        },
    ),
    "logprobs and echo": (
        "/v1/completions",
        {
            "prompt": "w30 w31",
            "max_tokens": 6,
            "temperature": 0,
            "logprobs": 2,
            "echo": True,
            "ignore_eos": True,
        },
    ),
    "two prompts": (
        "/v1/completions",
        {"prompt": [[40, 41], [50]], "max_tokens": 7, "temperature": 0, "ignore_eos": True},
    ),
    "penalties": (
        "/v1/completions",
        {
            "prompt": "w9 w9 w9",
            "max_tokens": 9,
            "temperature": 0,
            "frequency_penalty": 1.0,
            "ignore_eos": True,
        },
    ),
}


def joined(events: list[dict]) -> dict[int, str]:
    """{choice index: its streamed text, the deltas joined}."""
    text: dict[int, str] = {}
    for event in events:
        for c in event["choices"]:
            text[c["index"]] = text.get(c["index"], "") + (
                c.get("text") or (c.get("delta") or {}).get("content") or ""
            )
    return text


def without_ids(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


@pytest.mark.parametrize("name", list(BODIES))
def test_the_core_process_answers_as_the_engine_in_process(both, name):
    local, remote, _ = both
    path, body = BODIES[name]
    a, b = local.post(path, json=body), remote.post(path, json=body)
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    assert without_ids(a.json()) == without_ids(b.json())
    with local.stream("POST", path, json={**body, "stream": True}) as r:
        a_events = [without_ids(e) for e in sse_events(r)]
    with remote.stream("POST", path, json={**body, "stream": True}) as r:
        b_events = [without_ids(e) for e in sse_events(r)]
    # chunks may group steps differently; the text may not differ
    assert joined(a_events) == joined(b_events)


def test_a_stop_string_found_in_the_api_process_stops_the_core(both, model_dir):
    local, remote, engine = both
    free = (
        local.post(
            "/v1/completions",
            json={"prompt": "w60", "max_tokens": 12, "temperature": 0, "ignore_eos": True},
        )
        .json()["choices"][0]["text"]
        .split()
    )
    stop = free[3]
    body = {"prompt": "w60", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stop": [stop]}
    a, b = (
        local.post("/v1/completions", json=body).json(),
        remote.post("/v1/completions", json=body).json(),
    )
    assert (
        b["choices"][0]["text"] == a["choices"][0]["text"]
        and b["choices"][0]["finish_reason"] == "stop"
    )
    wait_until(
        lambda: engine.stats["kv_blocks_used"] == 0 and engine.stats["num_requests_running"] == 0
    )


def test_a_client_that_leaves_frees_the_cores_blocks(both):
    _, remote, engine = both
    body = {
        "prompt": "w70 w71",
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with remote.stream("POST", "/v1/completions", json=body) as r:
        for _ in zip(range(5), r.iter_lines()):
            pass  # read a few events, then hang up
    wait_until(
        lambda: engine.stats["kv_blocks_used"] == 0 and engine.stats["num_requests_running"] == 0
    )
    assert not engine.has_unfinished_requests()


def wait_until(condition, timeout_s=60.0):  # generous: it waits for an event, on a busy machine too
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_the_core_runs_with_the_threads_it_was_given(both):
    *_, remote = both
    # torch.get_num_threads() in the core process, reported at start
    assert remote.core_threads == 1


def test_a_command_for_the_core_ends_the_loops_wait_for_its_step(model_dir, monkeypatch):
    """The engine loop waits in step() for the core's next step; a request that arrives meanwhile
    wakes it (AsyncEngine.submit calls wake()), so that the request goes to the core before its
    next step starts, not after. Here the core has nothing to run: without the wake-up, step()
    would wait the whole STEP_WAIT_S."""
    from minicb.serve import engine_core

    monkeypatch.setattr(engine_core, "STEP_WAIT_S", 600.0)
    engine = RemoteEngine(config(model_dir), core_threads=1)
    try:
        for woken_first in (False, True):  # woken while it waits, or before it begins to
            returned = threading.Event()
            waiter = threading.Thread(target=lambda: (engine.step(), returned.set()))
            if woken_first:
                engine.wake()
            waiter.start()
            if not woken_first:
                engine.wake()
            assert returned.wait(60), "step() went on waiting for the core after a wake()"
            waiter.join()
            assert not engine.stepped  # it saw no step of the core: none ran
        # a request sent after the wake-up still runs to the end
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        assert [len(o.outputs[0].token_ids) for o in outs if o.finished] == [3]
    finally:
        engine.shutdown()


def test_the_cores_death_fails_the_streams_and_turns_health_unhealthy(model_dir):
    engine = RemoteEngine(config(model_dir))
    with server(engine) as http:
        assert http.get("/health").status_code == 200
        events, done = [], threading.Event()

        def stream():
            body = {
                "prompt": "w80",
                "max_tokens": 400,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            with http.stream("POST", "/v1/completions", json=body) as r:
                events.extend(line for line in r.iter_lines() if line.startswith("data: "))
            done.set()

        threading.Thread(target=stream, daemon=True).start()
        wait_until(lambda: len(events) >= 3 or engine.has_unfinished_requests())
        time.sleep(0.2)
        engine.process.kill()  # the core dies mid-stream
        assert done.wait(60), "the stream did not end within 60 s of the core's death"
        payloads = [e[6:] for e in events]
        assert payloads[-1] == "[DONE]" and "error" in json.loads(payloads[-2])
        assert "engine core process died" in json.loads(payloads[-2])["error"]["message"]
        wait_until(lambda: http.get("/health").status_code == 503)
        r = http.post("/v1/completions", json={"prompt": "w1", "max_tokens": 2})
        assert r.status_code == 503 and "engine core process died" in r.json()["error"]["message"]
        # reaped: its real exit code
        assert "exit code -9" in json.loads(payloads[-2])["error"]["message"]
        assert not engine.has_unfinished_requests()  # the engine loop has nothing to spin on


def test_a_model_that_cannot_load_fails_the_start_with_its_reason(tmp_path):
    with pytest.raises(RuntimeError, match="the engine core failed to start"):
        RemoteEngine(EngineConfig(model=str(tmp_path / "nowhere"), dtype="float64"))


def test_a_priority_request_over_http_preempts_a_lower_one(model_dir):
    # scheduling_policy="priority" over HTTP (vLLM's per-request "priority", the lowest served
    # first): one slot, a long stream at priority 5, then a request at priority 0 takes the slot at
    # once.
    loaded = load_model(model_dir, torch.float64)
    engine = Engine(config(model_dir, max_num_seqs=1, scheduling_policy="priority"), loaded)
    with server(engine) as http:
        finished = {}

        def low():
            body = {
                "prompt": "w90",
                "max_tokens": 300,
                "temperature": 0,
                "ignore_eos": True,
                "priority": 5,
            }
            http.post("/v1/completions", json=body)
            finished["low"] = time.monotonic()

        t = threading.Thread(target=low, daemon=True)
        t.start()
        wait_until(lambda: any(rec.rows for rec in engine.trace.steps))
        r = http.post(
            "/v1/completions",
            json={
                "prompt": "w91",
                "max_tokens": 5,
                "temperature": 0,
                "priority": 0,
                "ignore_eos": True,
            },
        )
        finished["high"] = time.monotonic()
        t.join(30)
    assert r.status_code == 200 and finished["high"] < finished["low"]
    preempted = [rid for rec in engine.trace.steps for rid in rec.preempted + rec.swapped_out]
    # the low-priority request (stream 0) made room
    assert preempted and preempted[0].startswith("0-")


def test_python_m_minicb_serve_runs_the_core_in_its_own_process(model_dir):
    import os
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "minicb",
        "serve",
        "--model",
        str(model_dir),
        "--dtype",
        "float64",
        "--port",
        str(port),
        "--num-blocks",
        "256",
        "--block-size",
        "4",
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _healthy(url), timeout_s=120)
        r = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": "w10 w11", "max_tokens": 4, "temperature": 0, "ignore_eos": True},
            timeout=30,
        )
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 4
        children = subprocess.run(
            ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True
        ).stdout.split()
        # not multiprocessing's resource tracker
        cores = [pid for pid in children if "spawn_main" in _cmdline(pid)]
        assert cores, "no engine-core process among the server's children"
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert "engine core in its own process" in out
    # the core went with the server
    wait_until(
        lambda: all(
            not os.path.exists(f"/proc/{pid}")
            or "zombie" in open(f"/proc/{pid}/status").read().lower()
            for pid in cores
        ),
        timeout_s=10,
    )


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_core_process_runs_tensor_parallel_workers(model_dir):
    # The core starts its own worker processes (it must not be daemonic for that) and stops them at
    # shutdown.
    prompts, params = (
        [[5, 6, 7], [9, 8, 7, 6, 5]],
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
    )
    expected = [
        o.outputs[0].token_ids
        for o in LLM.from_loaded(load_model(model_dir, torch.float64), **_llm_fields()).generate(
            prompts, params, use_tqdm=False
        )
    ]
    remote = RemoteEngine(config(model_dir, tensor_parallel_size=2), core_threads=1)
    try:
        got = {}
        for i, p in enumerate(prompts):
            remote.add_request(p, params, request_id=str(i))
        while remote.has_unfinished_requests():
            for out in remote.step():
                got[out.request_id] = out.outputs[0].token_ids
        assert [got["0"], got["1"]] == expected
    finally:
        remote.shutdown()
    assert not remote.process.is_alive()


def _llm_fields():
    return {k: v for k, v in vars(config("x")).items() if k not in ("model",)}


SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 2,
    "prompt_lookup_min": 1,
}


@pytest.mark.parametrize("with_stop", [False, True])
def test_speculative_steps_answer_the_same_across_the_pipe(model_dir, with_stop):
    """With drafts a step sends several tokens of a sample at once; the API process must detokenize
    them in order, stop at a stop string among them (dropping what follows, as the engine in process
    does), and count exactly the tokens kept."""
    local_engine, remote_engine = (
        Engine(config(model_dir, speculative_config=SPEC)),
        RemoteEngine(config(model_dir, speculative_config=SPEC), core_threads=1),
    )
    with server(local_engine) as local, server(remote_engine) as remote:
        # this model loops
        body = {"prompt": "w10 w11", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        free = local.post("/v1/completions", json=body).json()
        words, prompt_len = free["choices"][0]["text"].split(), free["usage"]["prompt_tokens"]
        # the first word of a step that kept 2 drafts or more: a stop string there leaves 2 tokens
        # behind it
        firsts = [
            r.start + 1 - prompt_len
            for s in local_engine.trace
            for r in s.rows
            if r.num_accepted >= 2
        ]
        assert firsts, "no step kept 2 drafts: the test did not test it"
        if with_stop:  # a stop string that ends at word `at`, and nowhere before
            at = firsts[0]
            body["stop"] = [" ".join(words[: at + 1])]
        a, b = (
            local.post("/v1/completions", json=body).json(),
            remote.post("/v1/completions", json=body).json(),
        )
        assert without_ids(a) == without_ids(b)
        if with_stop:
            assert (
                a["choices"][0]["finish_reason"] == "stop" and a["usage"]["completion_tokens"] < 24
            )
        wait_until(lambda: remote_engine.stats["spec_decode_num_accepted_tokens"] > 0)
