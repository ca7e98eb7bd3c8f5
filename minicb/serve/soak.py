"""The heavier bounded run of the load test (`python -m minicb.serve.loadtest --soak`): what must
still hold after a server has been pushed hard, in three phases.

 1. Soak: --soak-clients clients (64) for --soak-seconds (60 s), each sending streaming requests
    back to back. A quarter of the clients walk away from every request after a few tokens: they
    close the connection, and the server must abort the request and free its KV blocks at once.
 2. Flood: once the soak's clients have stopped, max_num_seqs + max_waiting + FLOOD_EXTRA requests
    at once, past the server's bound on the requests it holds: the ones beyond it must get 503 with
    Retry-After (vLLM's --max-num-queued-reqs does the same), never 500, and the rest run to the
    end.
 3. After: nothing running or waiting, every KV block free, and a fresh request answered.

Nothing lost: every request answered 200 that its client did not walk away from finished with its
full token count (ignore_eos: max_tokens tokens, finish reason "length"). Nothing sent twice: the
client received as many tokens as the server says it generated (usage.completion_tokens), and in
float64 every request's tokens, those of the walkers up to where they left too, equal offline greedy
decoding's token for token (in float32 a different batch may round a near-tie the other way:
counted, not failed). Bounded: no request starts after the soak's time or SOAK_MAX_REQUESTS;
whatever still runs GRACE_S later is cancelled and reported.
"""

import asyncio
import itertools
import random
import time

import aiohttp

from .loadgen import http_client, one_request, server_state, start_server
from .metrics import parse_metrics

FLOOD_EXTRA = 16  # requests past the bound in the flood
SOAK_MAX_REQUESTS = 20_000  # the soak's bound by count (its time bound is --soak-seconds)
ABORTED = 'vllm:request_success_total{finished_reason="abort"}'  # requests the server aborted
# after the soak's time, for the requests in flight to finish; the flood's bound too
GRACE_S = 120.0


async def soak_phase(
    client, bodies: list[dict], num_clients: int, seconds: float, rng: random.Random
) -> list[dict]:
    stop_at, numbers, records = time.monotonic() + seconds, itertools.count(), []

    async def one_client(k: int) -> None:
        walker = k % 4 == 3  # a quarter of the clients
        while time.monotonic() < stop_at and (i := next(numbers)) < SOAK_MAX_REQUESTS:
            body = bodies[i % len(bodies)]
            leave = (
                rng.randint(1, min(8, body["max_tokens"] - 1))
                if walker and body["max_tokens"] > 1
                else None
            )
            record = {"body": i % len(bodies), "walker": leave is not None}
            records.append(record)  # still without a status if cancelled at the grace limit
            try:
                record.update(await one_request(client, body, leave))
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                record["error"] = f"{type(e).__name__}: {e}"

    tasks = [asyncio.ensure_future(one_client(k)) for k in range(num_clients)]
    _, pending = await asyncio.wait(tasks, timeout=seconds + GRACE_S)
    for t in pending:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return records


async def flood_phase(client, bodies: list[dict], capacity: int) -> list[dict]:
    """capacity + FLOOD_EXTRA requests at once (each with its longest output, so that none can
    finish before the last has been answered)."""
    flood = [
        {**bodies[i % len(bodies)], "max_tokens": max(b["max_tokens"] for b in bodies)}
        for i in range(capacity + FLOOD_EXTRA)
    ]
    results = await asyncio.wait_for(
        asyncio.gather(*(one_request(client, b) for b in flood), return_exceptions=True), GRACE_S
    )
    return [
        {
            "body": i % len(bodies),
            "max_tokens": b["max_tokens"],
            **(r if isinstance(r, dict) else {"error": f"{type(r).__name__}: {r}"}),
        }
        for i, (b, r) in enumerate(zip(flood, results))
    ]


