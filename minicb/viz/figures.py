"""Regenerate the figures in figures/ that the README and the notebooks show.

Each entry of FIGURES is a name and a function returning a matplotlib Figure, so any figure can be
rebuilt alone (`python -m minicb figures --only NAME`) and a notebook can draw the very same one
(`FIGURES["nb00_static_vs_continuous"]()`). All of them come from the simulator, from arithmetic
on published model configs, from data written out by hand (notebook 10's diagram, viz/processes.py),
or from measurements stored beside them (gpu_h200: figures/gpu_h200_2026-11-26.jsonl, written by
`python -m minicb.bench.w2 --json` on a GPU): no model is loaded, and the whole set takes a few
seconds. Notebook 02's figures are made in figures_blocks.py. The demo's figures come from `python
-m minicb demo`, the benchmark's from `python -m minicb bench`.
"""

import math
import random
from pathlib import Path
from types import SimpleNamespace

from .. import viz
from ..config import EngineConfig, cdiv
from ..sim import SimRequest, simulate
from .figures_blocks import parallel_sampling, prefix_sharing_grid, prefix_sharing_map
from .processes import engine_core_processes

BURNERS = tuple(zip("ABCDEF", (4, 4, 10, 10, 4, 4)))  # keep-the-burners-busy.txt, section 3
# iteration-level-scheduling.txt
ABCD = (("A", 5), ("B", 200), ("C", 3), ("D", 150), ("E", 4), ("F", 6))


def _burners(batching: str):
    reqs = [SimRequest(prompt_len=8, output_len=n, request_id=rid) for rid, n in BURNERS]
    return simulate(reqs, EngineConfig(max_num_seqs=4, batching=batching))


def worked_example(batching: str):
    """The reading's example: 4 slots, outputs of 4, 4, 10, 10 tokens, two 4-token requests
    waiting."""
    res = _burners(batching)
    return viz.slot_occupancy(
        res.trace, title=f"{batching} batching: all six done after {res.num_steps} steps"
    )


def static_vs_continuous():
    return viz.compare_slot_occupancy(
        {b: _burners(b).trace for b in ("static", "continuous")},
        title="4 slots, outputs 4, 4, 10, 10 + two 4-token requests waiting",
    )


def abcd_timeline():
    reqs = [SimRequest(prompt_len=3, output_len=n, request_id=rid) for rid, n in ABCD]
    runs = {
        b: simulate(reqs, EngineConfig(max_num_seqs=4, batching=b)).trace
        for b in ("static", "continuous")
    }
    return viz.compare_slot_occupancy(
        runs, title="A=5, B=200, C=3, D=150 tokens in 4 slots; E=4, F=6 waiting"
    )


# --- notebook 00: the decode roofline and the "500 vs ~120 steps" claim
H100_BW, H100_FLOPS = 3.35e12, 989e12  # bytes/s and bf16 FLOP/s (spec-sheet peaks)
LLAMA2_7B = (6.74e9, 2 * 32 * 32 * 128 * 2)  # parameters, fp16 KV bytes per token (32 KV heads)
LLAMA3_8B = (8.03e9, 2 * 32 * 8 * 128 * 2)  # 8 KV heads (grouped-query attention)


def relative_decode_throughput(batch: int, context_len: int, model=LLAMA2_7B) -> float:
    """Throughput at `batch` over throughput at 1, for a decode step that reads all weights once,
    every request's KV cache, and does 2 FLOPs per parameter per request (a roofline model)."""
    params, kv = model

    def step_time(b):
        return max((2 * params + b * context_len * kv) / H100_BW, b * 2 * params / H100_FLOPS)

    return batch * step_time(1) / step_time(batch)


def batch_throughput():
    batches = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    cases = {
        "weights only (no KV)": (0, LLAMA2_7B),
        "Llama-2-7B, 1K-token context": (1000, LLAMA2_7B),
        "Llama-2-7B, 4K-token context": (4000, LLAMA2_7B),
        "Llama-3-8B (GQA), 1K": (1000, LLAMA3_8B),
    }
    return viz.curves(
        batches,
        {k: [relative_decode_throughput(b, L, m) for b in batches] for k, (L, m) in cases.items()},
        "batch size (running requests)",
        "decode throughput relative to batch 1",
        title="Memory-bound decode on an H100: a step reads the weights once per batch",
        logx=True,
        logy=True,
    )


