"""Workload W1 (defined in minicb/bench/__init__.py): mixed-length chat on the CPU, side by side.

64 chat requests arrive at once; their output lengths are log-normal (mean ~61, longest 256)
and EOS is ignored so every system produces exactly the same number of tokens. The competitors
run one after another in the same process on the same prompts:
  1. transformers `generate` in static batches of 16 (left padding; a batch runs to its longest
     member)
  2. transformers' own continuous batching (`init_continuous_batching`, per-request max_new_tokens)
  3. minicb, batching="static", 16 slots
  4. minicb, batching="continuous", 16 slots: the same batch size, so 4 vs 3 is the scheduler's own
     gain
  5. minicb, batching="continuous", the default 64 slots: 5 vs 4 is the batch size paging makes room
     for. (With all 64 requests arriving at once and 64 slots, nobody waits for a slot: continuous
     and static batching would run the very same schedule. Comparing 5 with 3 mixes both effects.)
Throughput is output tokens / wall time from first submission to last completion. The roofline
compares what was achieved with the machine's measured float32 GEMM speed, for 2 x params FLOPs per
generated token.
"""

import os
import random
import statistics
import time

from tqdm.auto import tqdm

from ..engine.llm import chat_token_ids
from ..metrics import mean_gap, percentile, tpot
from ..model_executor.cpu_kernels import gemm_peaks
from ..sampling_params import SamplingParams
from .floor import (
    memory_bandwidth,
)
from .machine import PeakRSS, cpu_model

# ---------------------------------------------------------------------------------------------- W1
W1_TOPICS = [
    "the sea",
    "gravity",
    "bread",
    "Rome",
    "a cat",
    "rain",
    "chess",
    "music",
    "trains",
    "the moon",
    "coffee",
    "volcanoes",
]


def w1_workload(tokenizer, num_requests: int = 64) -> tuple[list[list[int]], list[int]]:
    """The W1 prompts (chat-templated token ids) and output lengths, built as the workload's
    definition says: one random.Random(0); per request a topic, then repeats, then a log-normal
    output length."""
    rng = random.Random(0)
    prompts, outs = [], []
    for _ in range(num_requests):
        topic = rng.choice(W1_TOPICS)
        q = f"Tell me about {topic}." + " Please be detailed." * rng.randint(0, 6)
        outs.append(min(256, max(4, int(rng.lognormvariate(3.5, 0.9)))))
        prompts.append(chat_token_ids(tokenizer, [{"role": "user", "content": q}]))
    return prompts, outs


def _result(name, wall, outs, ttfts, tpots, peak_mib, **extra) -> dict:
    ntok = sum(outs)
    return dict(
        name=name,
        output_tokens=ntok,
        wall_s=wall,
        throughput=ntok / wall,
        ttft_p50=percentile(ttfts, 50),
        ttft_p99=percentile(ttfts, 99),
        tpot_p50=percentile(tpots, 50),
        tpot_p99=percentile(tpots, 99),
        peak_mem_mib=peak_mib,
        **extra,
    )


