"""The load generator's parts, shared by the load test (loadtest.py) and the soak (soak.py): a
server started as a user starts it (`python -m minicb serve`, a process of its own, on a free
loopback port), a client that streams one completion and times each token as it arrives, and the
server's state read from GET /metrics once the load has passed."""

import argparse
import asyncio
import ipaddress
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from urllib.parse import urlparse

import aiohttp
import httpx

from .metrics import parse_metrics

CANCELLED = "cancelled at the time limit"
# read from /metrics once the load has passed
GAUGES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "minicb:kv_blocks_used",
    "minicb:kv_blocks_free",
    "minicb:kv_blocks_total",
)
# the embedded model's first load converts its GGUF file (~20 s); a busy machine is slower
STARTUP_TIMEOUT_S = 600
SERVER_PIDS: dict[str, int] = {}  # url -> pid of each server start_server started


def cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system) a live process has used, from /proc (Linux); None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after "pid (name)": state is field 3
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def server_cpu(url: str) -> dict[str, float] | None:
    """CPU seconds so far of a server this process started: its own process (the API server, and
    the engine too with --engine-in-process) and its descendants (the engine core's process)."""
    pid = SERVER_PIDS.get(url)
    own = None if pid is None else cpu_seconds(pid)
    if own is None:
        return None
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:  # it exited meanwhile
                pass
    tree, found = {pid}, True
    while found:
        found = {p for p, parent in parents.items() if parent in tree and p not in tree}
        tree |= found
    children = sum(cpu_seconds(p) or 0.0 for p in tree - {pid})
    return {"server": own, "children": children}


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(
            f"the load test only targets loopback servers (127.0.0.1, ::1, localhost), not {host!r}"
        )


def http_client(url: str, max_connections: int, timeout: float) -> aiohttp.ClientSession:
    """The load generator's HTTP client: aiohttp, as vLLM's `vllm bench serve` uses. On a machine
    of 2 cores the clients share the CPU with the server they measure: httpx took 0.19 ms of CPU
    to read each streamed token here (its pure-Python HTTP and line parsing), aiohttp 0.05 ms
    (llhttp in C), and the server's tokens/s rose by 13% with the lighter client (serve/README.md).
    `timeout` bounds connecting and each read, not a whole stream. aiohttp sets TCP_NODELAY.
    Each request opens a connection of its own (force_close): a kept-alive one that the server
    closed meanwhile (uvicorn's timeout_keep_alive, 5 s, passes while the offline twin runs) fails
    aiohttp's next write with "Can not write request body"."""
    return aiohttp.ClientSession(
        base_url=url,
        connector=aiohttp.TCPConnector(limit=max_connections, force_close=True),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout),
    )


async def one_request(
    client: aiohttp.ClientSession, body: dict, leave_after: int | None = None
) -> dict:
    """Stream one completion; return its token ids, client-side timings (seconds), finish reason
    and, if the body asks for it (stream_options.include_usage), the server's count of its tokens.
    With `leave_after`, walk away once that many tokens came: the connection is closed with the
    stream unread, which the server must notice (it aborts the request and frees its blocks)."""
    t0 = time.perf_counter()
    times, ids, finish, usage = [], [], None, None
    async with client.post("/v1/completions", json=body) as r:
        if r.status != 200:
            return {
                "status": r.status,
                "retry_after": r.headers.get("retry-after"),
                "error": f"HTTP {r.status}: {(await r.read()).decode()[:200]}",
            }
        async for line in r.content:  # one line at a time, b"\n" included
            if not line.startswith(b"data: {"):  # the blank lines, "data: [DONE]"
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"status": 200, "error": chunk["error"]["message"]}
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:  # none in the usage chunk
                finish = choice["finish_reason"] or finish
                if choice["token_ids"]:
                    ids += choice["token_ids"]
                    times.append(time.perf_counter())
            if leave_after is not None and len(ids) >= leave_after:
                r.close()  # the connection, not back to the pool
                return {"status": 200, "abandoned": True, "token_ids": ids}
    n = len(ids)
    return {
        "status": 200,
        "token_ids": ids,
        "finish_reason": finish,
        "usage": usage,
        "ttft": times[0] - t0 if times else None,
        "tpot": (times[-1] - times[0]) / (n - 1) if n > 1 else None,
        "end": time.perf_counter(),
    }


