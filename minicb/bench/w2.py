"""GPU benchmarks: workload W2 against transformers, decode step latency per graph, decode attention alone.

run_w2: the nano-vllm / vLLM offline workload (defined in minicb/bench/__init__.py): 256 requests,
prompt and output lengths uniform in 100..1024, random token ids, EOS ignored, Qwen3-0.6B; throughput
counts output tokens only. No hub is needed: `--model random:qwen3-0.6b` builds the model from its
config with random weights (throughput does not depend on the weights' values).

    python -m minicb.bench.w2 --workload w2 --model random:qwen3-0.6b    # the table of the README
    python -m minicb.bench.w2 --workload latency                         # one decode step per graph
    python -m minicb.bench.w2 --workload attention                       # one layer's decode attention

`--workload w2` runs every competitor on a fresh engine, one after the other in one process: minicb
with its defaults (which size the KV cache from the GPU), then each variant with exactly the blocks the
defaults got (the engine before is deleted and its memory returned first), then transformers'
continuous batching on the same prompts. All need a CUDA GPU and raise RuntimeError without one.
Quote ratios, with the GPU's name: an absolute tokens/s figure holds only for the machine it was taken on.
"""

import argparse
import gc
import json
import random
import statistics
import time

import torch

from ..llm import LLM
from ..loader import LoadedModel, load_model
from ..request import Request
from ..sampling_params import SamplingParams
from ..scheduler import ScheduledRequest, SchedulerOutput

W2_MODEL = "random:qwen3-0.6b"
# Named configs for random-weight models (the field values of the published config.json files).
RANDOM_CONFIGS = {
    "qwen3-0.6b": ("Qwen3Config", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                       head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
                                       rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643,
                                       eos_token_id=151645)),
}


def require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(f"{what} needs a CUDA GPU, and torch.cuda.is_available() is False "
                           f"(torch {torch.__version__}); run it on a machine with an NVIDIA GPU")


