"""Running the server: `python -m minicb serve` (its options), and ServerThread for tests and
notebooks."""

import argparse
import ipaddress
import json
import os
import resource
import sys
import threading
import time
from dataclasses import fields

import uvicorn

from ..engine.router import DEFAULT_BALANCE_THRESHOLD, ROUTING_POLICIES
from .app import build_app
from .auth import ENV_VAR, api_keys_from
from .connections import ConnectionLimits
from .engine_loop import AsyncEngine
from .limits import RequestLimits
from .validation import DEFAULT_MAX_REQUEST_BYTES


class ServerThread:
    """uvicorn in a background thread on a free loopback port: `with ServerThread(app) as url:
    ...`."""

    def __init__(
        self,
        app,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
        connections: ConnectionLimits | None = None,
    ):
        # Let uvicorn bind (port 0: any free port). A socket made by socket.create_server has proto
        # 0, and asyncio then skips TCP_NODELAY: every response would wait ~40 ms for a delayed ACK.
        self.host = host
        config = (connections or ConnectionLimits()).uvicorn_config(
            app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=2
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="minicb-uvicorn", daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://{self.host}:{port}"

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(15)


def add_engine_arguments(parser, max_num_seqs: int = 32, max_decode_slowdown: float = 2.0) -> None:
    """The engine's knobs (EngineConfig fields, vLLM's flag names), shared by `serve` and the load
    test. `max_decode_slowdown`: its default (serve's is 2.0; 0 is off, the engine's own
    default)."""
    from ..config import (
        BATCHING_MODES,
        DTYPES,
        KV_CACHE_DTYPES,
        PREEMPTION_MODES,
        SCHEDULING_POLICIES,
    )

    parser.add_argument(
        "--model",
        default=None,
        help="model dir or hub id (default: embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPES,
        help="auto: bfloat16 where this CPU multiplies it natively and it is faster (timed once)",
    )
    parser.add_argument(
        "--quantization",
        default=None,
        choices=["int8"],
        help="int8: weight-only int8, a scale per output channel (CPU)",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=max_num_seqs,
        help="requests running at once (batch slots)",
    )
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=256, help="token budget of one step"
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV blocks (default: from --kv-cache-memory-bytes)",
    )
    parser.add_argument(
        "--kv-cache-memory-bytes", type=int, default=None, help="KV cache budget (default 512 MiB)"
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="what the KV cache stores: auto (the model's dtype) or fp8 (twice bfloat16's blocks)",
    )
    parser.add_argument(
        "--calculate-kv-scales",
        action="store_true",
        help="fp8: scales from the first forward's amax",
    )
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="split every layer over N processes"
    )
    parser.add_argument(
        "--kv-offloading-size",
        type=float,
        default=None,
        help="GiB of host memory that keep the prefix-cache blocks the device evicts (a CPU tier)",
    )
    parser.add_argument(
        "--kv-offloading-backend",
        default=None,
        choices=["native"],
        help="the CPU tier's backend (vLLM's names; minicb has native)",
    )
    parser.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="a mixture of experts: whole experts on each of those processes, tokens sent to them",
    )
    parser.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=SCHEDULING_POLICIES,
        help="fcfs, priority (a request's lowest 'priority' value first), sjf, or vtc (fair "
        "between tenants named by the body's 'user' field: the Virtual Token Counter of Sheng et "
        "al., OSDI 2024)",
    )
    parser.add_argument(
        "--max-decode-slowdown",
        type=float,
        default=max_decode_slowdown,
        metavar="FLOAT",
        help="a step that carries prefill work may take at most this many times the estimated "
        "time of its decodes alone, so a long prompt is spread over steps instead of stalling "
        f"every stream (0: off, a token budget only; default {max_decode_slowdown})",
    )
    parser.add_argument(
        "--step-cost",
        type=json.loads,
        default=None,
        metavar="JSON",
        help="the time model --max-decode-slowdown uses, StepCost's fields in seconds: "
        '\'{"step_s": 0.02, "token_s": 1e-4, "context_token_s": 1e-8, "logits_row_s": 1e-4, '
        '"position_s": 1e-6}\' (position_s may be left out: 0; default: measured when the engine '
        "starts)",
    )
    parser.add_argument("--batching", default="continuous", choices=BATCHING_MODES)
    parser.add_argument("--preemption-mode", default="recompute", choices=PREEMPTION_MODES)
    parser.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
    )
    parser.add_argument("--use-cuda-graph", default="auto", choices=["auto", "true", "false"])
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="vLLM V1's switch: schedule the next step while this one runs, feed it this step's "
        "tokens, process outputs one step behind (engine/batch_queue.py; not with drafts)",
    )
    parser.add_argument(
        "--speculative-config",
        type=json.loads,
        default=None,
        metavar="JSON",
        help='vLLM\'s dict, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 3}\'',
    )