def run_hf_static(model, prompts, outs, pad_id: int, batch_size: int = 16) -> dict:
    """transformers generate in static batches with left padding: each batch runs to its longest
    member."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StepClock(
        StoppingCriteria
    ):  # called once per generated token of the batch: a timestamp per step
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    ttfts, tpots = [], []
    bar = tqdm(total=len(prompts), desc="transformers static generate", unit="req")
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            ps, ns = prompts[i : i + batch_size], outs[i : i + batch_size]
            width = max(len(p) for p in ps)
            ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in ps])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
            clock = StepClock()
            with torch.no_grad():
                model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=max(ns),
                    min_new_tokens=max(ns),
                    do_sample=False,
                    pad_token_id=pad_id,
                    eos_token_id=None,
                    stopping_criteria=StoppingCriteriaList([clock]),
                )
            for n in ns:  # request i's tokens exist at steps 1..n of its batch
                ttfts.append(clock.times[0] - t0)
                if n > 1:
                    tpots.append(mean_gap(clock.times[0], clock.times[n - 1], n))
            bar.update(len(ps))
        wall = time.perf_counter() - t0
    bar.close()
    return _result(
        f"transformers generate (static, batch {batch_size})", wall, outs, ttfts, tpots, mem.mib
    )


def run_hf_continuous(model, prompts, outs) -> dict:
    """transformers' own continuous batching (init_continuous_batching), per-request
    max_new_tokens."""
    from transformers import GenerationConfig

    gen = GenerationConfig(
        do_sample=False, max_new_tokens=max(outs), eos_token_id=-1, pad_token_id=0
    )
    manager = model.init_continuous_batching(generation_config=gen)
    manager.start()
    results = {}
    bar = tqdm(total=len(prompts), desc="transformers continuous batching", unit="req")
    try:
        with PeakRSS() as mem:
            t0 = time.perf_counter()
            ids = [
                manager.add_request(p, max_new_tokens=n, eos_token_id=-1, record_timestamps=True)
                for p, n in zip(prompts, outs)
            ]
            while len(results) < len(ids):
                r = manager.get_result(timeout=600)
                if r is None:
                    raise RuntimeError("transformers continuous batching stopped without finishing")
                if r.is_finished():
                    results[r.request_id] = r
                    bar.update(1)
            wall = time.perf_counter() - t0
    finally:
        manager.stop(block=True)
        bar.close()
    ttfts, tpots = [], []
    for rid, n in zip(ids, outs):
        r = results[rid]
        if len(r.generated_tokens) != n:
            raise RuntimeError(
                f"transformers CB produced {len(r.generated_tokens)} tokens for a {n}-token request"
            )
        ts = r.timestamps or []
        if ts:
            ttfts.append(ts[0] - t0)
            if n > 1:
                tpots.append(mean_gap(ts[0], ts[-1], n))
    return _result("transformers continuous batching", wall, outs, ttfts, tpots, mem.mib)


def run_minicb(loaded, prompts, outs, batching: str, **config) -> dict:
    from ..engine.llm import LLM
    from .precision import precision_name

    llm = LLM.from_loaded(loaded, batching=batching, **config)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in outs]
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        res = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
    assert [len(o.outputs[0].token_ids) for o in res] == outs
    ttfts = [o.metrics.first_token_time - t0 for o in res]
    tpots = [t for o in res if (t := tpot(o.metrics, len(o.outputs[0].token_ids))) is not None]
    trace, cfg = llm.engine.trace, llm.engine.config
    slots, precision = cfg.max_num_seqs, precision_name(cfg.dtype, cfg.quantization)
    return _result(
        f"minicb {batching} ({slots} slots{'' if precision == 'float32' else ', ' + precision})",
        wall,
        outs,
        ttfts,
        tpots,
        mem.mib,
        slot_utilization=trace.slot_utilization(),
        steps=len(trace),
        trace=trace,
        cpu_kernels=llm.engine.cpu_kernels,
        precision=(cfg.dtype, cfg.quantization),
    )


def decode_step_roofline(loaded, batch: int = 64, context: int = 100, steps: int = 10) -> dict:
    """Time one decode step at `batch` (contexts of `context` tokens): achieved FLOP/s for 2 x
    params per token, the model's arithmetic for one generated token."""
    from ..engine.llm import LLM

    llm = LLM.from_loaded(loaded, max_num_seqs=batch, max_num_batched_tokens=max(256, batch))
    eng = llm.engine
    ids = [
        eng.add_request(
            [(7 * i + j) % 1000 + 10 for j in range(context)],
            SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True),
        )
        for i in range(batch)
    ]
    while not eng.trace.steps or eng.trace[-1].num_prefill_rows:
        eng.step()  # prefill everyone (the early ones start decoding meanwhile)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
        assert eng.trace[-1].num_decode_rows == batch
    for rid in ids:
        eng.abort_request(rid)
    step = statistics.median(times)
    flops = 2 * loaded.num_params * batch
    return dict(batch=batch, context=context, step_ms=1000 * step, gflops=flops / step / 1e9)


def run_llamacpp_best(prompts, outs, cooldown_s: float, sweep_out: dict) -> dict:
    """llama.cpp's sweep (kept in `sweep_out`), then its best setting run again after the
    cooldown."""
    from .llamacpp import find_quantize, find_server, gguf_file, run_llamacpp, sweep

    sweep_out |= sweep(prompts, outs)
    best = sweep_out["best"]
    time.sleep(cooldown_s)
    server = find_server()
    gguf = gguf_file(best["weight_type"], find_quantize(server))
    return run_llamacpp(server, gguf, best["weight_type"], best["slots"], prompts, outs)


COMPETITORS = (
    "hf_static",
    "hf_continuous",
    "minicb_static",
    "minicb_continuous_16",
    "minicb_continuous",
)
# opt-in: minicb in dtype "auto" (bfloat16 where the CPU has it and it is faster), the same with
# int8 weights, and llama.cpp's llama-server at the best setting a sweep finds (llamacpp.py)
MORE_COMPETITORS = ("minicb_auto", "minicb_int8", "llamacpp")


