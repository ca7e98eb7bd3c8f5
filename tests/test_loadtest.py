"""The load test (minicb/serve/loadtest.py, loadgen.py, soak.py): the yardstick's arithmetic and
table, a small run against a server on loopback beside its offline twin, the soak in a short
version, and the soak's checks each failing on what they must catch."""

import argparse
import io
import json
from types import SimpleNamespace

import pytest
from serving import one_torch_thread  # noqa: F401

from minicb import Engine, EngineConfig
from minicb.bench.machine import cpu_model
from minicb.model_executor.loader import save_tiny_model
from minicb.serve import loadtest
from minicb.serve.app import build_app
from minicb.serve.cli import ServerThread, add_arguments, add_engine_arguments, engine_config
from minicb.serve.engine_loop import AsyncEngine
from minicb.serve.loadgen import serve_command
from minicb.serve.soak import FLOOD_EXTRA, verify

ENGINE = dict(dtype="float64", block_size=4, num_blocks=1024, max_num_seqs=4)
# the same
FLAGS = ["--dtype", "float64", "--block-size", "4", "--num-blocks", "1024", "--max-num-seqs", "4"]
MAX_WAITING = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def url(model_dir):
    """A server on loopback, its engine in a thread of this process (quick to start; the load test's
    own `python -m minicb serve` processes are started in tests/test_server.py and the slow test
    below)."""
    engine = Engine(EngineConfig(model=model_dir, **ENGINE))
    with ServerThread(build_app(AsyncEngine(engine, max_waiting=MAX_WAITING))) as url:
        yield url


# ---------------------------------------------------------------------- the yardstick's arithmetic
def test_the_yardstick_sets_the_right_measures_side_by_side():
    one = {"concurrency": 1, "engine": "core", "tpot_p50": 0.060, "tokens_per_s": 15.0}
    results = [{"token_ids": [1, 2]}, {"token_ids": [3]}, {"error": "cancelled"}]
    loadtest.compare(
        one, results, {"token_ids": [[1, 2], [4], [5]], "tpot_p50": 0.050, "tokens_per_s": 99.0}
    )
    # server / offline, not inverted
    assert one["measure"] == "tpot_p50" and one["ratio"] == pytest.approx(1.2)
    assert (one["same_output"], one["compared"]) == (1, 2)  # a request that failed is not compared
    many = {"concurrency": 16, "engine": "core", "tpot_p50": 0.2, "tokens_per_s": 85.0}
    loadtest.compare(many, [], {"token_ids": [], "tpot_p50": 0.1, "tokens_per_s": 100.0})
    assert many["measure"] == "tokens_per_s" and many["ratio"] == pytest.approx(0.85)
    # --repeat: each side's median, and the median of the run-by-run ratios
    runs = [
        dict(many, server=s, offline=o, ratio=s / o) for s, o in [(90, 100), (60, 100), (95, 100)]
    ]
    rows = [loadtest.yardstick([one]), loadtest.yardstick(runs)]
    assert rows[0]["met"] and rows[0]["target"] == 1.25  # 1.2 <= 1.25
    # >= 0.90
    assert rows[1]["ratio"] == pytest.approx(0.90) and rows[1]["server"] == 90 and rows[1]["met"]
    assert not loadtest.yardstick([dict(many, server=89, offline=100, ratio=0.89)])["met"]
    out = io.StringIO()
    loadtest.print_yardstick(rows, "a CPU", out)
    text = out.getvalue()
    assert (
        "a CPU" in text
        and "60.0 ms" in text
        and "50.0 ms" in text
        and "1.20" in text
        and "<= 1.25x" in text
    )
    assert "output tok/s" in text and "0.90 0.60 0.95" in text and "NOT MET" not in text
    # under 6 runs no interval: the median alone decides
    assert rows[1]["interval"] is None and rows[1]["verdict"] == "met" and "no interval" in text