def _with_mean_50(xs):
    """100 positive numbers scaled to integer lengths >= 1 that sum to exactly 5,000 (mean 50)."""
    lengths = [max(1, round(x * 5000 / sum(xs))) for x in xs]
    lengths[lengths.index(max(lengths))] += 5000 - sum(lengths)  # the rounding goes to the longest
    return lengths


def _hundred_requests():
    """Notebook 00's workloads: the first four have the same mean (50), different spreads."""
    rng = random.Random(0)
    uniform = list(range(1, 100)) + [50]
    rng.shuffle(uniform)
    return {
        "all 50": [50] * 100,
        "uniform 1..99": uniform,
        "exponential\nmean 50": _with_mean_50([rng.expovariate(1) for _ in range(100)]),
        "1 in 10 is 275,\nrest 25": ([275] + [25] * 9) * 10,
        "1 in 10 is 50,\nrest 8": ([50] + [8] * 9) * 10,
    }


def _static_and_continuous(outputs, slots=10):
    reqs = [SimRequest(prompt_len=8, output_len=n) for n in outputs]
    return {
        b: simulate(reqs, EngineConfig(max_num_seqs=slots, batching=b))
        for b in ("static", "continuous")
    }


def speedup_by_distribution():
    steps = {}
    for name, outs in _hundred_requests().items():
        runs = _static_and_continuous(outs)
        steps[name] = {b: r.num_steps for b, r in runs.items()}
        steps[name]["lower bound: max(tokens / slots, longest)"] = max(
            math.ceil(sum(outs) / 10), max(outs)
        )
    return viz.bars(
        steps,
        "steps to finish all 100 requests",
        title="100 requests, 10 slots: static vs continuous batching by output-length distribution",
    )


def utilization_exponential():
    runs = _static_and_continuous(_hundred_requests()["exponential\nmean 50"])
    return viz.utilization_curves(
        {b: r.trace for b, r in runs.items()},
        title="100 requests, exponential lengths (mean 50), 10 slots",
    )


# --- notebook 01: KV memory
KIB = 2**10
# minicb.engine.llm_engine.DEFAULT_KV_CACHE_BYTES (the engine would load the model code)
CPU_KV_CACHE_BYTES = 512 * 2**20
# from the published configs
CONFIGS = {
    "SmolLM2-135M": (30, 9, 3, 576),
    "Llama-2-7B": (32, 32, 32, 4096),  # (layers, heads, KV heads, hidden)
    "Llama-3-8B": (32, 32, 8, 4096),
    "Llama-2-70B": (80, 64, 8, 8192),
}


def kv_bytes(config: tuple[int, int, int, int], dtype: str = "float16") -> int:
    """K and V bytes per token of a (layers, heads, kv_heads, hidden) config, as the engine counts
    them."""
    import torch  # the byte size of a dtype; only the figures that count bytes load it

    from ..model_executor.hf_config import kv_bytes_per_token

    layers, heads, kv_heads, hidden = config
    hf_config = SimpleNamespace(
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        hidden_size=hidden,
    )
    return kv_bytes_per_token(hf_config, getattr(torch, dtype))


def paged_memory_map():
    reqs = [
        SimRequest(p, o) for p, o in ((6, 10), (3, 4), (9, 14), (2, 6), (5, 3), (7, 8), (4, 12))
    ]
    res = simulate(
        reqs, EngineConfig(max_num_seqs=3, block_size=4, num_blocks=16, enable_prefix_caching=False)
    )
    return viz.memory_map(
        res.trace, title="Paged KV memory: 7 requests, 3 slots, 16 blocks of 4 tokens"
    )