def run_w1(
    competitors=COMPETITORS,
    num_requests: int = 64,
    static_slots: int = 16,
    cooldown_s: float = 20.0,
    **minicb_config,
) -> dict:
    """Run W1 for the chosen competitors in this process; returns every figure the table prints.

    `cooldown_s`: idle seconds before each competitor after the first (and before the roofline). A
    shared or small machine runs slower after minutes of full load (on the 2-core VM this was
    written on, ~10% after a 60 s burn, recovered after 30 s idle), which would favour whoever runs
    first; the pause gives every system the same starting conditions.

    "llamacpp" first sweeps llama-server's settings on W1 (llamacpp.py), then, after the cooldown,
    runs the best one again: that run is its row. A row in another precision than float32 is priced
    at that precision's floors and carries its accuracy against float32 (precision.py); the others
    are priced at float32's.
    """
    llamacpp_sweep: dict = {}
    import torch

    from ..model_executor.loader import DEFAULT_MODEL, cache_dir, load_model
    from .precision import accuracy, precision_floor, precision_name

    torch.set_num_threads(os.cpu_count())
    loaded = load_model(None)
    prompts, outs = w1_workload(loaded.tokenizer, num_requests)
    hf = None
    if any(c.startswith("hf_") for c in competitors):
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(
            cache_dir() / DEFAULT_MODEL, dtype=torch.float32
        ).eval()
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 0
    runs = {
        "hf_static": lambda: run_hf_static(hf, prompts, outs, pad, batch_size=static_slots),
        "hf_continuous": lambda: run_hf_continuous(hf, prompts, outs),
        "minicb_static": lambda: run_minicb(
            loaded, prompts, outs, "static", max_num_seqs=static_slots, **minicb_config
        ),
        "minicb_continuous_16": lambda: run_minicb(
            loaded, prompts, outs, "continuous", max_num_seqs=static_slots, **minicb_config
        ),
        "minicb_continuous": lambda: run_minicb(
            loaded, prompts, outs, "continuous", **minicb_config
        ),
        "minicb_auto": lambda: run_minicb(
            loaded, prompts, outs, "continuous", **(minicb_config | {"dtype": "auto"})
        ),
        "minicb_int8": lambda: run_minicb(
            loaded,
            prompts,
            outs,
            "continuous",
            **(minicb_config | {"dtype": "auto", "quantization": "int8"}),
        ),
        "llamacpp": lambda: run_llamacpp_best(prompts, outs, cooldown_s, llamacpp_sweep),
    }
    results = []
    for name in COMPETITORS + MORE_COMPETITORS:  # always in this order, whatever order asked
        if name in competitors:
            if results:
                time.sleep(cooldown_s)
            results.append(runs[name]() | {"key": name})
    runs.clear()  # drops transformers' model before the peaks are measured
    cpu_kernels = next((r["cpu_kernels"] for r in results if r.get("cpu_kernels")), {})
    time.sleep(cooldown_s)
    peaks = gemm_peaks()
    peak = max(peaks.values())
    prompt_lens, bandwidth = [len(p) for p in prompts], memory_bandwidth()
    mode = minicb_config.get("prepack_cpu_weights", "auto")
    floor = precision_floor(
        loaded, prompt_lens, outs, ("float32", None), peak * 1e9, bandwidth, mode
    )
    # every other precision a minicb row ran in: its own floors (its bytes, its GEMM peak, its
    # linears) and its accuracy against float32
    floors = {"float32": floor}
    others = {
        r["precision"]
        for r in results
        if r.get("precision", ("float32", None)) != ("float32", None)
    }
    for dtype, quantization in sorted(others, key=str):
        dtype_peak = max(gemm_peaks(dtype=getattr(torch, dtype)).values())
        floors[precision_name(dtype, quantization)] = precision_floor(
            loaded, prompt_lens, outs, (dtype, quantization), dtype_peak * 1e9, bandwidth, mode
        )
    accuracies = accuracy(loaded, [precision_name(*p) for p in others]) if others else {}
    for r in results:
        name = precision_name(*r.get("precision", ("float32", None)))
        r["floor_fraction"] = floors[name]["floor_s"] / r["wall_s"]
        if name in accuracies:
            r["accuracy"] = accuracies[name]
    flops_per_token = 2 * loaded.num_params
    for r in results:
        r["achieved_gflops"] = r["throughput"] * flops_per_token / 1e9
        r["roofline_fraction"] = r["achieved_gflops"] / peak
    return dict(
        machine=f"{os.cpu_count()} cores of {cpu_model()}, torch {torch.__version__}",
        floor=floor,
        floors=floors,
        llamacpp=llamacpp_sweep,
        cpu_kernels=cpu_kernels,
        num_requests=num_requests,
        output_tokens=sum(outs),
        prompt_tokens=sum(map(len, prompts)),
        gemm_peak_gflops=peak,
        gemm_peaks=peaks,
        flops_per_token=flops_per_token,
        results=results,
        decode_step=decode_step_roofline(loaded, batch=64) | {"gemm_peak_gflops": peak},
    )
