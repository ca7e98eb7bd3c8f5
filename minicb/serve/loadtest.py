"""A bounded load test of the HTTP server, measured against the offline engine on the same requests.

    python -m minicb.serve.loadtest                  # `python -m minicb serve` on loopback
    python -m minicb.serve.loadtest --engine both    # that, then `serve --engine-in-process`
    python -m minicb.serve.loadtest --tiny           # a tiny random model: a smoke test in seconds
    python -m minicb.serve.loadtest --soak           # 64 clients for 60 s, walk-aways, a flood
    python -m minicb.serve.loadtest --url http://127.0.0.1:8000   # a server already running

At each level, `clients` clients send streaming requests (by default one each, at least 8 in all), a
new one as soon as one ends. Each client measures on its own clock: TTFT = send -> first token,
TPOT = (last token - first token) / (tokens - 1); output tokens/s = all tokens / the level's wall
time. Prompts are token ids and decoding is greedy with ignore_eos, so each request's tokens depend
only on its prompt. After each level the server must be idle with every KV block free (GET
/metrics).

The yardstick (issue 14): what does the server cost over the engine it wraps? After each level,
while the server is idle, this process runs the same requests through an offline LLM built with the
same config: at 1 client one at a time through LLM.stream, and the server's TPOT p50 is set against
the offline per-token time measured the same way (target: at most 1.25x); at more clients all at
once through LLM.generate, with min(clients, max_num_seqs) slots, the most requests that many
clients keep in flight, and the server's output tokens/s is set against offline's (target: at least
0.90). With --repeat, the runs alternate which side goes first, and the yardstick is the median of
the run-by-run ratios. The server is `python -m minicb serve` in a process of its own, as a user
runs it, so the clients here share no interpreter with it. Bounded: fixed request counts, loopback
only, and a --time-limit (requests running then are cancelled, i.e. their clients disconnect;
offline runs start only before it).
"""

import argparse
import asyncio
import json
import os
import random
import sys
import time
from contextlib import ExitStack

from ..engine.router import ROUTING_POLICIES
from ..metrics import percentile
from .loadgen import (
    CANCELLED,
    check_loopback,
    http_client,
    one_request,
    server_cpu,
    server_state,
    start_server,
)
from .yardstick import Offline, compare, print_yardstick, yardstick

MIN_REQUESTS = 8  # per level by default: the p50 of fewer TPOTs moves too much from run to run