@pytest.mark.parametrize(
    "ratios, interval, verdict",
    [
        # 95%: with 8 runs, the smallest and the largest
        ([0.95, 0.99, 0.93, 0.91, 0.96, 0.97, 0.98, 0.94], (0.91, 0.99), "met"),
        # one run below the target puts it in the interval: the noise is wider than the gap
        ([0.85, 0.99, 0.93, 0.91, 0.96, 0.97, 0.98, 0.94], (0.85, 0.99), "within noise"),
        ([0.85, 0.80, 0.83, 0.81, 0.86, 0.87, 0.88, 0.84], (0.80, 0.88), "NOT MET"),
    ],
)
def test_the_yardstick_says_whether_its_verdict_is_beyond_the_noise(ratios, interval, verdict):
    many = {"concurrency": 64, "engine": "core", "measure": "tokens_per_s"}
    row = loadtest.yardstick([dict(many, server=100 * x, offline=100, ratio=x) for x in ratios])
    assert row["interval"] == interval and row["verdict"] == verdict
    assert row["met"] == (verdict != "NOT MET")  # the median, 0.945 or 0.845
    out = io.StringIO()
    loadtest.print_yardstick([row], "a CPU", out)
    assert ("%.2f-%.2f" % interval) in out.getvalue() and verdict in out.getvalue()
    assert ("within noise:" in out.getvalue()) == (verdict == "within noise")
    # TPOT at 1 client: lower is better
    one = {"concurrency": 1, "engine": "core", "measure": "tpot_p50"}
    tpots = [dict(one, server=x, offline=1, ratio=x) for x in (1.1, 1.2, 1.3, 1.0, 1.05, 1.15)]
    assert loadtest.yardstick(tpots)["verdict"] == "within noise"  # 1.0-1.3 holds 1.25
    assert loadtest.yardstick(tpots[:2] + tpots[3:] + tpots[:1])["verdict"] == "met"


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_offline_times_tokens_as_a_client_does(monkeypatch):
    """At 1 client the offline side's per-token time is the mean gap between a request's tokens (its
    prefill, before the first, left out), as a client's TPOT; at more, all tokens over the wall
    time."""
    clock = FakeClock()
    monkeypatch.setattr(loadtest.time, "perf_counter", clock)

    # prefill 100 ms, then one token every 10 ms (stream) or 4 tokens every 10 ms (generate)
    class FakeLLM:
        def stream(self, prompts, params):
            clock.t += 0.1
            for k in range(params.max_tokens):
                clock.t += 0.01 if k else 0
                yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(range(k + 1)))])

        def generate(self, prompts, params, use_tqdm):
            clock.t += 0.01 * max(p.max_tokens for p in params)
            return [
                SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(range(p.max_tokens)))])
                for p in params
            ]

    offline = loadtest.Offline.__new__(loadtest.Offline)
    offline.config, offline.llm, offline.slots = EngineConfig(max_num_seqs=4), FakeLLM(), 1
    bodies = [{"prompt": [1], "max_tokens": n} for n in (5, 9, 3, 7)]
    alone = offline.run(bodies, concurrency=1)
    assert alone["tpot_p50"] == pytest.approx(0.01) and alone["token_ids"][1] == list(range(9))
    offline.slots = 4  # min(clients, max_num_seqs): what 16 clients keep in flight
    together = offline.run(bodies, concurrency=16)
    assert together["tokens_per_s"] == pytest.approx(24 / 0.09)


def test_summarize_level_counts_tokens_over_the_wall_time():
    results = [
        {"token_ids": [1] * 10, "ttft": 0.1, "tpot": 0.02},
        {"token_ids": [1] * 30, "ttft": 0.3, "tpot": 0.04},
        {"error": loadtest.CANCELLED},
    ]
    state = {
        "kv_blocks_free": 8,
        "kv_blocks_total": 8,
        "kv_blocks_used": 0,
        "num_requests_running": 0,
    }
    row = loadtest.summarize_level(2, results, wall=2.0, state=state)
    assert (
        row["tokens_per_s"] == 20.0
        and row["tpot_p50"] == pytest.approx(0.03)
        and row["cancelled"] == 1
    )
    assert row["done"] == 2 and row["all_blocks_free"] and not row["errors"]


