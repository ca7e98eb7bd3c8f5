"""One decode step on a GPU, taken apart: one layer's decode attention against the memory floor, and
where the GPU time of a whole eager step goes (torch.profiler), for each decode attention backend.

    python -m minicb.bench.w2 --workload attention    # gather vs flash pages vs one read of the K/V
    python -m minicb.bench.w2 --workload profile      # GPU time split: gather / attention / matmul
    / other
    python -m minicb.bench.w2 --workload idle         # GPU idle between decode steps, sync / async
"""

import random
import statistics
import time

import torch

from ..engine.llm import LLM
from ..sampling_params import RequestOutputKind, SamplingParams
from .gpu import _decode_batch, _load, free_gpu, require_cuda

FINAL_ONLY = RequestOutputKind.FINAL_ONLY


def _time_gpu_ms(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def attention_benchmark(
    batch: int = 256,
    min_ctx: int = 100,
    max_ctx: int = 2048,
    block_sizes=(16, 64, 128, 256, 512),
    heads: int = 16,
    kv_heads: int = 8,
    head_dim: int = 128,
    seed: int = 0,
) -> list[dict]:
    """One layer's decode attention at W2's shape (contexts uniform in min_ctx..max_ctx), bfloat16:
    the padded gather (attention.decode_attention), flash pages (paged_flash.py), and the floor: one
    read of the K/V the rows really hold (a sum over a tensor of that size)."""
    from ..model_executor.attention import decode_attention
    from ..model_executor.paged_flash import (
        flash_pages_attention,
        page_pairs,
        pairs_attention_reference,
    )

    require_cuda("attention_benchmark")
    rng, dev, bf16 = random.Random(seed), "cuda", torch.bfloat16
    lens = [rng.randint(min_ctx, max_ctx) for _ in range(batch)]
    kv_bytes = sum(lens) * kv_heads * head_dim * 2 * 2  # K and V, bfloat16
    slab = torch.randn(kv_bytes // 2, device=dev, dtype=bf16)
    floor = _time_gpu_ms(lambda: slab.sum(dtype=torch.float32))
    rows = []
    for bs in block_sizes:
        blocks = [-(-n // bs) for n in lens]
        num_blocks, width = sum(blocks), max(blocks)
        k = torch.randn(num_blocks + 1, bs, kv_heads, head_dim, device=dev, dtype=bf16)
        v = torch.randn_like(k)
        ids = list(range(num_blocks))
        rng.shuffle(ids)
        tables = [[ids.pop() for _ in range(n)] + [num_blocks] * (width - n) for n in blocks]
        tables, ctx = torch.tensor(tables, device=dev), torch.tensor(lens, device=dev)
        q = torch.randn(batch, heads, head_dim, device=dev, dtype=bf16)
        scale = head_dim**-0.5
        pairs = page_pairs(tables, ctx, bs, (num_blocks + 1) * bs)
        gather_ms = _time_gpu_ms(lambda: decode_attention(q, k, v, tables, ctx, scale))
        pages_ms = _time_gpu_ms(lambda: flash_pages_attention(q, k, v, pairs, scale))
        q_pairs = q[:, None].expand(batch, width, heads, head_dim).reshape(-1, heads, head_dim)
        kernel_ms = _time_gpu_ms(
            lambda: pairs.kernel(
                q_pairs,
                k.view(-1, kv_heads, head_dim),
                v.view(-1, kv_heads, head_dim),
                pairs,
                bs,
                scale,
            )
        )
        ref = decode_attention(q, k, v, tables, ctx, scale).float()
        err = (flash_pages_attention(q, k, v, pairs, scale).float() - ref).abs().max().item()
        # the CUDA kernel against the reference
        small = page_pairs(tables[:4], ctx[:4], bs, (num_blocks + 1) * bs)
        small.kernel = pairs_attention_reference
        ref_err = (
            (flash_pages_attention(q[:4], k, v, small, scale).float() - ref[:4]).abs().max().item()
        )
        rows.append(
            {
                "block_size": bs,
                "pairs": batch * width,
                "kv_gb": kv_bytes / 1e9,
                "floor_ms": floor,
                "gather_ms": gather_ms,
                "pages_ms": pages_ms,
                "kernel_only_ms": kernel_ms,
                "gather_x_floor": gather_ms / floor,
                "pages_x_floor": pages_ms / floor,
                "max_abs_err_vs_gather": err,
                "max_abs_err_reference_kernel": ref_err,
            }
        )
        k = v = None  # free this block size's cache (the closures above hold it)
    return rows


KERNEL_KINDS = (
    ("gather", ("index_select", "indexselect", "gather")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "matmul", "splitk")),
)


def profile_decode_step(
    model_path: str | None = None,
    *,
    dtype: str = "bfloat16",
    batch: int = 256,
    context_len: int = 1024,
    loaded=None,
    **config,
) -> dict:
    """GPU time of one eager decode step (batch rows at context_len), split by kernel kind
    (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    require_cuda("profile_decode_step")
    from ..config import EngineConfig

    loaded = _load(model_path, loaded, dtype)
    bs = EngineConfig(device="cuda", block_size=config.pop("block_size", None)).block_size
    llm = LLM.from_loaded(
        loaded,
        device="cuda",
        dtype=dtype,
        use_cuda_graph=False,
        max_num_seqs=batch,
        block_size=bs,
        num_blocks=batch * -(-context_len // bs),
        record_trace=False,
        **config,
    )
    runner = llm.engine.runner
    out = _decode_batch(batch, context_len, runner.config.block_size, loaded.vocab_size)
    for _ in range(3):
        runner.execute(out)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            runner.execute(out)
        torch.cuda.synchronize()
    split = {kind: 0.0 for kind, _ in KERNEL_KINDS} | {"other": 0.0}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        if (
            not us
            or e.key.startswith(("aten::", "cuda"))
            and "Kernel" not in e.key
            and "kernel" not in e.key
        ):
            continue
        name = e.key.lower()
        kind = next((k for k, words in KERNEL_KINDS if any(w in name for w in words)), "other")
        split[kind] += us
    total = sum(split.values())
    result = {
        "backend": runner.attention_backend,
        "block_size": runner.config.block_size,
        "batch": batch,
        "context_len": context_len,
        "gpu_ms_per_step": total / 5 / 1e3,
        "share": {k: v / total for k, v in split.items()},
    }
    del llm, runner
    free_gpu()
    return result


def busy_union_us(intervals: list[tuple[float, float]]) -> float:
    """Microseconds covered by at least one of the (start, end) intervals."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy


def idle_split(kernels: list[tuple[float, float, int]], min_graph_kernels: int = 20) -> dict:
    """Where the device idled: inside a CUDA graph's replay, or between them. `kernels`: (start,
    end, key) per device activity, where key is its launch's correlation id; a graph's replay
    launches all its kernels under one id, so a key with at least `min_graph_kernels` activities is
    one replay (one decode step's forward pass). Its window is its first kernel's start to its last
    one's end; the gaps inside it are the graph's own, between consecutive kernels, which no host
    work moves. Everything else the device idled is between the steps' forward passes: sampling,
    the copies and the host's launches. Returns microseconds and the number of replays found."""
    window = max(end for _, end, _ in kernels) - min(start for start, _, _ in kernels)
    idle = window - busy_union_us([(s, e) for s, e, _ in kernels])
    groups: dict[int, list[tuple[float, float]]] = {}
    for start, end, key in kernels:
        if key > 0:  # 0: no launch recorded
            groups.setdefault(key, []).append((start, end))
    replays = [g for g in groups.values() if len(g) >= min_graph_kernels]
    inside = 0.0
    for g in replays:
        lo, hi = min(s for s, _ in g), max(e for _, e in g)
        clipped = [(max(s, lo), min(e, hi)) for s, e, _ in kernels if e > lo and s < hi]
        inside += (hi - lo) - busy_union_us(clipped)
    return {
        "window_us": window,
        "idle_us": idle,
        "idle_in_graphs_us": inside,
        "idle_between_us": idle - inside,
        "graph_replays": len(replays),
    }


def device_idle(
    model_path: str | None = None,
    *,
    dtype: str = "bfloat16",
    batch: int = 256,
    prompt_len: int = 128,
    steps: int = 30,
    loaded=None,
    launch: str = "inline",
    host_profile: str | None = None,
    **config,
) -> dict:
    """The GPU's idle share between decode steps at `batch` rows (issue 32's target: under 5% with
    async scheduling): `steps` engine steps of `batch` decoding requests, profiled (torch.profiler);
    idle = the window from the first kernel to the last minus the time some kernel runs, and of
    it, the part between the steps' forward passes (idle_split: the graph's own gaps between its
    kernels are not the engine loop's).
    `launch`: with async scheduling, "inline" launches the steps on the engine's thread (the
    default on CUDA), "thread" on the device thread (as on a CPU; executor.py). Besides the idle
    share, the host's side from the steps' StepTimes: the medians of the work before the launch,
    the launch, the work after, and how often a step's work was still being queued when the step
    before had already finished on the device (`late_launches`), which leaves the device idle.
    `host_profile`: a file to write a cProfile of `steps` more steps to (the host's functions by
    cumulative time), run after the measured ones."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    require_cuda("device_idle")
    loaded = _load(model_path, loaded, dtype)
    llm = LLM.from_loaded(
        loaded, device="cuda", dtype=dtype, max_num_seqs=batch, record_trace=False, **config
    )
    eng = llm.engine
    rng = random.Random(0)
    # outputs as LLM.generate asks for them (vLLM's FINAL_ONLY): none while a request runs
    params = SamplingParams(
        max_tokens=steps + 64, temperature=0.0, ignore_eos=True, output_kind=FINAL_ONLY
    )
    for _ in range(batch):
        eng.add_request([rng.randrange(loaded.vocab_size) for _ in range(prompt_len)], params)
    while eng.scheduler.waiting or any(
        r.num_output_tokens + r.num_output_placeholders < 2 for r in eng.scheduler.running
    ):
        eng.step()  # prefill everyone, then two decodes: the batch is all decodes from here
    torch.cuda.synchronize()
    if eng.batch_queue is not None:
        eng.batch_queue.executor.inline = launch == "inline"
    first = len(eng.step_times)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    times = sorted(list(eng.step_times)[first:], key=lambda t: t.device_start)
    events = [
        e
        for e in prof.events()
        if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start
    ]
    # a graph replay's kernels share its launch's correlation id (CUPTI); torch keeps it as `id`
    # and, on some versions, as linked_correlation_id: take whichever groups the kernels
    split = max(
        (
            idle_split([(e.time_range.start, e.time_range.end, key(e)) for e in events])
            | {"graph_key": name}
            for name, key in (
                ("id", lambda e: e.id),
                ("linked", lambda e: getattr(e, "linked_correlation_id", 0)),
            )
        ),
        key=lambda r: min(r["graph_replays"], steps + 1),
    )
    if host_profile:
        import cProfile
        import io
        import pstats

        with cProfile.Profile() as host:
            for _ in range(steps):
                eng.step()
            torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(host, stream=text).sort_stats("cumulative").print_stats(60)
        with open(host_profile, "w") as f:
            f.write(text.getvalue())
    for rid in list(eng.scheduler.requests):
        eng.abort_request(rid)
    eng.drain()
    eng.shutdown()
    del llm, eng
    free_gpu()
    return {
        "batch": batch,
        "async_scheduling": bool(config.get("async_scheduling")),
        "steps": steps,
        "ms_per_step": 1e3 * wall / steps,
        "device_idle_share": split["idle_us"] / split["window_us"],
        # issue 32's measure: idle between the steps' forward passes, not the graph's own gaps
        "idle_between_steps_share": split["idle_between_us"] / split["window_us"],
        "idle_in_graphs_share": split["idle_in_graphs_us"] / split["window_us"],
        "graph_replays": split["graph_replays"],
        "graph_key": split["graph_key"],
        "launch": launch if config.get("async_scheduling") else None,
        **host_side(times),
        "device": torch.cuda.get_device_name(),
    }


def host_side(times) -> dict:
    """Medians (ms) of a run's steps' host parts, and its late launches: steps whose work was
    still being queued when the step before's tokens had reached the host."""
    ms = lambda xs: round(1e3 * statistics.median(xs), 3) if xs else None
    lags = [b.queued - a.device_end for a, b in zip(times, times[1:])]
    late = [lag for lag in lags if lag > 0]
    return {
        "host_before_ms": ms([t.launch - t.schedule_start for t in times]),
        "launch_ms": ms([t.queued - t.device_start for t in times]),
        "host_after_ms": ms([t.outputs_end - t.outputs_start for t in times]),
        "tokens_to_host_ms": ms([t.device_end - t.queued for t in times]),
        "late_launches": f"{len(late)}/{len(lags)}",
        "late_by_ms": ms(late),
    }


def tier_overlap(
    model_path: str | None = None,
    *,
    dtype: str = "bfloat16",
    loaded=None,
    conversations: int = 24,
    history: int = 1024,
    turns: int = 3,
    answer: int = 32,
    message: int = 224,
    block_size: int = 256,
    device: str = "cuda",
) -> list[dict]:
    """The prefix cache's CPU tier on a GPU (issue 39): a multi-turn workload whose device pool
    holds about a third of the conversations' histories, run without the tier, with the tier's
    copies on their own stream (the default), and with them on the step's stream (as minicb copied
    until 2026-11-28). Each turn sends every conversation's history plus a new message, greedy;
    the rows give the wall time, the prompt tokens served from a cache and the bytes each way."""
    from ..model_executor.hf_config import kv_bytes_per_token
    from ..serve.metrics import engine_stats

    if device == "cuda":
        require_cuda("tier_overlap")
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    loaded = _load(model_path, loaded, dtype)
    final = history + (turns - 1) * (answer + message) + answer
    num_blocks = max(8, conversations * final // block_size // 3)
    # a tier that holds every conversation's history, with a fifth to spare
    per_token = kv_bytes_per_token(loaded.hf_config, getattr(torch, dtype))
    tier_gib = 1.2 * conversations * final * per_token / 2**30
    rows, first_answers = [], None
    for name in ("no tier", "tier, own stream", "tier, step's stream"):
        tier = {} if name == "no tier" else {"kv_offloading_size": tier_gib}
        llm = LLM.from_loaded(
            loaded,
            device=device,
            dtype=dtype,
            block_size=block_size,
            num_blocks=num_blocks,
            max_num_seqs=conversations,
            record_trace=False,
            **tier,
        )
        if name == "tier, step's stream":
            llm.engine.kv_cache.tier.stream = None
        rng = random.Random(0)
        chats = [
            [rng.randrange(loaded.vocab_size) for _ in range(history)] for _ in range(conversations)
        ]
        params = SamplingParams(max_tokens=answer, temperature=0.0, ignore_eos=True)
        answers, cached, prompt = [], 0, 0
        sync()
        t0 = time.perf_counter()
        for _ in range(turns):
            for i, out in enumerate(llm.generate(chats, params, use_tqdm=False)):
                answers.append(out.outputs[0].token_ids)
                cached += out.num_cached_tokens
                prompt += len(out.prompt_token_ids)
                chats[i] = chats[i] + out.outputs[0].token_ids
                chats[i] += [rng.randrange(loaded.vocab_size) for _ in range(message)]
        sync()
        seconds = time.perf_counter() - t0
        first_answers = first_answers or answers
        stats = engine_stats(llm.engine)
        rows.append(
            {
                "kind": "tier",
                "copies": name,
                "conversations": conversations,
                "turns": turns,
                "device_blocks": num_blocks,
                "block_size": block_size,
                "seconds": round(seconds, 3),
                "prompt_tokens": prompt,
                "cached_share": round(cached / prompt, 4),
                "bytes_to_cpu": stats.get("kv_offload_bytes_to_cpu", 0),
                "bytes_to_device": stats.get("kv_offload_bytes_to_device", 0),
                "answers_as_without_tier": sum(a == b for a, b in zip(answers, first_answers))
                / len(answers),
                "device": torch.cuda.get_device_name() if device == "cuda" else device,
            }
        )
        llm.engine.shutdown()
        del llm
        if device == "cuda":
            free_gpu()
    return rows