def random_model(name: str, dtype: torch.dtype, hf_model: bool = False):
    """A LoadedModel of a named config with random weights (or the transformers model itself)."""
    import transformers

    key = name.removeprefix("random:")
    if key not in RANDOM_CONFIGS:
        raise ValueError(f"unknown random model {name!r}; known: {', '.join('random:' + k for k in RANDOM_CONFIGS)}")
    class_name, fields = RANDOM_CONFIGS[key]
    config = getattr(transformers, class_name)(**fields)
    config.architectures = [class_name.replace("Config", "ForCausalLM")]
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # initializing on the GPU takes seconds
        model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    if hf_model:
        return model
    state = {k: v.detach().cpu() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    del model
    return LoadedModel(name=name, hf_config=config, state_dict=state, tokenizer=None, eos_token_ids=frozenset(),
                       max_model_len=config.max_position_embeddings, vocab_size=config.vocab_size)


def _load(model_path, loaded, dtype: str):
    if loaded is not None:
        return loaded
    model_path = model_path or W2_MODEL
    if model_path.startswith("random:"):
        return random_model(model_path, getattr(torch, dtype))
    return load_model(model_path, getattr(torch, dtype))


def free_gpu() -> None:
    """Return what deleted engines held, so that the next engine measures the same free memory."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def w2_workload(vocab_size: int, num_requests: int = 256, min_len: int = 100, max_len: int = 1024,
                seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """(prompts as token ids, output lengths): lengths uniform in min_len..max_len, random ids."""
    rng = random.Random(seed)
    prompts, output_lens = [], []
    for _ in range(num_requests):
        prompt_len, output_len = rng.randint(min_len, max_len), rng.randint(min_len, max_len)
        prompts.append([rng.randrange(vocab_size) for _ in range(prompt_len)])
        output_lens.append(output_len)
    return prompts, output_lens


def run_w2(model_path: str | None = None, *, num_requests: int = 256, min_len: int = 100, max_len: int = 1024,
           seed: int = 0, dtype: str = "bfloat16", loaded=None, **config) -> dict:
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
        "workload": "W2", "model": loaded.name, "device": torch.cuda.get_device_name(), "dtype": dtype,
        "config": {k: v for k, v in config.items() if k != "num_blocks"}, "num_requests": num_requests,
        "prompt_tokens": sum(map(len, prompts)), "output_tokens": output_tokens, "seconds": seconds,
        "output_tokens_per_s": output_tokens / seconds,
        "steps": engine.scheduler.step_count - first_step,
        "graph_steps": graph_runner.num_replays - first_replay if graph_runner is not None else 0,
        "num_graphs": len(graph_runner.graphs) if graph_runner is not None else 0,
        "capture_seconds": graph_runner.capture_seconds if graph_runner is not None else None,
        "build_seconds": build_seconds, "num_blocks": c.num_blocks, "block_size": c.block_size,
        "max_num_seqs": c.max_num_seqs, "max_num_batched_tokens": c.max_num_batched_tokens,
        "attention_backend": engine.runner.attention_backend,
        "memory": str(engine.memory) if engine.memory is not None else None,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }
    engine.shutdown()
    del llm, engine, graph_runner
    free_gpu()
    return result


def run_hf_continuous_w2(model_path: str | None = None, *, num_requests: int = 256, min_len: int = 100,
                         max_len: int = 1024, seed: int = 0, dtype: str = "bfloat16") -> dict:
    """transformers' own continuous batching (init_continuous_batching, paged attention) on the same W2."""
    from .w1 import run_hf_continuous

    require_cuda("run_hf_continuous_w2")
    free_gpu()
    name = model_path or W2_MODEL
    if name.startswith("random:"):
        model = random_model(name, getattr(torch, dtype), hf_model=True)
    else:
        import transformers
        model = transformers.AutoModelForCausalLM.from_pretrained(name, dtype=getattr(torch, dtype)).cuda().eval()
    prompts, output_lens = w2_workload(model.config.vocab_size, num_requests, min_len, max_len, seed)
    r = run_hf_continuous(model, prompts, output_lens)
    del model
    free_gpu()
    return {"system": "transformers continuous batching", "output_tokens": sum(output_lens), "seconds": r["wall_s"],
            "output_tokens_per_s": sum(output_lens) / r["wall_s"]}


def _decode_batch(batch_size: int, context_len: int, block_size: int, vocab_size: int) -> SchedulerOutput:
    """A synthetic decode step: row i feeds token context_len - 1 over its own blocks."""
    blocks_per_row = -(-context_len // block_size)
    rows = []
    for i in range(batch_size):
        req = Request(f"b{i}", [(7 * i + j) % vocab_size for j in range(context_len)],
                      SamplingParams(max_tokens=1, temperature=0.0))
        table = list(range(i * blocks_per_row, (i + 1) * blocks_per_row))
        rows.append(ScheduledRequest(req, start=context_len - 1, num_tokens=1, is_prefill=False, do_sample=True,
                                     block_table=table, slot=i))
    return SchedulerOutput(step=1, scheduled=rows, num_batched_tokens=batch_size)


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


def decode_latency_by_bucket(model_path: str | None = None, *, dtype: str = "bfloat16", context_len: int = 512,
                             max_model_len: int | None = None, max_batch_size: int = 256,
                             buckets: list[int] | None = None, iters: int = 20, block_size: int | None = None,
                             loaded=None, **config) -> list[dict]:
    """Median decode-step latency, eager vs CUDA graph, for each batch bucket (every row at context_len).

    max_model_len None: the model's own (40,960 for Qwen3), as a user's defaults would have it; the
    graph replayed is the narrowest that holds context_len, so its width follows the context.
    """
    from ..config import EngineConfig
    from ..cuda_graph import DecodeGraphRunner

    require_cuda("decode_latency_by_bucket")
    loaded = _load(model_path, loaded, dtype)
    bs = EngineConfig(device="cuda", block_size=block_size).block_size  # None: the CUDA default
    llm = LLM.from_loaded(loaded, device="cuda", dtype=dtype, use_cuda_graph=False, block_size=bs,
                          max_num_seqs=max_batch_size, max_model_len=max_model_len, record_trace=False,
                          num_blocks=max_batch_size * -(-context_len // bs), **config)  # each row its own blocks
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
            raise RuntimeError(f"batch size {b} did not run through a graph (buckets: {graph_runner.buckets})")
        results.append({"batch_size": b, "bucket": runner.last_graph_bucket, "width": runner.last_graph_width,
                        "context_len": context_len, "block_size": bs, "backend": runner.attention_backend,
                        "eager_ms": eager_ms, "graph_ms": graph_ms, "speedup": eager_ms / graph_ms})
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m minicb.bench.w2", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=("w2", "latency", "attention", "profile"), default="w2")
    parser.add_argument("--model", default=W2_MODEL, help=f"random:NAME, a local dir or a hub id (default {W2_MODEL})")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--competitors", nargs="+", default=["defaults", "eager", "gather", "tuned", "hf"],
                        help="W2: defaults (LLM with nothing set), eager (no graphs), gather (the padded decode), "
                             "tuned (max_num_seqs 512, 16384 tokens a step), block512, block128, "
                             "hf (transformers' continuous batching)")
    parser.add_argument("--json", default=None, help="append every result as a JSON line to this file")
    args = parser.parse_args(argv)
    require_cuda("python -m minicb.bench.w2")

    def emit(row):
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")

    from .gpu_step import attention_benchmark, profile_decode_step

    if args.workload == "attention":
        for row in attention_benchmark():
            emit(row)
        return
    loaded = _load(args.model, None, args.dtype)
    if args.workload == "profile":
        for backend in ("gather", "flash_pages"):
            emit(profile_decode_step(loaded=loaded, dtype=args.dtype, attention_backend=backend))
        return
    if args.workload == "latency":
        for row in decode_latency_by_bucket(dtype=args.dtype, loaded=loaded):
            emit(row)
            print(f"batch {row['batch_size']:4d} -> graph ({row['bucket']}, {row['width']}): eager "
                  f"{row['eager_ms']:7.2f} ms  graph {row['graph_ms']:7.2f} ms  x{row['speedup']:.2f}", flush=True)
        return
    variants = {"defaults": {}, "eager": {"use_cuda_graph": False}, "gather": {"attention_backend": "gather"},
                "tuned": {"max_num_seqs": 512, "max_num_batched_tokens": 16384}, "block512": {"block_size": 512},
                "block128": {"block_size": 128}}
    from ..config import EngineConfig

    rows, cache_tokens = {}, None
    for name in args.competitors:
        if name == "hf":
            rows[name] = run_hf_continuous_w2(args.model, num_requests=args.num_requests, dtype=args.dtype)
        else:  # the first sizes its cache from the GPU; every later one gets exactly as many tokens of cache
            bs = EngineConfig(device="cuda", **variants[name]).block_size
            extra = {} if cache_tokens is None else {"num_blocks": cache_tokens // bs}
            rows[name] = run_w2(num_requests=args.num_requests, dtype=args.dtype, loaded=loaded, **variants[name],
                                **extra)
            cache_tokens = cache_tokens or rows[name]["num_blocks"] * bs
        emit({"competitor": name, **rows[name]})
    device = torch.cuda.get_device_name()
    print(f"\nW2 on {device}, {args.model}, {args.dtype}, {args.num_requests} requests:")
    for name, r in rows.items():
        ratio = {k: r["output_tokens_per_s"] / v["output_tokens_per_s"] for k, v in rows.items() if k != name}
        print(f"  {name:9s} {r['output_tokens_per_s']:8.0f} output tok/s  {r['seconds']:7.1f} s  "
              + "  ".join(f"x{v:.2f} vs {k}" for k, v in ratio.items()))


if __name__ == "__main__":
    main()