def engine_config(args, model: str | None = None):
    """The EngineConfig that add_engine_arguments' flags describe (`model` overrides --model)."""
    from ..config import EngineConfig

    graphs = {"auto": "auto", "true": True, "false": False}[args.use_cuda_graph]
    return EngineConfig(
        model=model or args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        kv_cache_dtype=args.kv_cache_dtype,
        calculate_kv_scales=args.calculate_kv_scales,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        kv_offloading_size=args.kv_offloading_size,
        kv_offloading_backend=args.kv_offloading_backend,
        max_model_len=args.max_model_len,
        scheduling_policy=args.scheduling_policy,
        batching=args.batching,
        preemption_mode=args.preemption_mode,
        enable_prefix_caching=args.enable_prefix_caching,
        use_cuda_graph=graphs,
        speculative_config=args.speculative_config,
        async_scheduling=args.async_scheduling,
        max_decode_slowdown=args.max_decode_slowdown or None,  # 0: off
        step_cost=args.step_cost,
    )


def add_arguments(parser) -> None:
    """Options of `python -m minicb serve`."""
    add_engine_arguments(parser)
    parser.add_argument(
        "--served-model-name", default=None, help="name in /v1/models (default: the model's)"
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="interface to listen on (default: loopback only)"
    )
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        nargs="+",
        default=None,
        metavar="KEY",
        help="every route but /health, /metrics and the docs requires 'Authorization: Bearer KEY' "
        "(401 otherwise); with several keys, any one of them (vLLM's flag). Without the flag, "
        f"the environment variable {ENV_VAR} gives the key; prefer it on a shared machine, where "
        "every user can read a command line (ps)",
    )
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=64,
        help="requests held beyond max_num_seqs before new ones get 503 (default 64)",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help=(
            "larger request bodies get 413 before they are read "
            f"(default {DEFAULT_MAX_REQUEST_BYTES})"
        ),
    )
    parser.add_argument(
        "--trace-steps", type=int, default=1000, help="engine steps kept in the trace"
    )
    parser.add_argument(
        "--engine-in-process",
        action="store_true",
        help="run the engine in the server's process (a thread) instead of an engine-core process",
    )
    parser.add_argument(
        "--core-threads",
        type=int,
        default=None,
        help="torch threads of the engine-core process (default: one per CPU core); on a small "
        "CPU, one fewer leaves a core to the API process (HTTP, detokenization)",
    )
    fleet = parser.add_argument_group("data parallelism: replicas behind this one server")
    fleet.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="N engine cores, each a whole replica with its own scheduler, KV cache and metrics "
        "(vLLM's flag); on a CPU they share its cores (--core-threads each; by default an equal "
        "share)",
    )
    fleet.add_argument(
        "--routing-policy",
        choices=ROUTING_POLICIES,
        default="least_loaded",
        help="which replica takes a request: round_robin, least_loaded (vLLM's: fewest waiting "
        "x 4 + running) or cache_aware (the longest expected prefix-cache hit, SGLang's router's "
        "idea) (default least_loaded)",
    )
    fleet.add_argument(
        "--balance-threshold",
        type=int,
        default=DEFAULT_BALANCE_THRESHOLD,
        help="cache_aware: a load gap (in least_loaded's score) past which a request goes to the "
        f"least loaded replica whatever its prefix (default {DEFAULT_BALANCE_THRESHOLD})",
    )
    parser.add_argument(
        "--request-log",
        default=None,
        metavar="FILE",
        help="append one JSON line per finished request: the server's own times (received, "
        "engine arrival, first token, finish) and token counts, to set beside a client's",
    )
    parser.add_argument(
        "--stream-stall-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="a stream whose client reads nothing for this long is aborted, freeing its slots "
        "(default 60)",
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        metavar="N",
        help="vLLM's: a streamed chunk carries N new tokens (the first and the last are sent at "
        "once). 1 (default): every token as it comes; more: fewer chunks to frame and send, "
        "which on a CPU server gives the API process's cores back to the engine",
    )
    bounds = parser.add_argument_group(
        "what one request may ask (a 400 naming the field and the flag beyond it; limits.py)"
    )
    defaults = RequestLimits()
    for f in fields(RequestLimits):
        default = getattr(defaults, f.name)
        said = "" if default is None else f" (default {default})"  # None: the help says what
        bounds.add_argument(
            "--" + f.name.replace("_", "-"),
            type=int,
            default=default,
            help=REQUEST_LIMITS[f.name] + said,
        )
    held = parser.add_argument_group("what connections may hold (connections.py)")
    defaults = ConnectionLimits()
    for f in fields(ConnectionLimits):
        default = getattr(defaults, f.name)
        held.add_argument(
            "--" + f.name.replace("_", "-"),
            type=type(default),
            default=default,
            help=f"{CONNECTION_LIMITS[f.name]} (default {default})",
        )


