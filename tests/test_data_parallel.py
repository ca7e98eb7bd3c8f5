"""Data-parallel serving (minicb/serve/data_parallel.py, `serve --data-parallel-size N`): each
replica gives a request the tokens one engine alone gives it; a replica that dies fails only its
own streams while the others keep serving; after a load test every block of every replica is
free; /metrics labels each replica's series."""

import asyncio
import json
import threading
import time
from contextlib import ExitStack, contextmanager

import httpx
import pytest
from reference import add_word_tokenizer
from serving import one_torch_thread  # noqa: F401

from minicb import LLM, Engine, EngineConfig, SamplingParams
from minicb.model_executor.loader import save_tiny_model
from minicb.serve.app import build_app
from minicb.serve.cli import ServerThread
from minicb.serve.data_parallel import DataParallelEngine
from minicb.serve.engine_core import RemoteEngine
from minicb.serve.loadgen import http_client, one_request
from minicb.serve.loadtest import make_workload, run_level
from minicb.serve.metrics import parse_metrics

MAX_LEN = 512


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return add_word_tokenizer(
        save_tiny_model(tmp_path_factory.mktemp("dp"), seed=8, max_position_embeddings=MAX_LEN)
    )


def config(model_dir, **kw):
    base = dict(
        model=str(model_dir),
        dtype="float64",
        block_size=4,
        num_blocks=256,
        max_num_seqs=8,
        max_model_len=MAX_LEN,
    )
    return EngineConfig(**{**base, **kw})


@contextmanager
def fleet(engines, **kw):
    """A server over DataParallelEngine(engines): (its httpx client, the DataParallelEngine)."""
    dp = DataParallelEngine(engines, **kw)
    with ExitStack() as stack:
        url = stack.enter_context(ServerThread(build_app(dp)))
        yield stack.enter_context(httpx.Client(base_url=url, timeout=60)), dp


