"""The collateral bench (issue 37): what one expensive but valid request costs everyone else.

    python -m minicb.serve.collateral                          # before and after, every probe
    python -m minicb.serve.collateral --after --probes long-prompt,logit-bias --scale 0.25

Each probe is tried on `python -m minicb serve` (the embedded SmolLM2-135M, --max-num-seqs 8,
--max-model-len 8192) in a process of its own. Three clients stream 80-token greedy completions
back to back; once each has its first token the probe is sent, and a second later a small request
(8 tokens, not streamed) on a connection of its own. Until both are answered or --window-s has
passed, the bench records the streams' inter-token gaps; then everything still running is
cancelled (its client leaves), so that a server without protections cannot keep it for hours. A
first trial without a probe gives the streams' gaps alone, on the same server. The table: the
probe's answer (200, or the 400's message), the others' gap (median / p90, and how many times
their gap alone) and the small request's latency (capped at the window).

"before" is the server with its protections off: `--max-decode-slowdown 0` and every per-request
bound (a `--max-*` flag of `serve --help` beyond the engine's sizes) out of reach, or with
--before-tree the server of another checkout (the commit before issue 37: its per-token work too);
"after" is the server's defaults. A server still busy after a trial is restarted. The full-size
probes need the machine to themselves: run them with nothing else running, and quote the CPU.
"""

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import aiohttp

from ..metrics import percentile
from ..sampling_params import MAX_LOGPROBS
from .loadgen import http_client, server_state, stop, wait_until_healthy

SERVE = ["--max-num-seqs", "8", "--max-model-len", "8192"]
# the engine's sizes and the limits that were there before issue 37: the same before and after
KEPT = {"--max-num-seqs", "--max-num-batched-tokens", "--max-model-len", "--max-waiting"}
KEPT.add("--max-request-bytes")
# "before": every new bound past any 4 MiB body (but no time target, and --max-logprobs as before)
OUT_OF_REACH = "1000000000"
BEFORE = {"--max-decode-slowdown": "0", "--max-logprobs": str(MAX_LOGPROBS)}
MAX_BODY = 4 * 2**20  # the body limit (--max-request-bytes' default): the lists are sized to it
STREAMS = 3
STREAM_TOKENS = 80
SMALL_TOKENS = 8
SMALL_AFTER_S = 1.0  # the small request follows the probe by this much
BASELINE_S = 5.0  # the streams alone are measured this long
IDLE_WAIT_S = 15.0  # after a trial, for the server to be idle again; else it is restarted
PROMPT = 8000  # the long prompts' tokens: with 16 new ones, within --max-model-len 8192
STOP_CHARS = "~^|@$%&"  # stop strings of three of these: unlikely in the probe's own text


def ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def sized(full: int, scale: float, least: int = 1) -> int:
    return max(least, round(full * scale))