# The flags' help; limits.py and connections.py give each default its reason.
REQUEST_LIMITS = {
    "max_stop_strings": "stop strings in one request",
    "max_stop_string_chars": "characters in one stop string",
    "max_stop_token_ids": "stop_token_ids in one request",
    "max_logit_bias": "logit_bias entries in one request",
    "max_logprobs": "alternatives per token: logprobs, top_logprobs, prompt_logprobs (vLLM's)",
    "max_seats_per_request": "n x prompts: slots one request may hold (default: three quarters "
    "of --max-num-seqs, at least 1)",
    "max_tokens_per_request": "n x prompts x max_tokens of one request (default: 4 x "
    "max_model_len)",
}
CONNECTION_LIMITS = {
    "limit_concurrency": "connections open at once; one more closes the longest idle one, or "
    "is answered 503 if every one has a request in flight",
    "timeout_keep_alive": "seconds an idle keep-alive connection stays open",
    "timeout_request": "seconds a connection has to send a whole request, head and body",
    "backlog": "connections the kernel queues before the server accepts them",
}


def raise_file_limit(connections: ConnectionLimits) -> None:
    """Let this process open the file descriptors `connections` may need (ulimit -n), or exit
    saying why: a server out of descriptors refuses everyone, and asyncio logs every accept that
    fails (the log grew 180 MB in 30 s)."""
    needed = connections.file_descriptors
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise SystemExit(
            f"--limit-concurrency {connections.limit_concurrency} and --backlog "
            f"{connections.backlog} need about {needed} file descriptors, but this process may "
            f"open at most {hard} (ulimit -Hn): lower them, or raise the limit"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def is_loopback(host: str) -> bool:
    """Whether `host` (--host) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def make_engines(args) -> list:
    """One engine per data-parallel replica: Engines in this process with --engine-in-process,
    else RemoteEngines, each with a core process of its own."""
    n = args.data_parallel_size
    if n < 1:
        raise SystemExit(f"--data-parallel-size must be at least 1, got {n}")
    if args.stream_interval < 1:  # before a model is loaded
        raise SystemExit(f"--stream-interval must be at least 1, got {args.stream_interval}")
    if args.engine_in_process and args.core_threads is not None:
        raise SystemExit(
            "--core-threads sets the threads of the engine-core process; with --engine-in-process "
            "there is none (torch uses one thread per core in the server's process)"
        )
    if n > 1 and args.device.startswith("cuda"):
        import torch

        if torch.cuda.device_count() < n:
            raise SystemExit(
                f"--data-parallel-size {n} needs a GPU per replica, found "
                f"{torch.cuda.device_count()}"
            )
    configs = [engine_config(args) for _ in range(n)]
    if n > 1 and args.device.startswith("cuda"):
        for i, c in enumerate(configs):  # replica i on GPU i
            c.device = f"cuda:{i}"
    if args.engine_in_process:
        from ..engine.llm_engine import Engine

        return [Engine(c) for c in configs]
    from .engine_core import RemoteEngine

    threads = args.core_threads
    if threads is not None and threads < 1:
        raise SystemExit(f"--core-threads must be at least 1, got {threads}")
    if threads is None and n > 1:  # replicas on one CPU share its cores
        threads = max(1, (os.cpu_count() or 1) // n)
    return [RemoteEngine(c, core_threads=threads, trace_steps=args.trace_steps) for c in configs]


def main(args) -> None:
    try:
        api_keys = api_keys_from(args.api_key)
    except ValueError as e:
        raise SystemExit(f"minicb: {e}") from None
    engines = make_engines(args)
    engine = engines[0]
    request_limits = RequestLimits(**{f.name: getattr(args, f.name) for f in fields(RequestLimits)})
    connections = ConnectionLimits(
        **{f.name: getattr(args, f.name) for f in fields(ConnectionLimits)}
    )
    raise_file_limit(connections)

    def on_fatal(message: str) -> None:  # from the engine loop's thread, once
        print(f"minicb: the engine can serve no more ({message}); exiting", flush=True)
        server.should_exit = True  # uvicorn's main loop checks it ten times a second

    kwargs = dict(
        max_waiting=args.max_waiting,
        trace_steps=args.trace_steps,
        request_log=args.request_log,
        served_model_name=args.served_model_name,
        stall_timeout_s=args.stream_stall_timeout,
        stream_interval=args.stream_interval,
        on_fatal=on_fatal,
    )
    if len(engines) > 1:
        from .data_parallel import DataParallelEngine

        async_engine = DataParallelEngine(
            engines, args.routing_policy, args.balance_threshold, **kwargs
        )
    else:
        async_engine = AsyncEngine(engine, **kwargs)
    app = build_app(
        async_engine,
        args.served_model_name,
        args.max_request_bytes,
        request_limits,
        api_key=api_keys,
    )
    server = uvicorn.Server(
        connections.uvicorn_config(
            app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=5
        )
    )
    c = engine.config
    where = (
        "in this process"
        if args.engine_in_process
        else f"in its own process, {engine.core_threads} torch threads"
    )
    if len(engines) > 1:
        where = f"{where}; {len(engines)} replicas, routed {args.routing_policy}"
    # never the key itself: a banner ends up in terminals, logs and screenshots
    access = "an API key required" if api_keys else "no API key"
    print(
        f"minicb: serving {args.served_model_name or engine.model_name} on "
        f"http://{args.host}:{args.port}/v1 ({c.num_blocks} KV blocks of {c.block_size}, "
        f"{c.max_num_seqs} slots, {c.scheduling_policy}, max_waiting={args.max_waiting}, engine "
        f"core {where}, {access})",
        flush=True,
    )
    if not api_keys and not is_loopback(args.host):
        print(
            f"minicb: warning: listening on {args.host} without an API key: anyone who can reach "
            f"port {args.port} may use the model; set {ENV_VAR} (or pass --api-key) to require a "
            "key",
            file=sys.stderr,
            flush=True,
        )
    server.run()
    if async_engine.fatal_error is not None:  # a non-zero exit status: a supervisor restarts it
        raise SystemExit(f"minicb: exited because the engine died: {async_engine.fatal_error}")
