"""GPU benchmarks: workload W2 against transformers, decode step latency per graph, decode attention
alone.

run_w2: the nano-vllm / vLLM offline workload (defined in minicb/bench/__init__.py): 256 requests,
prompt and output lengths uniform in 100..1024, random token ids, EOS ignored, Qwen3-0.6B;
throughput counts output tokens only. No hub is needed: `--model random:qwen3-0.6b` builds the model
from its config with random weights (throughput does not depend on the weights' values).

    python -m minicb.bench.w2 --workload w2 --model random:qwen3-0.6b    # the table of the README
    python -m minicb.bench.w2 --workload latency                         # one decode step per graph
    python -m minicb.bench.w2 --workload attention                       # one layer's decode
    attention

`--workload w2` runs every competitor on a fresh engine, one after the other in one process: minicb
with its defaults (which size the KV cache from the GPU), then each variant with exactly the blocks
the defaults got (the engine before is deleted and its memory returned first), then transformers'
continuous batching on the same prompts. All need a CUDA GPU and raise RuntimeError without one.
Quote ratios, with the GPU's name: an absolute tokens/s figure holds only for the machine it was
taken on.
"""

import argparse
import json
import random
import statistics
import time

import torch

from ..engine.llm import LLM
from ..sampling_params import SamplingParams
from .gpu import W2_MODEL, _decode_batch, _load, free_gpu, random_model, require_cuda


def w2_workload(
    vocab_size: int, num_requests: int = 256, min_len: int = 100, max_len: int = 1024, seed: int = 0
) -> tuple[list[list[int]], list[int]]:
    """(prompts as token ids, output lengths): lengths uniform in min_len..max_len, random ids."""
    rng = random.Random(seed)
    prompts, output_lens = [], []
    for _ in range(num_requests):
        prompt_len, output_len = rng.randint(min_len, max_len), rng.randint(min_len, max_len)
        prompts.append([rng.randrange(vocab_size) for _ in range(prompt_len)])
        output_lens.append(output_len)
    return prompts, output_lens


def run_w2(
    model_path: str | None = None,
    *,
    num_requests: int = 256,
    min_len: int = 100,
    max_len: int = 1024,
    seed: int = 0,
    dtype: str = "bfloat16",
    loaded=None,
    **config,
) -> dict:
    """Workload W2 on CUDA on a fresh engine; `config` goes to LLM (nothing: minicb's defaults).
    Returns throughput in output tokens/s and what ran how."""
    require_cuda("run_w2")
    loaded = _load(model_path, loaded, dtype)
    prompts, output_lens = w2_workload(loaded.vocab_size, num_requests, min_len, max_len, seed)
    free_gpu()
    t0 = time.perf_counter()
    llm = LLM.from_loaded(loaded, device="cuda", dtype=dtype, **config)
    build_seconds = time.perf_counter() - t0
    engine, graph_runner = llm.engine, llm.engine.runner.graph_runner
    # Warm-up outside the timing: CUDA context, cuBLAS handles, the first prefill kernels.
    warmup = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm.generate([prompts[0][:min_len]], warmup, use_tqdm=False)
    torch.cuda.synchronize()
    first_step = engine.scheduler.step_count
    first_replay = graph_runner.num_replays if graph_runner is not None else 0

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in output_lens]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0

    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    c = engine.config
    result = {
        "workload": "W2",
        "model": loaded.name,
        "device": torch.cuda.get_device_name(),
        "dtype": dtype,
        "config": {k: v for k, v in config.items() if k != "num_blocks"},
        "num_requests": num_requests,
        "prompt_tokens": sum(map(len, prompts)),
        "output_tokens": output_tokens,
        "seconds": seconds,
        "output_tokens_per_s": output_tokens / seconds,
        "steps": engine.scheduler.step_count - first_step,
        "graph_steps": graph_runner.num_replays - first_replay if graph_runner is not None else 0,
        "num_graphs": len(graph_runner.graphs) if graph_runner is not None else 0,
        "capture_seconds": graph_runner.capture_seconds if graph_runner is not None else None,
        "build_seconds": build_seconds,
        "num_blocks": c.num_blocks,
        "block_size": c.block_size,
        "max_num_seqs": c.max_num_seqs,
        "max_num_batched_tokens": c.max_num_batched_tokens,
        "attention_backend": engine.runner.attention_backend,
        "memory": str(engine.memory) if engine.memory is not None else None,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }
    engine.shutdown()
    del llm, engine, graph_runner
    free_gpu()
    return result