def stop_strings(count: int) -> list[str]:
    k = len(STOP_CHARS)
    return [
        STOP_CHARS[i % k] + STOP_CHARS[i // k % k] + STOP_CHARS[i // k // k % k]
        for i in range(count)
    ]


def probe_bodies(scale: float, rng: random.Random, vocab: int) -> dict:
    """The issue's expensive requests, valid per the schema, at `scale` of their full size: each a
    function that builds its body (some take seconds and megabytes; only the chosen are built).
    Prompts are random token ids drawn afresh for each run: nothing is in the prefix cache."""
    prompt = sized(PROMPT, scale, 16)
    output = sized(1000, scale, 8)  # a probe that costs per token: long enough to fill the window
    longest = sized(8000, scale, 8)
    # `"~^|",` is 6 bytes: as many stop strings as fit the body limit, with room for the rest
    num_stop = min(sized(700_000, scale), (MAX_BODY - 4096) // 6)
    short = lambda: ids(rng, 16, vocab)
    plain = {"temperature": 0, "ignore_eos": True}
    return {
        "echo-logprobs": lambda: {
            "prompt": ids(rng, prompt, vocab), "max_tokens": 16, "echo": True, "logprobs": 1,
            "prompt_logprobs": 1, **plain,
        },
        "long-prompt": lambda: {"prompt": ids(rng, prompt, vocab), "max_tokens": 16, **plain},
        "stop-strings": lambda: {
            "prompt": short(), "max_tokens": output, "stop": stop_strings(num_stop), **plain,
        },
        "stop-strings-n8": lambda: {
            "prompt": short(), "max_tokens": output, "n": 8, "stop": stop_strings(num_stop),
            **plain,
        },
        "stop-token-ids": lambda: {
            "prompt": short(), "max_tokens": output, "min_tokens": output,
            "stop_token_ids": ids(rng, sized(500_000, scale), vocab), **plain,
        },
        "logit-bias": lambda: {
            "prompt": short(), "max_tokens": output,
            "logit_bias": {
                str(t): round(rng.uniform(-1, 1), 2) for t in range(sized(vocab, scale))
            },
            **plain,
        },
        "n8-long": lambda: {"prompt": short(), "n": 8, "max_tokens": longest, **plain},
        "prompts20-n8": lambda: {
            "prompt": [short() for _ in range(sized(20, scale))], "n": 8, "max_tokens": longest,
            **plain,
        },
    }  # fmt: skip


PROBES = list(probe_bodies(1.0, random.Random(0), 2))  # their names, in the table's order


# ---------------------------------------------------------------------- one trial
async def stream_back_to_back(client, body: dict, requests: list[list[float]]) -> None:
    """Stream completions one after another until cancelled; each request's token arrival times
    are appended to `requests` as they come (so that a cancelled trial keeps them)."""
    while True:
        times = []
        requests.append(times)
        async with client.post("/v1/completions", json=body) as r:
            if r.status != 200:  # 503: the probe holds what the server can hold
                await r.read()
                await asyncio.sleep(0.1)
                continue
            async for line in r.content:
                is_data = line.startswith(b"data: {")
                if is_data and any(c["token_ids"] for c in json.loads(line[6:])["choices"]):
                    times.append(time.perf_counter())


async def timed_post(client, content: bytes) -> dict:
    t0 = time.perf_counter()
    headers = {"content-type": "application/json"}
    async with client.post("/v1/completions", data=content, headers=headers) as r:
        status, body = r.status, await r.read()
    took = time.perf_counter() - t0
    if status != 200:
        try:
            message = json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = body[:200].decode(errors="replace")
        return {"status": status, "message": message, "s": took}
    finish = sorted({c["finish_reason"] for c in json.loads(body)["choices"]})
    return {"status": 200, "finish": ",".join(finish), "s": took}


async def trial(url: str, probe: bytes | None, window_s: float) -> dict:
    """Three streams, the probe beside them (None: alone, for BASELINE_S), and a small request."""
    streams = [[] for _ in range(STREAMS)]
    clients = [http_client(url, 1, window_s + 60) for _ in range(STREAMS + 2)]
    bodies = [
        {"prompt": [100 + k, 200 + k, 300 + k], "max_tokens": STREAM_TOKENS, "temperature": 0,
         "ignore_eos": True, "stream": True}
        for k in range(STREAMS)
    ]  # fmt: skip
    small = {"prompt": [400, 500, 600, 700], "max_tokens": SMALL_TOKENS, "temperature": 0}
    tasks = [
        asyncio.ensure_future(stream_back_to_back(c, b, r))
        for c, b, r in zip(clients, bodies, streams)
    ]
    pending = []
    try:
        deadline = time.monotonic() + 120
        while not all(r and r[0] for r in streams):  # every stream has its first token
            if time.monotonic() > deadline or any(t.done() for t in tasks):
                raise RuntimeError("the streams did not start: is the server answering?")
            await asyncio.sleep(0.01)
        t0 = time.perf_counter()
        if probe is not None:
            pending.append(asyncio.ensure_future(timed_post(clients[-1], probe)))
        await asyncio.sleep(SMALL_AFTER_S)
        small_task = asyncio.ensure_future(timed_post(clients[-2], json.dumps(small).encode()))
        pending.append(small_task)
        left = window_s - (time.perf_counter() - t0)
        await asyncio.wait(pending, timeout=max(0.0, left))
        if probe is None:
            await asyncio.sleep(max(0.0, min(BASELINE_S, window_s) - (time.perf_counter() - t0)))
        end = time.perf_counter()
    finally:
        for t in tasks + pending:
            t.cancel()
        await asyncio.gather(*tasks, *pending, return_exceptions=True)
        for c in clients:
            await c.close()
    gaps = [
        b - a for r in streams for times in r for a, b in zip(times, times[1:]) if t0 < b <= end
    ]
    return {
        "probe": outcome(pending[0]) if probe is not None else None,
        "small": outcome(small_task),
        "gaps": gaps,
        "seconds": end - t0,
    }


def outcome(task: asyncio.Future) -> dict:
    """A timed_post's result; {"status": None} if the window closed first."""
    if task.cancelled():
        return {"status": None}
    error = task.exception()
    return task.result() if error is None else {"status": None, "message": type(error).__name__}


# ---------------------------------------------------------------------- the servers
def serve_env(tree: str | None = None) -> dict:
    # the server imports this very minicb (or the one in `tree`), wherever the current directory is
    here = tree or str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in [here, os.environ.get("PYTHONPATH")] if p)
    return {**os.environ, "PYTHONPATH": path}


def server_flags(mode: str, help_text: str) -> list[str]:
    """`serve`'s flags for "after" (none: its defaults) or "before": every `--max-*` flag of `serve
    --help` beyond KEPT, the bounds of issue 37 that this checkout has, out of reach."""
    bounds = sorted(set(re.findall(r"--max-[a-z0-9-]+", help_text)) - KEPT)
    return [] if mode == "after" else [x for f in bounds for x in (f, BEFORE.get(f, OUT_OF_REACH))]


def serve_help(tree: str | None) -> str:
    cmd = [sys.executable, "-m", "minicb", "serve", "--help"]
    return subprocess.run(cmd, capture_output=True, text=True, env=serve_env(tree), cwd=tree).stdout


def launch(flags: list[str], stack: ExitStack, tree: str | None) -> str:
    """`python -m minicb serve` on a free loopback port; its URL once /health answers. Closing
    `stack` stops it."""
    with socket.socket() as s:  # a free port: the server binds it a moment later
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "minicb", "serve", "--port", str(port), *flags]
    log = stack.enter_context(tempfile.TemporaryFile("w+"))
    # run in `tree` too: `python -m` puts the current directory first on the path
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=serve_env(tree), cwd=tree
    )
    stack.callback(stop, proc)
    return wait_until_healthy(proc, f"http://127.0.0.1:{port}", log)


