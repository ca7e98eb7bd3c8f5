"""GPU benchmarks for CUDA-graph decode: step latency per bucket, and workload W2.

decode_latency_by_bucket: one decode step (input copy + forward + sampling) for each batch
bucket, eager vs replayed from a CUDA graph. Small batches are launch-bound, so graphs should
win most there; large batches are compute-bound and the two converge.

run_w2: the nano-vllm / vLLM offline workload (defined in minicb/bench/__init__.py):
256 requests, prompt and output lengths uniform in 100..1024, random token ids, EOS ignored,
Qwen3-0.6B; throughput counts output tokens only. Run it with and without graphs:

    python -m minicb.bench.w2 --workload w2 [--model /path/to/Qwen3-0.6B]
    python -m minicb.bench.w2 --workload latency

Both need a CUDA GPU and raise RuntimeError without one. Quote ratios, with the GPU's name:
an absolute tokens/s figure holds only for the machine it was taken on.
"""

import argparse
import json
import random
import statistics
import time

import torch

from ..llm import LLM
from ..loader import load_model
from ..request import Request
from ..sampling_params import SamplingParams
from ..scheduler import ScheduledRequest, SchedulerOutput

W2_MODEL = "Qwen/Qwen3-0.6B"  # a hub id (found in the local HF cache) or a local directory
W2_KV_FRACTION = 0.5  # of the free GPU memory, for the KV cache (graphs and activations need the rest)


def require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(f"{what} needs a CUDA GPU, and torch.cuda.is_available() is False "
                           f"(torch {torch.__version__}); run it on a machine with an NVIDIA GPU")


def _load(model_path, loaded, dtype: str):
    return loaded if loaded is not None else load_model(model_path or W2_MODEL, getattr(torch, dtype))


def _kv_budget(loaded, kv_cache_memory_bytes: int | None) -> int:
    """Bytes for the KV cache: given, or a fraction of free GPU memory minus the weights."""
    if kv_cache_memory_bytes is not None:
        return kv_cache_memory_bytes
    free, _ = torch.cuda.mem_get_info()
    weights = sum(t.numel() * t.element_size() for t in loaded.state_dict.values())
    return int(free * W2_KV_FRACTION) - weights


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


def run_w2(model_path: str | None = None, use_cuda_graph: bool = True, *, num_requests: int = 256,
           min_len: int = 100, max_len: int = 1024, seed: int = 0, dtype: str = "bfloat16",
           max_num_seqs: int = 256, max_num_batched_tokens: int = 4096, kv_cache_memory_bytes: int | None = None,
           loaded=None) -> dict:
    """Workload W2 on CUDA; returns throughput in output tokens/s and what ran how."""
    require_cuda("run_w2")
    loaded = _load(model_path, loaded, dtype)
    prompts, output_lens = w2_workload(loaded.vocab_size, num_requests, min_len, max_len, seed)
    llm = LLM.from_loaded(loaded, device="cuda", dtype=dtype, use_cuda_graph=use_cuda_graph,
                          max_model_len=2 * max_len,  # fixes the graphs' block-table width: keep it tight
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          kv_cache_memory_bytes=_kv_budget(loaded, kv_cache_memory_bytes),
                          record_trace=False)  # a trace of ~1000 steps x 256 block tables costs host time
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
    return {
        "workload": "W2", "model": loaded.name, "device": torch.cuda.get_device_name(), "dtype": dtype,
        "use_cuda_graph": use_cuda_graph, "num_requests": num_requests,
        "prompt_tokens": sum(map(len, prompts)), "output_tokens": output_tokens, "seconds": seconds,
        "output_tokens_per_s": output_tokens / seconds,
        "steps": engine.scheduler.step_count - first_step,
        "graph_steps": graph_runner.num_replays - first_replay if graph_runner is not None else 0,
        "capture_seconds": graph_runner.capture_seconds if graph_runner is not None else None,
        "num_blocks": engine.config.num_blocks,
    }


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
                             buckets: list[int] | None = None, iters: int = 20, block_size: int = 16,
                             loaded=None) -> list[dict]:
    """Median decode-step latency, eager vs CUDA graph, for each bucket (every row at context_len).

    Eager attention gathers the blocks of the longest context; a graph always gathers
    ceil(max_model_len / block_size) of them. max_model_len=None makes the two equal (=
    context_len), which isolates launch overhead; a larger value shows what the fixed width costs.
    """
    require_cuda("decode_latency_by_bucket")
    loaded = _load(model_path, loaded, dtype)
    blocks_per_row = -(-context_len // block_size)
    llm = LLM.from_loaded(loaded, device="cuda", dtype=dtype, use_cuda_graph=True, block_size=block_size,
                          max_num_seqs=max_batch_size, max_model_len=max_model_len or context_len,
                          num_blocks=max_batch_size * blocks_per_row, record_trace=False)
    runner = llm.engine.runner
    graph_runner = runner.graph_runner
    results = []
    for b in buckets or graph_runner.buckets:
        out = _decode_batch(b, context_len, block_size, loaded.vocab_size)
        runner.graph_runner = None
        eager_ms = _time_ms(lambda: runner.execute(out), iters)
        runner.graph_runner = graph_runner
        graph_ms = _time_ms(lambda: runner.execute(out), iters)
        if runner.last_graph_bucket is None:
            raise RuntimeError(f"batch size {b} did not run through a graph (buckets: {graph_runner.buckets})")
        results.append({"batch_size": b, "bucket": runner.last_graph_bucket, "context_len": context_len,
                        "table_columns": graph_runner.max_blocks, "eager_ms": eager_ms, "graph_ms": graph_ms,
                        "speedup": eager_ms / graph_ms})
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m minicb.bench.w2", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=("w2", "latency"), default="w2")
    parser.add_argument("--model", default=None, help=f"local dir or hub id (default {W2_MODEL}, from the HF cache)")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args(argv)
    require_cuda("python -m minicb.bench.w2")
    loaded = _load(args.model, None, args.dtype)
    if args.workload == "latency":
        for row in decode_latency_by_bucket(dtype=args.dtype, loaded=loaded):
            print(f"batch {row['batch_size']:4d}: eager {row['eager_ms']:7.2f} ms  graph {row['graph_ms']:7.2f} ms"
                  f"  x{row['speedup']:.2f}")
        return
    runs = [run_w2(use_cuda_graph=g, num_requests=args.num_requests, dtype=args.dtype, loaded=loaded)
            for g in (False, True)]
    for r in runs:
        print(json.dumps(r))
    eager, graph = (r["output_tokens_per_s"] for r in runs)
    print(f"W2 on {runs[0]['device']}: eager {eager:.0f} tok/s, CUDA graphs {graph:.0f} tok/s (x{graph / eager:.2f})")


if __name__ == "__main__":
    main()
