"""A bounded load test of the HTTP server: throughput and latency under concurrent clients.

    python -m minicb.serve.loadtest                   # the embedded SmolLM2, served on a free loopback port
    python -m minicb.serve.loadtest --tiny            # a tiny random model: a smoke test in seconds
    python -m minicb.serve.loadtest --url http://127.0.0.1:8000    # a server already running (loopback only)

At each concurrency level, `--num-requests` streaming requests are sent by that many clients at
once. Each client measures on its own clock: TTFT = send -> first token, TPOT = (last token -
first token) / (tokens - 1). As concurrency grows, continuous batching turns waiting clients into
a larger decode batch: output tokens/s rises while each stream's TPOT grows more slowly.
Bounded by construction: a fixed number of requests, a hard `--time-limit` for the whole run
(requests still running then are cancelled, i.e. their clients disconnect), loopback only.
After each level the test checks what must hold once the load ends: no request running or
waiting, and every KV block free again (GET /metrics). It also checks that the server stayed
correct: prompts are token ids, decoding is greedy with ignore_eos, so each request's tokens
depend only on its prompt and are compared with those of the first level ("same out"; exact in
float64, while in float32 a different batch may round a near-tie the other way).
"""

import argparse
import asyncio
import ipaddress
import json
import random
import socket
import sys
import tempfile
import time
from contextlib import ExitStack
from urllib.parse import urlparse

import httpx

from ..metrics import percentile
from .metrics import parse_metrics

CANCELLED = "cancelled at the time limit"
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "minicb:kv_blocks_used", "minicb:kv_blocks_free",
          "minicb:kv_blocks_total")  # read from /metrics once the load has passed