def test_a_servers_cpu_is_its_own_and_its_childrens(capsys):
    """The load test prints what each level cost the clients, the API process and the engine core
    (server_cpu): here this very process plays the server, and a child that spins for a while
    plays its engine core."""
    import os
    import subprocess
    import sys
    import time

    from minicb.serve import loadgen

    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    child = subprocess.Popen([sys.executable, "-c", spin + "time.sleep(30)"])
    try:
        loadgen.SERVER_PIDS["http://test"] = os.getpid()
        before = loadgen.server_cpu("http://test")
        deadline = time.monotonic() + 20
        while loadgen.cpu_seconds(child.pid) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
        after = loadgen.server_cpu("http://test")
    finally:
        child.kill()
        child.wait()
        del loadgen.SERVER_PIDS["http://test"]
    assert after["children"] - before["children"] >= 0.25  # the child's spin, counted once
    assert after["server"] >= before["server"] > 0
    assert loadgen.server_cpu("http://elsewhere") is None  # not started here: not measured
    cpu = loadtest.level_cpu(time.process_time(), before, after)
    row = {"done": 4, "requests": 4, "requests_per_s": 2.0, "tokens_per_s": 50.0} | cpu
    row["cpu_offline_s"] = 0.5  # compare() adds the offline twin's
    loadtest.print_level_cpu(row, sys.stdout)  # 100 tokens in the level
    printed = capsys.readouterr().out
    assert "CPU during the level: clients" in printed and "engine core" in printed
    assert f"({1000 * cpu['cpu_server_s'] / 100:.2f} ms a token)" in printed
    assert "offline twin 0.50 s (5.00 ms a token)" in printed


def test_serve_command_carries_the_engine_flags():
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    args = p.parse_args(
        FLAGS
        + [
            "--no-enable-prefix-caching",
            "--scheduling-policy",
            "priority",
            "--quantization",
            "int8",
        ]
    )
    cmd = serve_command(args, "/some/model", 8123, 17, in_process=True)
    assert engine_config(args).quantization == "int8"
    assert cmd[1:4] == ["-m", "minicb", "serve"]
    serve = argparse.ArgumentParser()
    add_arguments(serve)
    parsed = serve.parse_args(cmd[4:])
    assert engine_config(parsed) == engine_config(args, "/some/model")
    assert (parsed.port, parsed.max_waiting, parsed.engine_in_process) == (8123, 17, True)
    # the load test's --core-threads goes to a server with an engine-core process only
    args.core_threads = 1
    assert (
        serve.parse_args(serve_command(args, None, 8123, 17, in_process=False)[4:]).core_threads
        == 1
    )
    assert "--core-threads" not in serve_command(args, None, 8123, 17, in_process=True)
    # and its --stream-interval to either
    assert serve.parse_args(serve_command(args, None, 8123, 17, False)[4:]).stream_interval == 1
    args.stream_interval = 4
    assert serve.parse_args(serve_command(args, None, 8123, 17, True)[4:]).stream_interval == 4