async def is_idle(url: str) -> bool:
    """Nothing running or waiting, every KV block free, within IDLE_WAIT_S."""
    async with http_client(url, 1, timeout=5) as client:
        try:
            g = await server_state(client, IDLE_WAIT_S)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False
    return g["num_requests_running"] == g["num_requests_waiting"] == g["kv_blocks_used"] == 0


def run_mode(mode: str, names: list[str], args, vocab: int) -> dict:
    tree = args.before_tree if mode == "before" else None
    help_text = serve_help(tree)
    if "--max-decode-slowdown" not in help_text:
        print(f"note: the {mode} server has no --max-decode-slowdown", file=sys.stderr)
    flags = SERVE + server_flags(mode, help_text) + shlex.split(args.serve_args)
    rng = random.Random(os.urandom(8))  # fresh prompts: nothing cached from an earlier run
    builders = probe_bodies(args.scale, rng, vocab)
    command = "python -m minicb serve " + " ".join(flags) + (f" (from {tree})" if tree else "")
    result = {"mode": mode, "command": command, "rows": []}
    print(f"\n{mode}: {result['command']}", file=sys.stderr)
    with ExitStack() as server:
        url = launch(flags, server, tree)
        for name in [None, *names]:
            probe = None if name is None else json.dumps(builders[name](), separators=(",", ":"))
            print(f"  {name or 'alone'} ({len(probe or '') / 2**20:.1f} MiB)", file=sys.stderr)
            row = asyncio.run(trial(url, probe and probe.encode(), args.window_s))
            row["name"] = name or "the streams alone"
            row["restarted"] = not asyncio.run(is_idle(url))
            if row["restarted"]:  # its leftovers must not reach the next probe
                server.close()
                url = launch(flags, server, tree)
            result["rows"].append(row)
    return result