def make_workload(num_requests: int, prompt_len: int, max_tokens: int, seed: int) -> list[dict]:
    """Request bodies with mixed prompt and output lengths (so slots free up at different times)."""
    rng = random.Random(seed)
    bodies = []
    for _ in range(num_requests):
        prompt = [
            rng.randrange(3, 100) for _ in range(rng.randint(max(1, prompt_len // 2), prompt_len))
        ]
        bodies.append(
            {
                "prompt": prompt,
                "max_tokens": rng.randint(max(1, max_tokens // 2), max_tokens),
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
        )
    return bodies


async def run_level(
    client, bodies: list[dict], concurrency: int, deadline: float
) -> tuple[list, float]:
    """All bodies with `concurrency` clients at a time; requests unfinished at `deadline` are
    cancelled."""
    gate = asyncio.Semaphore(concurrency)

    async def gated(body):
        async with gate:
            return await one_request(client, body)

    t0 = time.perf_counter()
    tasks = [asyncio.ensure_future(gated(b)) for b in bodies]
    await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
    results = []
    for t in tasks:
        if not t.done():
            # closes the connection: the server must abort the request and free its blocks
            t.cancel()
            results.append({"error": CANCELLED})
        elif t.exception() is not None:
            results.append({"error": f"{type(t.exception()).__name__}: {t.exception()}"})
        else:
            results.append(t.result())
    await asyncio.gather(*tasks, return_exceptions=True)
    ends = [r["end"] for r in results if "end" in r]
    return results, (max(ends) - t0) if ends else float("nan")


def level_cpu(client0: float, server0: dict | None, server1: dict | None) -> dict:
    """CPU seconds used during a level by the clients (this process: nothing else runs in it then)
    and, for a server started here, by its process and by its children (the engine core). On 2
    cores every one of them takes time from the engine's matmuls."""
    cpu = {"cpu_clients_s": time.process_time() - client0}
    if server0 is not None and server1 is not None:
        cpu["cpu_server_s"] = server1["server"] - server0["server"]
        cpu["cpu_core_s"] = server1["children"] - server0["children"]
    return cpu


def print_level_cpu(row: dict, out) -> None:
    tokens = row["tokens_per_s"] * row["done"] / row["requests_per_s"] if row["done"] else 0
    per_token = lambda s: f" ({1000 * s / tokens:.2f} ms a token)" if tokens else ""
    parts = [f"clients {row['cpu_clients_s']:.2f} s{per_token(row['cpu_clients_s'])}"]
    if "cpu_server_s" in row:
        core = row["cpu_core_s"] > 0  # with --engine-in-process the engine runs in the server
        parts.append(
            f"{'API process' if core else 'server'} {row['cpu_server_s']:.2f} s"
            f"{per_token(row['cpu_server_s']) if core else ''}"
        )
        if core:
            parts.append(f"engine core {row['cpu_core_s']:.2f} s{per_token(row['cpu_core_s'])}")
    if "cpu_offline_s" in row:  # the same tokens offline, in this process (its engine's threads)
        parts.append(f"offline twin {row['cpu_offline_s']:.2f} s{per_token(row['cpu_offline_s'])}")
    print(f"        CPU during the level: {', '.join(parts)}", file=out)


def summarize_level(concurrency: int, results: list[dict], wall: float, state: dict) -> dict:
    done = [r for r in results if "error" not in r]
    tpots = [r["tpot"] for r in done if r["tpot"] is not None]
    ttfts = [r["ttft"] for r in done if r["ttft"] is not None]
    return dict(
        concurrency=concurrency,
        requests=len(results),
        done=len(done),
        requests_per_s=len(done) / wall,
        tokens_per_s=sum(len(r["token_ids"]) for r in done) / wall,
        ttft_p50=percentile(ttfts, 50),
        ttft_p99=percentile(ttfts, 99),
        tpot_p50=percentile(tpots, 50),
        tpot_p99=percentile(tpots, 99),
        cancelled=sum(r.get("error") == CANCELLED for r in results),
        errors=sorted({r["error"] for r in results if r.get("error", CANCELLED) != CANCELLED}),
        blocks_free=int(state["kv_blocks_free"]),
        blocks_total=int(state["kv_blocks_total"]),
        all_blocks_free=state["kv_blocks_used"] == 0 and state["num_requests_running"] == 0,
    )


async def load_test(
    url: str,
    levels: list[int],
    workloads: dict,
    time_limit: float,
    offline: Offline | None,
    engine: str = "core",
    repeat: int = 1,
    out=None,
) -> tuple[list[dict], list[dict]]:
    """Each level `repeat` times, each run with its offline twin (after it, or before it every
    other run); returns (every run, yardstick rows). The time limit counts from the end of the
    warm-up: on a slow or busy machine the warm-up may take longer than a short limit, and the
    first level must still run (and be cut short) within it."""
    runs, rows = [], []
    # Requests still running at the deadline are cancelled by run_level; the client's own timeout
    # only guards against a server that stops answering.
    async with http_client(url, max(levels) + 4, timeout=max(60.0, time_limit)) as client:
        async with client.get("/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        # warm-up, not measured
        await one_request(client, {**workloads[levels[0]][0], "max_tokens": 4})
        deadline = time.monotonic() + time_limit
        print(f"\nload test of {model} at {url} (engine: {engine}), greedy, ignore_eos", file=out)
        print(
            f"{'clients':>7} {'done':>7} {'req/s':>7} {'tok/s':>8} {'TTFT p50':>9} {'p99':>7} "
            f"{'TPOT p50':>9} {'p99':>7} {'same out':>9} {'blocks free':>12}",
            file=out,
        )
        ms = lambda x: "-" if x != x else f"{1000 * x:.0f} ms"  # x != x: NaN, nothing measured
        for c in levels:
            bodies, level = workloads[c], []
            for i in range(repeat):
                if time.monotonic() >= deadline:
                    print(f"{c:>7} skipped: time limit reached", file=out)
                    break
                # Every other run measures its offline twin first (A B, B A, ...): on a machine
                # whose speed drifts between two runs, the drift then falls on both sides in turn
                # instead of always on the same one.
                twin = offline.run(bodies, c) if offline is not None and i % 2 else None
                cpu0, server0 = time.process_time(), server_cpu(url)
                results, wall = await run_level(client, bodies, c, deadline)
                cpu = level_cpu(cpu0, server0, server_cpu(url))
                row = {
                    "engine": engine,
                    **summarize_level(c, results, wall, await server_state(client)),
                    **cpu,
                }
                if offline is not None and not row["cancelled"]:
                    if twin is None and time.monotonic() < deadline:
                        twin = offline.run(bodies, c)  # the server is idle now
                    if twin is not None:
                        compare(row, results, twin)
                        level.append(row)
                runs.append(row)
                same = f"{row['same_output']}/{row['compared']}" if "compared" in row else "-"
                print(
                    f"{c:>7} {'%d/%d' % (row['done'], len(bodies)):>7} "
                    f"{row['requests_per_s']:>7.2f} {row['tokens_per_s']:>8.1f} "
                    f"{ms(row['ttft_p50']):>9} {ms(row['ttft_p99']):>7} {ms(row['tpot_p50']):>9} "
                    f"{ms(row['tpot_p99']):>7} {same:>9} "
                    f"{'%d/%d' % (row['blocks_free'], row['blocks_total']):>12}",
                    file=out,
                )
                if cpu:
                    print_level_cpu(row, out)
                if row["cancelled"]:
                    print(
                        f"        {row['cancelled']} requests cancelled at the time limit (clients "
                        "disconnected)",
                        file=out,
                    )
                for e in row["errors"]:
                    print(f"        error: {e}", file=out)
            if level:
                rows.append(yardstick(level))
    return runs, rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m minicb.serve.loadtest",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--url", default=None, help="a running server on loopback (default: start one here)"
    )
    p.add_argument(
        "--engine",
        default="core",
        choices=["core", "in-process", "both"],
        help="the server started here: `serve` with its engine-core process (serve's default), "
        "`serve --engine-in-process`, or one then the other",
    )
    p.add_argument("--tiny", action="store_true", help="serve a tiny random model instead (fast)")
    from .cli import add_engine_arguments, engine_config

    # no time target by default: the load test compares throughput, server against offline
    add_engine_arguments(
        p.add_argument_group("the engine (of the server started here, and offline)"),
        max_decode_slowdown=0,
    )
    p.add_argument(
        "--core-threads",
        type=int,
        default=None,
        help=(
            "serve's --core-threads: torch threads of its engine-core process "
            "(default: one per core)"
        ),
    )
    p.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="serve's --stream-interval: new tokens per streamed chunk (default 1: each token)",
    )
    p.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="serve's --data-parallel-size: N replicas behind the server (the offline yardstick "
        "stays one engine on the whole machine)",
    )
    p.add_argument(
        "--routing-policy",
        default="least_loaded",
        choices=ROUTING_POLICIES,
        help="serve's --routing-policy, with --data-parallel-size (default least_loaded)",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=None,
        help="serve's --max-waiting (default: room for every client; with --soak, serve's 64)",
    )
    p.add_argument(
        "--concurrency", default="1,16,64", help="comma-separated client counts (default 1,16,64)"
    )
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help=f"requests per level (default: one per client, at least {MIN_REQUESTS})",
    )
    p.add_argument(
        "--prompt-len", type=int, default=32, help="longest prompt in tokens (default 32)"
    )
    p.add_argument(
        "--max-tokens", type=int, default=64, help="longest output in tokens (default 64)"
    )
    p.add_argument(
        "--time-limit",
        type=float,
        default=900.0,
        help="hard limit for each server's load in s, counted from the end of its warm-up request",
    )
    p.add_argument(
        "--no-offline", action="store_true", help="skip the yardstick (the offline runs)"
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of each level, each with its offline twin: the "
        "yardstick takes the median (3 on a machine shared with other work)",
    )
    p.add_argument(
        "--soak",
        action="store_true",
        help="the heavier bounded run of soak.py instead of the levels",
    )
    p.add_argument("--soak-clients", type=int, default=64, help="clients of the soak (default 64)")
    p.add_argument(
        "--soak-seconds", type=float, default=60.0, help="how long they send requests (default 60)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    if (
        not levels
        or min(levels) < 1
        or (args.num_requests or 1) < 1
        or args.time_limit <= 0
        or args.repeat < 1
    ):
        p.error(
            "concurrency levels, --num-requests and --repeat must be positive, --time-limit > 0"
        )
    if args.url:
        try:
            check_loopback(args.url)
        except ValueError as e:
            p.error(str(e))
    from ..bench.machine import cpu_model

    workload = lambda n: make_workload(
        args.num_requests or n, args.prompt_len, args.max_tokens, args.seed
    )
    result = {"cpu": cpu_model(), "cpus": os.cpu_count(), "levels": [], "yardstick": []}
    with ExitStack() as stack:
        model = args.model
        if args.tiny:
            import tempfile

            from ..model_executor.loader import save_tiny_model

            model = str(save_tiny_model(stack.enter_context(tempfile.TemporaryDirectory())))
        config = engine_config(args, model)
        offline = None if args.no_offline else Offline(config)
        if args.soak:
            from .soak import soak_main

            result["soak"] = soak_main(args, config, offline, workload)
            result["ok"] = not any(s["problems"] for s in result["soak"])
        else:
            run_levels(args, model, levels, workload, offline, result)
            result["ok"] = all(r["all_blocks_free"] and not r["errors"] for r in result["levels"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["ok"] else 1


def run_levels(
    args, model: str | None, levels: list[int], workload, offline: Offline | None, result: dict
) -> None:
    workloads = {c: workload(max(c, MIN_REQUESTS)) for c in levels}
    # every client may wait
    max_waiting = args.max_waiting or max(len(b) for b in workloads.values())
    for engine in (
        ["--url"]
        if args.url
        else ["core", "in-process"]
        if args.engine == "both"
        else [args.engine]
    ):
        with ExitStack() as server:  # one server at a time: stopped before the next starts
            url = args.url or start_server(args, model, engine == "in-process", max_waiting, server)
            runs, rows = asyncio.run(
                load_test(
                    url.rstrip("/"),
                    levels,
                    workloads,
                    args.time_limit,
                    offline,
                    engine,
                    args.repeat,
                )
            )
        result["levels"] += runs
        result["yardstick"] += rows
        freed = all(r["all_blocks_free"] for r in runs)
        print(f"every KV block free again once each level's load ended: {'yes' if freed else 'NO'}")
        if rows:
            print_yardstick(rows, result["cpu"])


if __name__ == "__main__":
    sys.exit(main())