# ---------------------------------------------------------------------- against a server
def test_a_small_run_prints_the_yardstick(url, model_dir, tmp_path, capsys):
    out = tmp_path / "load.json"
    rc = loadtest.main(
        [
            "--url",
            url,
            "--model",
            model_dir,
            *FLAGS,
            "--concurrency",
            "1,4",
            "--num-requests",
            "6",
            "--max-tokens",
            "8",
            "--prompt-len",
            "6",
            "--json",
            str(out),
        ]
    )
    result = json.loads(out.read_text())
    assert rc == 0 and result["ok"] and result["cpu"] == cpu_model()
    for level in result["levels"]:  # float64: the server's tokens are the offline engine's
        assert (
            level["done"] == level["compared"] == level["same_output"] == 6
            and level["all_blocks_free"]
        )
        assert level["ratio"] == pytest.approx(level["server"] / level["offline"])
        assert level["cpu_offline_s"] > 0  # the twin's CPU, beside the server's
    one, four = result["yardstick"]
    assert (one["concurrency"], one["measure"], four["concurrency"], four["measure"]) == (
        1,
        "tpot_p50",
        4,
        "tokens_per_s",
    )
    assert (
        one["server"] == result["levels"][0]["tpot_p50"]
        and four["server"] == result["levels"][1]["tokens_per_s"]
    )
    text = capsys.readouterr().out
    assert (
        "the yardstick" in text
        and cpu_model() in text
        and "TPOT p50" in text
        and "output tok/s" in text
    )


def test_the_soak_in_short(url, model_dir, tmp_path, capsys):
    out = tmp_path / "soak.json"
    rc = loadtest.main(
        [
            "--url",
            url,
            "--model",
            model_dir,
            *FLAGS,
            "--soak",
            "--soak-clients",
            "8",
            "--soak-seconds",
            "3",
            "--max-waiting",
            str(MAX_WAITING),
            "--max-tokens",
            "64",
            "--prompt-len",
            "8",
            "--json",
            str(out),
        ]
    )
    (s,) = json.loads(out.read_text())["soak"]
    assert rc == 0 and s["problems"] == [], capsys.readouterr().out
    # every walk-away was aborted by the server
    assert s["abandoned"] > 0 and s["aborted"] >= s["abandoned"]
    assert (
        s["flood"] == 4 + MAX_WAITING + FLOOD_EXTRA
        and s["refused"] > 0
        and s["accepted"] >= 4 + MAX_WAITING
    )
    assert s["finished"] > 0 and s["lost"] == s["twice"] == s["cut"] == 0
    assert s["same_as_offline"] == s["compared"] == s["requests"] + s["flood"] - s["refused"]
    assert "soak: passed" in capsys.readouterr().out


# ---------------------------------------------------------------------- the soak's checks
def soak_result(**change):
    """A soak that passed (a request in full, one abandoned, a flood past a bound of 2), with
    `change`: {"soak.0.usage": 2} sets result["soak"][0]["usage"]."""
    full = {"body": 0, "status": 200, "token_ids": [7, 8, 9], "finish_reason": "length", "usage": 3}
    idle = {"kv_blocks_used": 0, "num_requests_running": 0, "num_requests_waiting": 0}
    result = {
        "soak": [full, {"body": 0, "status": 200, "abandoned": True, "token_ids": [7]}],
        "flood": [
            {**full, "max_tokens": 3},
            {**full, "max_tokens": 3},
            {"body": 0, "status": 503, "retry_after": "1", "error": "HTTP 503: full"},
        ],
        "capacity": 2,
        "aborted": 1,
        "fresh": (200, 4),
        "health": 200,
        "idle_after_soak": idle,
        "state": idle,
    }
    for path, value in change.items():
        *keys, last = path.split(".")
        target = result
        for k in keys:
            target = target[int(k)] if isinstance(target, list) else target[k]
        target[int(last) if isinstance(target, list) else last] = value
    return result


BODIES, REFERENCE = [{"max_tokens": 3}], [[7, 8, 9]]


def test_the_soak_checks_pass_a_clean_run():
    counts = verify(soak_result(), BODIES, REFERENCE, exact=True)
    assert counts["problems"] == [] and (
        counts["finished"],
        counts["abandoned"],
        counts["refused"],
    ) == (3, 1, 1)