def run_hf_continuous_w2(
    model_path: str | None = None,
    *,
    num_requests: int = 256,
    min_len: int = 100,
    max_len: int = 1024,
    seed: int = 0,
    dtype: str = "bfloat16",
) -> dict:
    """transformers' own continuous batching (init_continuous_batching, paged attention) on the same
    W2."""
    from .w1 import run_hf_continuous

    require_cuda("run_hf_continuous_w2")
    free_gpu()
    name = model_path or W2_MODEL
    if name.startswith("random:"):
        model = random_model(name, getattr(torch, dtype), hf_model=True)
    else:
        import transformers

        model = (
            transformers.AutoModelForCausalLM.from_pretrained(name, dtype=getattr(torch, dtype))
            .cuda()
            .eval()
        )
    prompts, output_lens = w2_workload(
        model.config.vocab_size, num_requests, min_len, max_len, seed
    )
    r = run_hf_continuous(model, prompts, output_lens)
    del model
    free_gpu()
    return {
        "system": "transformers continuous batching",
        "output_tokens": sum(output_lens),
        "seconds": r["wall_s"],
        "output_tokens_per_s": sum(output_lens) / r["wall_s"],
    }


def _time_ms(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()  # ends with the sampled tokens on the host: the step is complete
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def decode_latency_by_bucket(
    model_path: str | None = None,
    *,
    dtype: str = "bfloat16",
    context_len: int = 512,
    max_model_len: int | None = None,
    max_batch_size: int = 256,
    buckets: list[int] | None = None,
    iters: int = 20,
    block_size: int | None = None,
    loaded=None,
    **config,
) -> list[dict]:
    """Median decode-step latency, eager vs CUDA graph, for each batch bucket (every row at
    context_len).

    max_model_len None: the model's own (40,960 for Qwen3), as a user's defaults would have it; the
    graph replayed is the narrowest that holds context_len, so its width follows the context.
    """
    from ..config import EngineConfig
    from ..worker.cuda_graph import DecodeGraphRunner

    require_cuda("decode_latency_by_bucket")
    loaded = _load(model_path, loaded, dtype)
    bs = EngineConfig(device="cuda", block_size=block_size).block_size  # None: the CUDA default
    # each row its own blocks
    llm = LLM.from_loaded(
        loaded,
        device="cuda",
        dtype=dtype,
        use_cuda_graph=False,
        block_size=bs,
        max_num_seqs=max_batch_size,
        max_model_len=max_model_len,
        record_trace=False,
        num_blocks=max_batch_size * -(-context_len // bs),
        **config,
    )
    runner = llm.engine.runner
    graph_runner = DecodeGraphRunner(runner)
    results = []
    for b in buckets or graph_runner.buckets:
        out = _decode_batch(b, context_len, bs, loaded.vocab_size)
        runner.graph_runner = None
        eager_ms = _time_ms(lambda: runner.execute(out), iters)
        runner.graph_runner = graph_runner
        graph_ms = _time_ms(lambda: runner.execute(out), iters)
        if runner.last_graph_bucket is None:
            raise RuntimeError(
                f"batch size {b} did not run through a graph (buckets: {graph_runner.buckets})"
            )
        results.append(
            {
                "batch_size": b,
                "bucket": runner.last_graph_bucket,
                "width": runner.last_graph_width,
                "context_len": context_len,
                "block_size": bs,
                "backend": runner.attention_backend,
                "eager_ms": eager_ms,
                "graph_ms": graph_ms,
                "speedup": eager_ms / graph_ms,
            }
        )
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m minicb.bench.w2",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--workload",
        choices=("w2", "latency", "attention", "profile", "idle", "tier"),
        default="w2",
    )
    parser.add_argument(
        "--model",
        default=W2_MODEL,
        help=f"random:NAME, a local dir or a hub id (default {W2_MODEL})",
    )
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--competitors",
        nargs="+",
        default=["defaults", "eager", "gather", "tuned", "hf"],
        help="W2: defaults (LLM with nothing set), eager (no graphs), gather (the padded decode), "
        "tuned (max_num_seqs 512, 16384 tokens a step), async (async_scheduling), block512, "
        "block128, "
        "hf (transformers' continuous batching)",
    )
    parser.add_argument(
        "--json", default=None, help="append every result as a JSON line to this file"
    )
    parser.add_argument(
        "--host-profile", default=None, help="idle: write a cProfile of the host's side here"
    )
    args = parser.parse_args(argv)
    require_cuda("python -m minicb.bench.w2")

    def emit(row):
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")

    from .gpu_step import attention_benchmark, device_idle, profile_decode_step, tier_overlap

    if args.workload == "attention":
        for row in attention_benchmark():
            emit(row)
        return
    loaded = _load(args.model, None, args.dtype)
    if args.workload == "profile":
        for backend in ("gather", "flash_pages"):
            emit(profile_decode_step(loaded=loaded, dtype=args.dtype, attention_backend=backend))
        return
    if args.workload == "idle":  # issue 32: under 5% of the step with async scheduling
        # sync, async launched on the engine's thread, on the device thread, inline twice more
        runs = (
            (False, "inline"),
            (True, "inline"),
            (True, "thread"),
            (True, "inline"),
            (True, "inline"),
        )
        for i, (async_scheduling, launch) in enumerate(runs):
            # the last run also writes a cProfile of the host's side, where --host-profile says
            last = args.host_profile if i == len(runs) - 1 else None
            row = device_idle(
                loaded=loaded,
                dtype=args.dtype,
                async_scheduling=async_scheduling,
                launch=launch,
                host_profile=last,
            )
            emit(row)
        return
    if args.workload == "tier":  # issue 39: the CPU tier's copies on their own stream
        for row in tier_overlap(loaded=loaded, dtype=args.dtype):
            emit(row)
        return
    if args.workload == "latency":
        for row in decode_latency_by_bucket(dtype=args.dtype, loaded=loaded):
            emit(row)
            print(
                f"batch {row['batch_size']:4d} -> graph ({row['bucket']}, {row['width']}): eager "
                f"{row['eager_ms']:7.2f} ms  graph {row['graph_ms']:7.2f} ms  "
                f"x{row['speedup']:.2f}",
                flush=True,
            )
        return
    variants = {
        "defaults": {},
        "eager": {"use_cuda_graph": False},
        "gather": {"attention_backend": "gather"},
        "tuned": {"max_num_seqs": 512, "max_num_batched_tokens": 16384},
        "async": {"async_scheduling": True},
        "block512": {"block_size": 512},
        "block128": {"block_size": 128},
    }
    from ..config import EngineConfig

    rows, cache_tokens = {}, None
    for name in args.competitors:
        if name == "hf":
            rows[name] = run_hf_continuous_w2(
                args.model, num_requests=args.num_requests, dtype=args.dtype
            )
        # the first sizes its cache from the GPU; every later one gets exactly as many tokens of
        # cache
        else:
            bs = EngineConfig(device="cuda", **variants[name]).block_size
            extra = {} if cache_tokens is None else {"num_blocks": cache_tokens // bs}
            rows[name] = run_w2(
                num_requests=args.num_requests,
                dtype=args.dtype,
                loaded=loaded,
                **variants[name],
                **extra,
            )
            cache_tokens = cache_tokens or rows[name]["num_blocks"] * bs
        emit({"competitor": name, **rows[name]})
    device = torch.cuda.get_device_name()
    print(f"\nW2 on {device}, {args.model}, {args.dtype}, {args.num_requests} requests:")
    for name, r in rows.items():
        ratio = {
            k: r["output_tokens_per_s"] / v["output_tokens_per_s"]
            for k, v in rows.items()
            if k != name
        }
        print(
            f"  {name:9s} {r['output_tokens_per_s']:8.0f} output tok/s  {r['seconds']:7.1f} s  "
            + "  ".join(f"x{v:.2f} vs {k}" for k, v in ratio.items())
        )


if __name__ == "__main__":
    main()