def kv_bytes_per_token_figure():
    values = {name: kv_bytes(c) / KIB for name, c in CONFIGS.items()}
    values["Llama-2-70B\nwithout GQA"] = kv_bytes((80, 64, 64, 8192)) / KIB
    return viz.bars(
        values,
        "KiB of K and V per token (fp16)",
        fmt="{:.0f}",
        title="KV cache per token: 2 x layers x kv_heads x head_dim x 2 bytes",
    )


def reservation_waste():
    used = {"A (500 tokens)": 500, "B (50 tokens)": 50}
    return viz.bars(
        {
            k: {
                "contiguous 8K reservation": 8000,
                "paged, 16-token blocks": cdiv(n, 16) * 16,
                "tokens stored": n,
            }
            for k, n in used.items()
        },
        "KV token positions (log scale)",
        logy=True,
        title="Reserved vs used KV token positions (iteration-level-scheduling example)",
    )


def _fit_workload():
    rng = random.Random(1)
    return [
        SimRequest(prompt_len=rng.randint(100, 600), output_len=rng.randint(50, 400))
        for _ in range(60)
    ]


def requests_that_fit():
    # the CPU default
    num_blocks = CPU_KV_CACHE_BYTES // (kv_bytes(CONFIGS["SmolLM2-135M"], "float32") * 16)
    common = dict(block_size=16, num_blocks=num_blocks, max_num_batched_tokens=2048)
    runs = {
        "contiguous (2048-token reservation each: 5 slots)": EngineConfig(max_num_seqs=5, **common),
        "paged (up to 64 slots)": EngineConfig(max_num_seqs=64, **common),
    }
    return viz.utilization_curves(
        {k: simulate(_fit_workload(), c).trace for k, c in runs.items()},
        title=f"60 requests, {num_blocks} KV blocks of 16 tokens (512 MiB of SmolLM2)",
        normalize=False,
    )


def fragmentation():
    lens = [r.prompt_len + r.output_len - 1 for r in _fit_workload()]
    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]

    def waste(lengths, bs):
        alloc = sum(cdiv(n, bs) * bs for n in lengths)
        return 100 * (alloc - sum(lengths)) / alloc

    return viz.curves(
        sizes,
        {
            "workload of notebook 01 (100-1000 tokens)": [waste(lens, b) for b in sizes],
            "short chats (20-120 tokens)": [waste(range(20, 121), b) for b in sizes],
        },
        "block_size (tokens)",
        "% of allocated KV positions left empty",
        logx=True,
        title="Internal fragmentation: the unfilled tail of each request's last block",
    )


# --- notebook 03: the scheduler
def _policy_runs():
    reqs = (
        [SimRequest(prompt_len=8, output_len=60, request_id="L")]
        + [SimRequest(prompt_len=8, output_len=5, request_id=f"s{i}") for i in range(8)]
        + [SimRequest(prompt_len=8, output_len=20, request_id="M")]
    )
    return {
        p: simulate(reqs, EngineConfig(max_num_seqs=2, scheduling_policy=p))
        for p in ("fcfs", "sjf")
    }


def policies():
    return viz.compare_slot_occupancy(
        {p: r.trace for p, r in _policy_runs().items()},
        title="2 slots: one 60-token request, eight of 5 tokens, one of 20",
    )


def policy_latency():
    return viz.latency_distributions(
        {
            p: {
                "TTFT": [q.ttft_steps for q in r.requests],
                "latency": [q.latency_steps for q in r.requests],
            }
            for p, r in _policy_runs().items()
        },
        title="FCFS vs shortest-job-first (same 10 requests, 2 slots)",
    )


def _late_arrivals(batching):
    reqs = [
        SimRequest(6, 20, request_id="A"),
        SimRequest(6, 6, request_id="B"),
        SimRequest(6, 12, request_id="C"),
        SimRequest(6, 5, arrival_step=3, request_id="D"),
        SimRequest(6, 5, arrival_step=8, request_id="E"),
        SimRequest(6, 3, arrival_step=26, request_id="F"),
    ]
    res = simulate(reqs, EngineConfig(max_num_seqs=4, batching=batching))
    return viz.request_timeline(
        res.requests,
        trace=res.trace,
        title=f"{batching} batching: D arrives in step 3, E in 8, F in 26 (4 slots)",
    )