async def soak(
    url: str, bodies: list[dict], num_clients: int, seconds: float, capacity: int, seed: int
) -> dict:
    for b in bodies:  # the server's count of each request's tokens comes in its last chunk
        b["stream_options"] = {"include_usage": True}
    async with http_client(
        url, max(num_clients, capacity + FLOOD_EXTRA) + 8, timeout=GRACE_S
    ) as client:
        records = await soak_phase(client, bodies, num_clients, seconds, random.Random(seed))
        idle_after_soak = await server_state(client)
        async with client.get("/metrics") as r:
            aborted = parse_metrics(await r.text()).get(ABORTED, 0)
        flood = await flood_phase(client, bodies, capacity)
        state = await server_state(client)
        async with client.post(
            "/v1/completions",
            json={"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True},
        ) as r:
            tokens = len((await r.json())["choices"][0]["token_ids"]) if r.status == 200 else None
            fresh = (r.status, tokens)
        async with client.get("/health") as r:
            health = r.status
    return {
        "soak": records,
        "idle_after_soak": idle_after_soak,
        "aborted": aborted,
        "flood": flood,
        "state": state,
        "fresh": fresh,
        "health": health,
        "capacity": capacity,
    }


def verify(
    result: dict, bodies: list[dict], reference: list[list[int]] | None, exact: bool
) -> dict:
    """Counts of what happened, and `problems`: what must not have happened."""
    problems, c = [], {}
    soak, flood = result["soak"], result["flood"]
    c["cut"] = sum("status" not in r and "error" not in r for r in soak)
    c["errors"] = sorted(
        {r["error"] for r in soak + flood if "error" in r and r.get("status") != 503}
    )
    c["abandoned"] = sum(bool(r.get("abandoned")) for r in soak)
    c["refused_in_soak"] = sum(r.get("status") == 503 for r in soak)
    answered = [
        (r, bodies[r["body"]]["max_tokens"])
        for r in soak
        if r.get("status") == 200 and "abandoned" not in r
    ]
    answered += [(r, r["max_tokens"]) for r in flood if r.get("status") == 200]
    full = [
        r
        for r, n in answered
        if "error" not in r and len(r["token_ids"]) == n and r["finish_reason"] == "length"
    ]
    c["finished"], c["lost"] = len(full), len(answered) - len(full)
    c["twice"] = sum(r["usage"] != len(r["token_ids"]) for r in full)
    if reference is not None:
        got = [r for r in soak + flood if "token_ids" in r]
        same = [r["token_ids"] == reference[r["body"]][: len(r["token_ids"])] for r in got]
        c["same_as_offline"], c["compared"] = sum(same), len(same)
        if exact and not all(same):
            problems.append(
                f"{len(same) - sum(same)} requests' tokens differ from offline greedy decoding "
                "(float64)"
            )
    statuses = [r.get("status") for r in flood]
    c["accepted"], c["refused"] = statuses.count(200), statuses.count(503)
    c["refused_without_retry_after"] = sum(
        r.get("status") == 503 and not r.get("retry_after") for r in flood
    )
    for what, n in [
        ("requests cut at the grace limit", c["cut"]),
        ("lost (answered 200, not finished in full)", c["lost"]),
        ("streams whose tokens differ from the server's count", c["twice"]),
        ("503s without Retry-After", c["refused_without_retry_after"]),
    ]:
        if n:
            problems.append(f"{n} {what}")
    problems += [f"error: {e}" for e in c["errors"]]
    if any(s not in (200, 503) for s in statuses):
        problems.append(
            f"flood statuses other than 200 and 503: {sorted(set(statuses) - {200, 503}, key=str)}"
        )
    if not c["refused"] or c["accepted"] < result["capacity"]:
        problems.append(
            f"the flood of {len(flood)} should fill the bound of {result['capacity']} and be "
            f"refused past it: {c['accepted']} accepted, {c['refused']} refused"
        )
    if c["abandoned"] and not result["aborted"]:
        problems.append(f"{c['abandoned']} clients walked away but the server aborted no request")
    for when, s in [("after the soak", result["idle_after_soak"]), ("at the end", result["state"])]:
        if s["kv_blocks_used"] or s["num_requests_running"] or s["num_requests_waiting"]:
            problems.append(f"not idle {when}: {s}")
    if result["fresh"] != (200, 4) or result["health"] != 200:
        problems.append(
            f"a fresh request got {result['fresh']} (status, tokens), /health {result['health']}"
        )
    return {**c, "problems": problems}


def report(args, result: dict, counts: dict, exact: bool, out=None) -> None:
    soak, s = result["soak"], result["state"]
    print(
        f"soak: {args.soak_clients} clients for {args.soak_seconds:g} s, a quarter walking away "
        f"after 1-8 tokens: {len(soak)} requests, {counts['abandoned']} abandoned (the server "
        f"aborted {result['aborted']:.0f}), {counts['refused_in_soak']} refused (503), "
        f"{counts['cut']} cut at the grace limit",
        file=out,
    )
    print(
        f"flood: {len(result['flood'])} requests at once past the bound of {result['capacity']} "
        f"(max_num_seqs + max_waiting): {counts['accepted']} accepted, {counts['refused']} refused "
        f"with 503 ({counts['refused_without_retry_after']} without Retry-After)",
        file=out,
    )
    print(
        f"requests answered 200 and not abandoned: {counts['finished']} finished with all their "
        f"tokens, {counts['lost']} lost; {counts['twice']} streams got more or fewer tokens than "
        "the server counted",
        file=out,
    )
    if "compared" in counts:
        tie_note = (
            "float64: must be all"
            if exact
            else "float32: a near-tie may round the other way in another batch"
        )
        print(
            "tokens equal to offline greedy decoding: "
            f"{counts['same_as_offline']}/{counts['compared']} requests ({tie_note})",
            file=out,
        )
    print(
        f"after: running {s['num_requests_running']:.0f}, waiting {s['num_requests_waiting']:.0f}, "
        f"KV blocks free {s['kv_blocks_free']:.0f}/{s['kv_blocks_total']:.0f}; a fresh request: "
        f"HTTP {result['fresh'][0]}, {result['fresh'][1]} tokens; /health: {result['health']}",
        file=out,
    )
    print(
        "soak: passed"
        if not counts["problems"]
        else "soak: FAILED\n  " + "\n  ".join(counts["problems"]),
        file=out,
    )


def soak_main(args, config, offline, workload) -> list[dict]:
    """The soak against each server of --engine (or --url): each one's counts and `problems`."""
    from contextlib import ExitStack

    max_waiting = args.max_waiting or 64  # serve's default
    capacity, outcomes = config.max_num_seqs + max_waiting, []
    bodies = workload(max(args.soak_clients, 8))
    engines = (
        ["--url"]
        if args.url
        else ["core", "in-process"]
        if args.engine == "both"
        else [args.engine]
    )
    for engine in engines:
        with ExitStack() as server:
            url = args.url or start_server(
                args, config.model, engine == "in-process", max_waiting, server
            )
            print(f"\nsoak of the server at {url} (engine: {engine})")
            result = asyncio.run(
                soak(
                    url.rstrip("/"),
                    bodies,
                    args.soak_clients,
                    args.soak_seconds,
                    capacity,
                    args.seed,
                )
            )
        # the flood's
        longest = [{**b, "max_tokens": max(b["max_tokens"] for b in bodies)} for b in bodies]
        reference = offline.run(longest, len(bodies))["token_ids"] if offline is not None else None
        counts = verify(result, bodies, reference, exact=config.dtype == "float64")
        report(args, result, counts, config.dtype == "float64")
        outcomes.append(
            {
                "engine": engine,
                "requests": len(result["soak"]),
                "flood": len(result["flood"]),
                "aborted": result["aborted"],
                **counts,
            }
        )
    return outcomes