def make_workload(num_requests: int, prompt_len: int, max_tokens: int, seed: int) -> list[dict]:
    """Request bodies with mixed prompt and output lengths (so slots free up at different times)."""
    rng = random.Random(seed)
    bodies = []
    for _ in range(num_requests):
        prompt = [rng.randrange(3, 100) for _ in range(rng.randint(max(1, prompt_len // 2), prompt_len))]
        bodies.append({"prompt": prompt, "max_tokens": rng.randint(max(1, max_tokens // 2), max_tokens),
                       "temperature": 0, "ignore_eos": True, "stream": True})
    return bodies


async def one_request(client: httpx.AsyncClient, body: dict) -> dict:
    """Stream one completion; return its token ids and client-side timings (seconds)."""
    t0 = time.perf_counter()
    times, ids = [], []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": chunk["error"]["message"]}
            new = chunk["choices"][0]["token_ids"]
            if new:
                ids += new
                times.append(time.perf_counter())
    n = len(ids)
    return {"token_ids": ids, "ttft": times[0] - t0 if times else None,
            "tpot": (times[-1] - times[0]) / (n - 1) if n > 1 else None, "end": time.perf_counter()}


async def run_level(client, bodies: list[dict], concurrency: int, deadline: float) -> tuple[list, float]:
    """All bodies with `concurrency` clients at a time; requests unfinished at `deadline` are cancelled."""
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
            t.cancel()  # closes the connection: the server must abort the request and free its blocks
            results.append({"error": CANCELLED})
        elif t.exception() is not None:
            results.append({"error": f"{type(t.exception()).__name__}: {t.exception()}"})
        else:
            results.append(t.result())
    await asyncio.gather(*tasks, return_exceptions=True)
    ends = [r["end"] for r in results if "end" in r]
    return results, (max(ends) - t0) if ends else float("nan")


async def server_state(client, timeout: float = 10.0) -> dict:
    """The /metrics gauges once the server is idle (running = waiting = 0), or after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        m = parse_metrics((await client.get("/metrics")).text)
        gauges = {name.split(":")[1]: m[name] for name in GAUGES}
        idle = gauges["num_requests_running"] == gauges["num_requests_waiting"] == 0
        if (idle and gauges["kv_blocks_used"] == 0) or time.monotonic() > deadline:
            return gauges
        await asyncio.sleep(0.05)


def summarize_level(concurrency: int, results: list[dict], wall: float, reference: list, state: dict) -> dict:
    done = [r for r in results if "error" not in r]
    ttfts = [r["ttft"] for r in done if r["ttft"] is not None]
    tpots = [r["tpot"] for r in done if r["tpot"] is not None]
    ntok = sum(len(r["token_ids"]) for r in done)
    # Compared: requests that completed both here and in the reference level.
    pairs = [(r["token_ids"], ref) for r, ref in zip(results, reference) if "error" not in r and ref is not None]
    return dict(concurrency=concurrency, done=len(done), requests_per_s=len(done) / wall, tokens_per_s=ntok / wall,
                ttft_p50=percentile(ttfts, 50), ttft_p99=percentile(ttfts, 99),
                tpot_p50=percentile(tpots, 50), tpot_p99=percentile(tpots, 99),
                compared=len(pairs), same_output=sum(a == b for a, b in pairs),
                cancelled=sum(r.get("error") == CANCELLED for r in results),
                errors=sorted({r["error"] for r in results if r.get("error", CANCELLED) != CANCELLED}),
                blocks_free=int(state["kv_blocks_free"]), blocks_total=int(state["kv_blocks_total"]),
                all_blocks_free=state["kv_blocks_used"] == 0 and state["num_requests_running"] == 0)


async def load_test(url: str, levels: list[int], bodies: list[dict], time_limit: float, out=sys.stdout) -> dict:
    deadline = time.monotonic() + time_limit
    reference, rows = None, []
    # TCP_NODELAY: httpx writes headers and body separately, and Nagle's algorithm would hold the
    # body back until the server's delayed ACK (~40 ms), which would show up as TTFT.
    transport = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=max(levels) + 4),
                                         socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(time_limit), transport=transport) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        print(f"load test of {model} at {url}: {len(bodies)} requests per level, greedy, ignore_eos, "
              f"time limit {time_limit:g} s", file=out)
        print(f"{'clients':>7} {'done':>5} {'req/s':>7} {'tok/s':>8} {'TTFT p50':>9} {'p99':>7} {'TPOT p50':>9} "
              f"{'p99':>7} {'same out':>9} {'blocks free':>12}", file=out)
        for c in levels:
            if time.monotonic() >= deadline:
                print(f"{c:>7} skipped: time limit reached", file=out)
                continue
            results, wall = await run_level(client, bodies, c, deadline)
            state = await server_state(client)
            first = reference is None
            if first:
                reference = [r.get("token_ids") for r in results]
            row = summarize_level(c, results, wall, reference, state)
            rows.append(row)
            ms = lambda x: "-" if x != x else f"{1000 * x:.0f} ms"  # x != x: NaN, nothing measured
            same = "(ref)" if first else f"{row['same_output']}/{row['compared']}"
            print(f"{c:>7} {row['done']:>5} {row['requests_per_s']:>7.2f} {row['tokens_per_s']:>8.1f} "
                  f"{ms(row['ttft_p50']):>9} {ms(row['ttft_p99']):>7} {ms(row['tpot_p50']):>9} "
                  f"{ms(row['tpot_p99']):>7} {same:>9} {'%d/%d' % (row['blocks_free'], row['blocks_total']):>12}",
                  file=out)
            if row["cancelled"]:
                print(f"        {row['cancelled']} requests cancelled at the time limit (clients disconnected)",
                      file=out)
            for e in row["errors"]:
                print(f"        error: {e}", file=out)
    freed = all(r["all_blocks_free"] for r in rows)
    print(f"every KV block free again once each level's load ended: {'yes' if freed else 'NO'}", file=out)
    ok = freed and not any(r["errors"] for r in rows)
    return {"model": model, "levels": rows, "ok": ok}


def start_server(args, stack: ExitStack) -> str:
    """Serve `args.model` (or a tiny random model) in this process, on a free loopback port."""
    from ..engine import Engine
    from .app import build_app
    from .cli import ServerThread, engine_config
    from .engine_loop import AsyncEngine

    model = args.model
    if args.tiny:
        from ..loader import save_tiny_model

        model = str(save_tiny_model(stack.enter_context(tempfile.TemporaryDirectory())))
    print(f"starting a server on loopback ({model or 'embedded SmolLM2-135M-Instruct'}, {args.dtype}, "
          f"max_num_seqs={args.max_num_seqs})...", file=sys.stderr)
    engine = Engine(engine_config(args, model))
    app = build_app(AsyncEngine(engine, max_waiting=args.num_requests))  # every client may wait
    return stack.enter_context(ServerThread(app))


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"the load test only targets loopback servers (127.0.0.1, ::1, localhost), not {host!r}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m minicb.serve.loadtest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running server on loopback (default: start one here)")
    p.add_argument("--tiny", action="store_true", help="serve a tiny random model instead (fast)")
    from .cli import add_engine_arguments

    add_engine_arguments(p.add_argument_group("the server started here (without --url)"))
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated client counts (default 1,4,16)")
    p.add_argument("--num-requests", type=int, default=32, help="requests per level (default 32)")
    p.add_argument("--prompt-len", type=int, default=32, help="longest prompt in tokens (default 32)")
    p.add_argument("--max-tokens", type=int, default=64, help="longest output in tokens (default 64)")
    p.add_argument("--time-limit", type=float, default=300.0, help="hard limit for the whole run in s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    if not levels or min(levels) < 1 or args.num_requests < 1 or args.time_limit <= 0:
        p.error("concurrency levels and --num-requests must be positive, --time-limit > 0")
    bodies = make_workload(args.num_requests, args.prompt_len, args.max_tokens, args.seed)
    with ExitStack() as stack:
        try:
            if args.url:
                check_loopback(args.url)
            url = args.url or start_server(args, stack)
        except ValueError as e:
            p.error(str(e))
        result = asyncio.run(load_test(url.rstrip("/"), levels, bodies, args.time_limit))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