async def server_state(client, timeout: float = 30.0) -> dict:
    """The /metrics gauges once the server is idle (running = waiting = 0), or after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        async with client.get("/metrics") as r:
            m = parse_metrics(await r.text())
        # summed over a data-parallel server's replicas (its series carry an engine label)
        gauges = {
            name.split(":")[1]: sum(v for k, v in m.items() if k.split("{")[0] == name)
            for name in GAUGES
        }
        idle = gauges["num_requests_running"] == gauges["num_requests_waiting"] == 0
        if (idle and gauges["kv_blocks_used"] == 0) or time.monotonic() > deadline:
            return gauges
        await asyncio.sleep(0.05)


# ---------------------------------------------------------------------- a server of its own
def serve_command(
    args, model: str | None, port: int, max_waiting: int, in_process: bool
) -> list[str]:
    """`python -m minicb serve` with the engine flags parsed into `args` (those not at their
    default)."""
    from .cli import add_engine_arguments

    defaults = argparse.ArgumentParser()
    add_engine_arguments(defaults)
    cmd = [
        sys.executable,
        "-m",
        "minicb",
        "serve",
        "--port",
        str(port),
        "--max-waiting",
        str(max_waiting),
    ]
    for name, default in vars(defaults.parse_args([])).items():
        value = model if name == "model" else getattr(args, name)
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool) and value != default:
            cmd.append(flag if value else f"--no-{flag[2:]}")
        elif value != default:  # a dict flag (--speculative-config, --step-cost) as JSON
            cmd += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    if getattr(args, "core_threads", None) is not None and not in_process:
        cmd += ["--core-threads", str(args.core_threads)]
    if getattr(args, "stream_interval", 1) != 1:
        cmd += ["--stream-interval", str(args.stream_interval)]
    if getattr(args, "data_parallel_size", 1) > 1:
        cmd += ["--data-parallel-size", str(args.data_parallel_size)]
        cmd += ["--routing-policy", args.routing_policy]
    return cmd + (["--engine-in-process"] if in_process else [])


def start_server(
    args, model: str | None, in_process: bool, max_waiting: int, stack: ExitStack
) -> str:
    """Start `python -m minicb serve` on a free loopback port; return its URL once /health answers.
    `stack` stops it (SIGTERM: uvicorn shuts down, which stops the engine core) when it closes."""
    with socket.socket() as s:  # a free port: the server binds it a moment later
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = serve_command(args, model, port, max_waiting, in_process)
    print("starting:", " ".join(cmd[1:]), file=sys.stderr)
    # uvicorn's access log: one line per request
    log = stack.enter_context(tempfile.TemporaryFile("w+"))
    # The server imports this very minicb, wherever the current directory is and whatever is
    # installed.
    here = str(Path(__file__).resolve().parents[2])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in [here, os.environ.get("PYTHONPATH")] if p),
    }
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    stack.callback(stop, proc)
    url = wait_until_healthy(proc, f"http://127.0.0.1:{port}", log)
    SERVER_PIDS[url] = proc.pid
    return url


def wait_until_healthy(proc: subprocess.Popen, url: str, log) -> str:
    """`url` once the server `proc` answers /health; RuntimeError with the tail of its `log` if
    it exits first or takes longer than STARTUP_TIMEOUT_S."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            log.seek(0)
            raise RuntimeError(
                f"the server did not start (exit code {proc.poll()}):\n{log.read()[-3000:]}"
            )
        time.sleep(0.2)


def stop(proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