@pytest.mark.parametrize(
    "change, problem",
    [
        ({"soak.0.token_ids": [7, 8], "soak.0.usage": 2}, "lost"),  # answered 200, ended short
        ({"soak.0.finish_reason": "abort"}, "lost"),
        ({"soak.0.usage": 2}, "differ from the server's count"),  # a token the client got twice
        ({"soak.0.token_ids": [7, 9, 9]}, "differ from offline"),
        ({"flood.2.status": 500}, "other than 200 and 503"),
        ({"flood.2.retry_after": None}, "without Retry-After"),
        (
            {
                "flood.2": {
                    "body": 0,
                    "status": 200,
                    "token_ids": [7, 8, 9],
                    "finish_reason": "length",
                    "usage": 3,
                    "max_tokens": 3,
                }
            },
            "should fill the bound",
        ),  # nobody refused
        ({"capacity": 3}, "should fill the bound"),  # refused before the bound was reached
        ({"aborted": 0}, "aborted no request"),
        (
            {"state": {"kv_blocks_used": 2, "num_requests_running": 0, "num_requests_waiting": 0}},
            "not idle at the end",
        ),
        ({"fresh": (503, None)}, "a fresh request"),
        ({"soak.1": {"body": 0, "walker": True}}, "cut at the grace limit"),
    ],
)
def test_the_soak_checks_catch(change, problem):
    problems = verify(soak_result(**change), BODIES, REFERENCE, exact=True)["problems"]
    assert any(problem in p for p in problems), problems


def test_float32_tokens_may_differ_from_offline():
    counts = verify(soak_result(**{"soak.0.token_ids": [7, 9, 9]}), BODIES, REFERENCE, exact=False)
    assert counts["problems"] == [] and counts["same_as_offline"] == counts["compared"] - 1


# ---------------------------------------------------------------------- the default: `serve`
# processes
@pytest.mark.slow
def test_both_engines_are_measured(tmp_path):
    out = tmp_path / "both.json"
    rc = loadtest.main(
        [
            "--tiny",
            "--engine",
            "both",
            *FLAGS,
            "--concurrency",
            "1,4",
            "--num-requests",
            "4",
            "--max-tokens",
            "8",
            "--prompt-len",
            "6",
            "--json",
            str(out),
        ]
    )
    result = json.loads(out.read_text())
    assert rc == 0 and [(r["engine"], r["concurrency"]) for r in result["yardstick"]] == [
        ("core", 1),
        ("core", 4),
        ("in-process", 1),
        ("in-process", 4),
    ]
    assert all(r["same_output"] == r["compared"] == 4 for r in result["levels"])
    # CPU per level: the engine core is a child of the API process, in-process has none
    assert all(
        (r["cpu_core_s"] > 0) == (r["engine"] == "core") and r["cpu_server_s"] > 0
        for r in result["levels"]
    )


def test_repeated_runs_alternate_which_side_goes_first(url, model_dir, tmp_path, monkeypatch):
    """--repeat: the offline twin runs after the server's run, then before the next, and so on (a
    machine whose speed drifts then tilts neither side always the same way); each run is compared
    with its own twin."""
    order, real_level, real_offline = [], loadtest.run_level, loadtest.Offline.run

    async def server_side(*args, **kwargs):
        order.append("server")
        return await real_level(*args, **kwargs)

    def offline_side(self, *args, **kwargs):
        order.append("offline")
        return real_offline(self, *args, **kwargs)

    monkeypatch.setattr(loadtest, "run_level", server_side)
    monkeypatch.setattr(loadtest.Offline, "run", offline_side)
    args = ["--url", url, "--model", model_dir, *FLAGS, "--concurrency", "2", "--repeat", "3"]
    out = tmp_path / "load.json"
    assert (
        loadtest.main([*args, "--num-requests", "2", "--max-tokens", "4", "--json", str(out)]) == 0
    )
    assert order == ["server", "offline", "offline", "server", "server", "offline"]
    result = json.loads(out.read_text())
    (row,) = result["yardstick"]
    assert len(row["ratios"]) == 3 and all(r["same_output"] == 2 for r in result["levels"])