# --- notebook 04: preemption
def _pressure(mode, **kw):
    reqs = [SimRequest(prompt_len=8, output_len=40) for _ in range(4)]
    return simulate(
        reqs, EngineConfig(max_num_seqs=4, block_size=4, num_blocks=24, preemption_mode=mode, **kw)
    )


def preemption_map():
    return viz.memory_map(
        _pressure("recompute").trace,
        title="4 requests (8 + 40 tokens) in 24 blocks of 4: preemption by recompute",
    )


def swap_map():
    return viz.memory_map(_pressure("swap").trace, title="The same run with preemption_mode='swap'")


def thrashing():
    res = _pressure("recompute", max_num_batched_tokens=8, enable_prefix_caching=False)
    return viz.request_timeline(
        res.requests,
        trace=res.trace,
        title="Recompute with an 8-token budget: victims readmitted too early, preempted again",
    )


def priority_timeline():
    # vLLM's rule: the lowest priority value is served first; vip's 0 outranks the background's 1.
    reqs = [
        SimRequest(prompt_len=8, output_len=30, priority=1, request_id=f"bg{i}") for i in range(2)
    ] + [SimRequest(prompt_len=8, output_len=5, arrival_step=6, priority=0, request_id="vip")]
    res = simulate(
        reqs,
        EngineConfig(max_num_seqs=2, block_size=4, num_blocks=64, scheduling_policy="priority"),
    )
    return viz.request_timeline(
        res.requests,
        trace=res.trace,
        title="Priority: vip arrives in step 6 and preempts bg1 (2 slots)",
    )


GPU_MEASUREMENTS = Path(__file__).resolve().parents[2] / "figures" / "gpu_h200_2026-11-26.jsonl"


def gpu_h200():
    """The README's GPU figure: decode step per batch size and W2, measured on an NVIDIA H200."""
    from .cuda_graphs import measured_gpu, read_measurements

    return measured_gpu(read_measurements(GPU_MEASUREMENTS))


FIGURES = {
    "gpu_h200": gpu_h200,
    "worked_example_static": lambda: worked_example("static"),
    "worked_example_continuous": lambda: worked_example("continuous"),
    "nb00_static_vs_continuous": static_vs_continuous,
    "nb00_abcd_timeline": abcd_timeline,
    "nb00_batch_throughput": batch_throughput,
    "nb00_speedup_by_distribution": speedup_by_distribution,
    "nb00_utilization_exponential": utilization_exponential,
    "nb01_paged_memory_map": paged_memory_map,
    "nb01_kv_bytes_per_token": kv_bytes_per_token_figure,
    "nb01_reservation_waste": reservation_waste,
    "nb01_requests_that_fit": requests_that_fit,
    "nb01_fragmentation": fragmentation,
    "nb02_prefix_sharing_grid": prefix_sharing_grid,
    "nb02_prefix_sharing_map": prefix_sharing_map,
    "nb02_parallel_sampling": parallel_sampling,
    "nb03_policies": policies,
    "nb03_policy_latency": policy_latency,
    "nb03_late_arrivals_static": lambda: _late_arrivals("static"),
    "nb03_late_arrivals_continuous": lambda: _late_arrivals("continuous"),
    "nb04_preemption_map": preemption_map,
    "nb04_swap_map": swap_map,
    "nb04_thrashing": thrashing,
    "nb04_priority_timeline": priority_timeline,
    "nb10_engine_core": engine_core_processes,
}


def add_arguments(parser):
    parser.add_argument("--out", default="figures", help="directory to write PNG files to")
    parser.add_argument("--only", nargs="*", choices=sorted(FIGURES), help="regenerate only these")


def main(args):
    import matplotlib.pyplot as plt

    plt.switch_backend("Agg")  # files only: never open a window
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.only or FIGURES:
        fig = FIGURES[name]()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        print(f"wrote {path}")