# ---------------------------------------------------------------------- the table
def answer(probe: dict | None, window_s: float) -> str:
    if probe is None:
        return "-"
    if probe["status"] is None:
        why = probe.get("message") or "cancelled"
        return f"unanswered at the window ({window_s:.0f} s): {why}"
    if probe["status"] == 200:
        return f"200 in {probe['s']:.1f} s ({probe['finish']})"
    message = " ".join(probe["message"].split())[:120].replace("|", "\\|")
    return f"{probe['status']}: {message}"


def gap_cell(gaps: list[float], alone: list[float]) -> str:
    if not gaps:
        return "no token"
    med = statistics.median(gaps)
    p90 = percentile(gaps, 90)
    cell = f"{med * 1e3:.0f} / {p90 * 1e3:.0f}"
    if alone:
        cell += f" (x{med / statistics.median(alone):.1f} / x{p90 / percentile(alone, 90):.1f})"
    return cell


def small_cell(small: dict, window_s: float) -> str:
    if small["status"] is None:
        return f"> {window_s:.0f} (window)"
    status = "" if small["status"] == 200 else f" ({small['status']})"
    return f"{small['s']:.2f}{status}"


def print_table(result: dict, window_s: float) -> None:
    rows = result["rows"]
    alone = rows[0]["gaps"]
    print(f"\n**{result['mode']}**: `{result['command']}`\n")
    print("| probe | probe's answer | others' gap median / p90 ms (x alone) | small request s |")
    print("|---|---|---:|---:|")
    for row in rows:
        restarted = " (server restarted after)" if row["restarted"] else ""
        cells = (
            row["name"] + restarted,
            answer(row["probe"], window_s),
            gap_cell(row["gaps"], alone),
            small_cell(row["small"], window_s),
        )
        print("| " + " | ".join(cells) + " |")


def vocab_size(model: str | None) -> int:
    from ..model_executor.loader import embedded_model_dir

    folder = Path(model) if model else embedded_model_dir()
    config = json.loads((folder / "config.json").read_text())
    # a multimodal checkpoint keeps its language model's in text_config
    return config["vocab_size"] if "vocab_size" in config else config["text_config"]["vocab_size"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m minicb.serve.collateral",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument("--before", action="store_const", const=["before"], dest="modes")
    which.add_argument("--after", action="store_const", const=["after"], dest="modes")
    which.add_argument("--both", action="store_const", const=["before", "after"], dest="modes")
    p.add_argument("--probes", default=",".join(PROBES), help=f"a subset of {','.join(PROBES)}")
    p.add_argument("--window-s", type=float, default=30.0, help="a probe's trial at most (30)")
    p.add_argument("--scale", type=float, default=1.0, help="of the probes' sizes (0.25: quick)")
    p.add_argument("--serve-args", default="", help="more flags for both servers, one string")
    p.add_argument(
        "--before-tree",
        default=None,
        help="run the before server from this checkout (e.g. a git worktree of the commit before "
        "issue 37), with the flags it has, instead of this one with its bounds raised",
    )
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    names = [n for n in args.probes.split(",") if n]
    unknown = sorted(set(names) - set(PROBES))
    if unknown or not 0 < args.scale <= 1 or args.window_s <= SMALL_AFTER_S:
        p.error(f"probes are {', '.join(PROBES)}; 0 < --scale <= 1; --window-s > {SMALL_AFTER_S}")
    from ..bench.machine import cpu_model

    model = next((a for a in shlex.split(args.serve_args) if a.startswith("/")), None)
    vocab = vocab_size(model)
    t0 = time.monotonic()
    results = [run_mode(mode, names, args, vocab) for mode in args.modes or ["before", "after"]]
    took = (time.monotonic() - t0) / 60
    print(f"\n{cpu_model()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}: {took:.1f} min")
    print(
        "python -m minicb.serve.collateral " + " ".join(argv if argv is not None else sys.argv[1:])
    )
    for result in results:
        print_table(result, args.window_s)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_model(), "args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