def wait_until(condition, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def run_started(dp: DataParallelEngine, body):
    """`await body()` with the replicas' engine loops started on a fresh event loop, stopped
    after."""

    async def main():
        dp.start(asyncio.get_running_loop())
        try:
            return await body()
        finally:
            await asyncio.to_thread(dp.stop)

    return asyncio.run(main())


def abort_everywhere(dp: DataParallelEngine, streams) -> None:
    for stream in streams:
        for replica in dp.replicas:
            replica.abort(stream.request_ids)


def by_replica(metrics: dict, name: str) -> dict[str, float]:
    """{"0": value, "1": value} of one series of a data-parallel /metrics, summed over its other
    labels."""
    found = {}
    for key, value in metrics.items():
        if key.startswith(name + "{") and 'engine="' in key:
            engine = key.split('engine="')[1].split('"')[0]
            found[engine] = found.get(engine, 0.0) + value
    return found


PROMPTS = [[3 + (7 * i + j) % 100 for j in range(5 + 3 * i)] for i in range(8)]


def test_two_core_processes_answer_as_one_engine_token_for_token(model_dir):
    want = LLM(**vars(config(model_dir))).generate(
        PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False
    )
    engines = [RemoteEngine(config(model_dir), core_threads=1) for _ in range(2)]
    with fleet(engines, routing_policy="least_loaded") as (http, dp):
        got = [None] * len(PROMPTS)

        def ask(i):
            body = {"prompt": PROMPTS[i], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            got[i] = http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert got == [o.outputs[0].token_ids for o in want]
        routed = by_replica(
            parse_metrics(http.get("/metrics").text), "minicb:router_requests_total"
        )
        print("requests routed per replica:", routed)
        assert routed["0"] > 0 and routed["1"] > 0 and sum(routed.values()) == len(PROMPTS)


def test_a_dead_replica_fails_only_its_own_streams(model_dir):
    engines = [RemoteEngine(config(model_dir), core_threads=1) for _ in range(2)]
    with fleet(engines, routing_policy="round_robin") as (http, dp):
        results: dict[int, list[str]] = {}
        started = [threading.Event() for _ in range(4)]

        def stream(k):
            body = {
                "prompt": f"w{10 + k}",
                "max_tokens": 120,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            events = results.setdefault(k, [])
            with http.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started[k].set()

        threads = []
        for k in range(4):  # round robin: streams 0 and 2 on replica 0, 1 and 3 on replica 1
            threads.append(threading.Thread(target=stream, args=(k,), daemon=True))
            threads[-1].start()
            assert started[k].wait(60)
        engines[0].process.kill()
        for t in threads:
            t.join(120)
        for k in (0, 2):
            assert "engine core process died" in json.loads(results[k][-2])["error"]["message"]
        for k in (1, 3):
            chunks = [json.loads(e) for e in results[k][:-1]]
            assert results[k][-1] == "[DONE]" and not any("error" in c for c in chunks)
            assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 120
        assert http.get("/health").status_code == 200  # one replica still serves
        for _ in range(3):  # every new request goes to the live replica
            r = http.post("/v1/completions", json={"prompt": "w1 w2", "max_tokens": 3})
            assert r.status_code == 200, r.text
        m = parse_metrics(http.get("/metrics").text)
        assert by_replica(m, "minicb:engine_alive") == {"0": 0.0, "1": 1.0}
        engines[1].process.kill()
        wait_until(lambda: http.get("/health").status_code == 503)
        r = http.post("/v1/completions", json={"prompt": "w1", "max_tokens": 2})
        assert r.status_code == 503 and "replica 1" in r.json()["error"]["message"]


def test_after_a_load_test_every_block_of_every_replica_is_free(model_dir):
    engines = [Engine(config(model_dir)) for _ in range(2)]  # in this process: the same code path
    with fleet(engines, routing_policy="cache_aware") as (http, dp):
        url = str(http.base_url)

        async def load():
            async with http_client(url, 32, 60) as client:
                bodies = make_workload(24, prompt_len=24, max_tokens=16, seed=3)
                results, _ = await run_level(client, bodies, 12, time.monotonic() + 120)
                # and some clients that walk away mid-stream
                left = await asyncio.gather(
                    *(one_request(client, b, leave_after=2) for b in bodies[:6])
                )
                return results, left

        results, left = asyncio.run(load())
        assert all(r.get("status") == 200 and "error" not in r for r in results), results
        assert all(r.get("abandoned") for r in left)

        def idle():
            m = parse_metrics(http.get("/metrics").text)
            return all(
                set(by_replica(m, name).values()) == {0.0}
                for name in (
                    "minicb:kv_blocks_used",
                    "vllm:num_requests_running",
                    "vllm:num_requests_waiting",
                )
            )

        wait_until(idle)
        for r in dp.replicas:
            bm = r.engine.scheduler.block_manager
            assert bm.num_used_blocks == 0 and not bm.num_hashed, repr(bm)
            bm.check_invariants()


def test_metrics_name_each_replica_once_per_series(model_dir):
    engines = [Engine(config(model_dir)) for _ in range(3)]
    with fleet(engines) as (http, dp):
        http.post("/v1/completions", json={"prompt": "w5 w6", "max_tokens": 2})
        text = http.get("/metrics").text
        families = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
        assert len(families) == len(set(families))  # one family per name: scrapers refuse repeats
        m = parse_metrics(text)
        assert set(by_replica(m, "minicb:kv_blocks_total")) == {"0", "1", "2"}
        assert sum(by_replica(m, "vllm:request_success_total").values()) >= 1


def test_a_full_replica_passes_the_request_on_and_503_means_the_fleet_is_full(model_dir):
    engines = [Engine(config(model_dir, max_num_seqs=1)) for _ in range(2)]
    dp = DataParallelEngine(engines, routing_policy="round_robin", max_waiting=1)
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)

    async def fill():
        streams = [await dp.submit([[5, 6, 7]], params) for _ in range(4)]  # 2 seats each
        with pytest.raises(Exception, match="every replica is full"):
            await dp.submit([[5, 6, 7]], params)
        held = [len(r.engine.output_processor.samples) for r in dp.replicas]
        name = dp.replicas[0].metrics.model_name
        fleet_503 = "minicb:fleet_admission_rejections_total"
        assert dp.registry.get_sample_value(fleet_503, {"model_name": name}) == 1
        abort_everywhere(dp, streams)
        return held

    assert run_started(dp, fill) == [2, 2]


def test_replicas_must_share_a_block_size(model_dir):
    with pytest.raises(ValueError, match="block_size"):
        DataParallelEngine([Engine(config(model_dir)), Engine(config(model_dir, block_size=8))])


def test_cache_aware_routing_keeps_a_conversation_on_the_replica_that_caches_it(model_dir):
    """Four turns of one conversation, each prompt the last one plus more: cache-aware routing
    sends every turn to the replica holding its prefix, so /metrics shows the hits there;
    round robin alternates and each replica recomputes what the other cached."""
    hits = {}
    for policy in ("cache_aware", "round_robin"):
        engines = [Engine(config(model_dir)) for _ in range(2)]
        with fleet(engines, routing_policy=policy) as (http, dp):
            prompt = list(range(3, 23))
            for turn in range(4):
                body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
                r = http.post("/v1/completions", json=body)
                prompt = prompt + r.json()["choices"][0]["token_ids"] + [30 + turn] * 5
            m = parse_metrics(http.get("/metrics").text)
            hits[policy] = by_replica(m, "vllm:prefix_cache_hits_total")
            queries = by_replica(m, "vllm:prefix_cache_queries_total")
            assert sum(queries.values()) == 20 + 29 + 38 + 47
    print("prefix-cache hits per replica:", hits)
    # A turn's cache holds the full blocks of 4 of its prompt and 3 of its 4 answers (the last is
    # never fed back): 23, 32, 41 tokens -> 20, 32, 40 tokens of hits for turns 2-4.
    assert hits["cache_aware"] == {"0": 20 + 32 + 40, "1": 0}
    # round robin: turns 1 and 3 on replica 0 (turn 3 finds turn 1's 20), 2 and 4 on replica 1
    assert hits["round_robin"] == {"0": 20, "1": 32}


def test_requests_sent_between_two_core_steps_count_in_the_load(model_dir):
    """A core reports a request in its stats only after its next step: until then the API process
    counts it as waiting, so that requests sent back to back spread over least-loaded replicas
    instead of all seeing the same stale "idle" replica."""
    engines = [RemoteEngine(config(model_dir), core_threads=1) for _ in range(2)]
    dp = DataParallelEngine(engines, routing_policy="least_loaded")
    params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)

    async def send():
        streams = [await dp.submit([[5, 6, 7 + i]], params) for i in range(6)]
        held = [r.engine.num_unfinished_requests for r in dp.replicas]
        abort_everywhere(dp, streams)
        return held

    assert run_started(dp, send) == [3, 3]


def parse_serve(*argv):
    import argparse

    from minicb.serve.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_serve_flags_build_one_engine_per_replica(model_dir):
    from minicb.serve.cli import make_engines

    args = parse_serve(
        "--model", str(model_dir), "--dtype", "float64", "--num-blocks", "64", "--block-size", "4",
        "--engine-in-process", "--data-parallel-size", "2", "--routing-policy", "cache_aware",
    )  # fmt: skip
    engines = make_engines(args)
    assert len(engines) == 2 and engines[0] is not engines[1]
    assert engines[0].scheduler is not engines[1].scheduler  # each its own scheduler and cache
    assert args.routing_policy == "cache_aware" and args.balance_threshold == 8
    with pytest.raises(SystemExit, match="at least 1"):
        make_engines(parse_serve("--data-parallel-size", "0"))
    with pytest.raises(SystemExit, match="a GPU per replica"):
        make_engines(parse_serve("--device", "cuda", "--data-parallel-size", "64"))
    with pytest.raises(SystemExit):  # argparse: an unknown policy names the choices
        parse_serve("--routing-policy", "random")


@pytest.mark.slow
def test_python_m_minicb_serve_data_parallel_end_to_end(model_dir):
    """`python -m minicb serve --data-parallel-size 2` as an operator runs it: two core processes,
    the banner says so, both replicas on /metrics, requests answered."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "minicb", "serve", "--model", str(model_dir), "--dtype", "float64",
           "--port", str(port), "--num-blocks", "128", "--block-size", "4",
           "--data-parallel-size", "2", "--routing-policy", "round_robin"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"

        def healthy():
            try:
                return httpx.get(f"{url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, timeout_s=180)
        for i in range(4):
            body = {"prompt": f"w{10 + i} w11", "max_tokens": 3, "temperature": 0}
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        routed = by_replica(
            parse_metrics(httpx.get(f"{url}/metrics").text), "minicb:router_requests_total"
        )
        assert routed == {"0": 2.0, "1": 2.0}
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    assert "2 replicas, routed round_robin" in out, out[-2000:]


def test_a_request_that_fails_alone_is_refused_alone_and_every_replica_stays(model_dir):
    """A request whose own inputs break add_request (not a full or a dead replica) gets its error;
    the fleet does not take it for a replica's death and keeps all its replicas."""
    engines = [Engine(config(model_dir)) for _ in range(2)]
    for engine in engines:
        add = engine.add_request

        def broken(prompt, *args, add=add, **kw):
            if 99 in prompt:
                raise TypeError("a bug this prompt finds")
            return add(prompt, *args, **kw)

        engine.add_request = broken
    dp = DataParallelEngine(engines, routing_policy="round_robin")
    params = SamplingParams(max_tokens=2, temperature=0)

    async def send():
        with pytest.raises(RuntimeError, match="a bug this prompt finds"):
            await dp.submit([[5, 99]], params)
        last = []
        for _ in range(2):
            batches = [outputs async for outputs in await dp.submit([[5, 6]], params)]
            last.append(batches[-1][0])  # each batch: the stream's newest outputs
        assert not dp._dead and dp.fatal_error is None  # both replicas still serve
        return last

    outs = run_started(dp, send)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]


def test_cache_aware_remembers_where_a_passed_on_request_went(model_dir):
    """A request cache-aware routing sent to a full replica runs on another: the router learns
    that the other now holds its prefix."""
    engines = [Engine(config(model_dir, max_num_seqs=1)) for _ in range(2)]
    dp = DataParallelEngine(engines, routing_policy="cache_aware", max_waiting=1)
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    prompt = list(range(3, 19))  # four full blocks of 4

    async def send():
        first = [await dp.submit([prompt], params) for _ in range(2)]  # replica 0 is full now
        passed_on = await dp.submit([prompt], params)  # cache-aware picks 0; 1 takes it
        held = [len(r.engine.output_processor.samples) for r in dp.replicas]
        abort_everywhere(dp, [*first, passed_on])
        return held

    assert run_started(dp, send) == [2, 1]
    assert dp.router.expected_hits(prompt) == [4, 4]
