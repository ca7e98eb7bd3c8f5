"""The bound of a workload on this machine: how fast could any system run it here?

Two floors, each measured on the machine the benchmark runs on, and the workload cannot run faster
than the larger of them:

  compute floor     every FLOP the workload needs, over the best float32 GEMM speed measured here
                    (cpu_kernels.gemm_peaks: the faster of torch.matmul and oneDNN's packed GEMM).
  sequential floor  the longest request needs one forward pass per output token (its prefill, then
                    one decode step per further token), one after the other, and each pass reads
                    every weight once: output tokens x weight bytes / the memory bandwidth measured
                    here. No batching shortens that chain (only speculative decoding does, which W1
                    does not use).

FLOPs, counted exactly for a Llama-family decoder (non-embedding params N, LM head params H, per
layer h query heads of d dims): every prompt token and every output token but the last passes
through the layers (2N each), every output token comes out of the LM head (2H each: the first from
the prompt's last position), and attention adds 4 h d FLOPs per layer per (query, key) pair it
scores: QK^T and the weighted sum of V, each 2 h d, at the real context length of each token (a
prompt token at position j scores j + 1 keys). Padding, masks and recomputation are not work the
workload needs, so they count in no floor.
"""


def memory_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: the best of a few sums over a float32 array much larger than any
    cache."""
    import torch

    from ..model_executor.cpu_kernels import best_time

    x = torch.ones(nbytes // 4)
    return nbytes / best_time(x.sum, runs=repeats)  # its warm-up touches every page first


def model_sizes(loaded, bytes_per_weight: float = 4) -> dict[str, int]:
    """What the FLOPs need, from a LoadedModel's weights: non-embedding parameters (layers and final
    norm), LM head parameters, layers, and the width of attention (query heads x head dim); and the
    bytes one forward pass reads at `bytes_per_weight` (4 float32, 2 bfloat16, 1 int8)."""
    cfg = loaded.hf_config
    non_embedding = sum(
        t.numel()
        for name, t in loaded.state_dict.items()
        if "embed_tokens" not in name and "lm_head" not in name and "rotary_emb" not in name
    )
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    # tied or not: one read
    return dict(
        non_embedding=non_embedding,
        lm_head=cfg.vocab_size * cfg.hidden_size,
        layers=cfg.num_hidden_layers,
        attention_width=heads * head_dim,
        weight_bytes=int((non_embedding + cfg.vocab_size * cfg.hidden_size) * bytes_per_weight),
    )


def workload_flops(loaded, prompt_lens: list[int], output_lens: list[int]) -> dict[str, float]:
    """FLOPs of the workload, split as the module's docstring counts them."""
    m = model_sizes(loaded)
    fed = sum(prompt_lens) + sum(output_lens) - len(output_lens)  # tokens through the layers
    # (query, key) pairs: a request whose prompt has p tokens and whose output has o feeds positions
    # 0 .. p + o - 2, and position j scores j + 1 keys: the sum 1 + 2 + ... + (p + o - 1)
    pairs = sum((p + o - 1) * (p + o) // 2 for p, o in zip(prompt_lens, output_lens))
    parts = dict(
        layers=2 * m["non_embedding"] * fed,
        lm_head=2 * m["lm_head"] * sum(output_lens),
        attention=4 * m["attention_width"] * m["layers"] * pairs,
    )
    return parts | {"total": sum(parts.values())}


def workload_floor(
    loaded, prompt_lens, output_lens, gemm_peak_flops: float, bandwidth: float, bytes_per_weight=4
) -> dict:
    """Both floors in seconds, and which one binds, for weights of `bytes_per_weight` bytes (4:
    float32, as W1 runs by default) multiplied at `gemm_peak_flops`."""
    flops, weight_nbytes = (
        workload_flops(loaded, prompt_lens, output_lens),
        model_sizes(loaded, bytes_per_weight)["weight_bytes"],
    )
    compute = flops["total"] / gemm_peak_flops
    sequential = max(output_lens) * weight_nbytes / bandwidth
    return dict(
        flops=flops,
        compute_s=compute,
        sequential_s=sequential,
        floor_s=max(compute, sequential),
        binding="compute" if compute >= sequential else "sequential",
        longest_output=max(output_lens),
        weight_bytes=weight_nbytes,
        bandwidth=bandwidth,
        gemm_peak_flops=gemm_peak_flops,
    )


# ------------------------------------------------------------------------------- the kernels' floor
# The two floors above assume the GEMM runs at its best square-matrix speed at every batch size. The
# linears of a decode step are skinny products (a few rows against every weight), which no library
# runs at that speed. The kernels' floor prices the workload's own products on the kernels the model
# really calls, timed here: it says how much of the floor is reachable by any system calling them.
# batch sizes at which one pass through the linears is timed
PASS_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def workload_passes(
    prompt_lens: list[int], output_lens: list[int], chunk: int = 512
) -> list[tuple[int, int]]:
    """The workload's forward passes batched as fully as it allows, as (rows through the layers,
    rows through the LM head): every prompt token in passes of `chunk` tokens (their requests' first
    tokens from one LM head call of one row per request), then decode step s = 1, 2, ... holding
    every request that still has more than s tokens to produce: the fullest batches with every
    prompt before any decode. (A scheduler may arrange the same rows otherwise:
    other_arrangements.)"""
    total = sum(prompt_lens)
    passes = [(min(chunk, total - start), 0) for start in range(0, total, chunk)]
    passes[-1] = (passes[-1][0], len(prompt_lens))
    for s in range(1, max(output_lens)):
        rows = sum(o > s for o in output_lens)
        passes.append((rows, rows))
    return passes


def interpolate(points: dict[int, float], x: float) -> float:
    """Piecewise-linear through (rows, seconds) points; beyond the last, in proportion to rows."""
    xs = sorted(points)
    if x >= xs[-1]:
        return points[xs[-1]] * x / xs[-1]
    lo = max((p for p in xs if p <= x), default=xs[0])
    hi = min(p for p in xs if p >= x)
    return points[lo] if hi == lo else points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)


def time_linear_passes(model, rows=PASS_ROWS, runs: int = 3) -> dict[str, dict[int, float]]:
    """Seconds of one pass through the model's linears, as it calls them (each on the kernel chosen
    for it), at each number of rows: "layers" every linear of every layer in order (the weights
    stream from memory as in a forward pass), "lm_head" the LM head alone."""
    import torch

    from ..model_executor.cpu_kernels import best_time

    head = model.lm_head
    linears = [m for m in model.modules() if hasattr(m, "in_features") and m is not head]
    times = {"layers": {}, "lm_head": {}}
    dtype = model.norm.weight.dtype  # the activations' dtype, whatever the linears store
    with torch.inference_mode():
        for n in rows:
            inputs = {
                m.in_features: torch.randn(n, m.in_features, dtype=dtype) for m in (*linears, head)
            }
            times["layers"][n] = best_time(
                lambda: [m(inputs[m.in_features]) for m in linears], runs=runs
            )
            times["lm_head"][n] = best_time(lambda: head(inputs[head.in_features]), runs=runs)
    return times


def kernel_floor(
    passes: list[tuple[int, int]], times: dict[str, dict[int, float]], chain: int
) -> dict:
    """The linears' time of `passes` (workload_passes) at the measured per-pass times
    (time_linear_passes), and of the same rows in two other arrangements over the `chain` passes of
    the longest request."""
    layers = sum(interpolate(times["layers"], n) for n, _ in passes if n)
    head = sum(interpolate(times["lm_head"], n) for _, n in passes if n)
    return dict(
        kernel_s=layers + head,
        layers_s=layers,
        lm_head_s=head,
        passes=len(passes),
        times=times,
        other=other_arrangements(passes, times, chain),
    )


def other_arrangements(
    passes: list[tuple[int, int]], times: dict[str, dict[int, float]], chain: int
) -> dict:
    """The same rows over the `chain` passes the longest request needs one after another (its
    prefill, then one decode step per further token: as many as its output tokens), arranged at the
    two extremes a scheduler could choose instead of the fullest batches, for example by holding
    short requests back into the tail, where a pass is bound by reading the weights: "tail", one row
    in every pass of the chain but the first and every other row in passes as large as the largest
    timed; "even", every row spread evenly over the chain. Estimates of what any schedule could do
    with these kernels, not proofs: the measured times are neither convex nor concave in the
    rows."""
    rows, head_rows = sum(n for n, _ in passes), sum(h for _, h in passes)
    layers, head = (
        (lambda n: interpolate(times["layers"], n)),
        (lambda n: interpolate(times["lm_head"], n)),
    )
    largest = max(times["layers"])
    tail = (
        (chain - 1) * (layers(1) + head(1))
        + (rows - chain + 1) / largest * layers(largest)
        + (head_rows - chain + 1) / largest * head(largest)
    )
    even = chain * (layers(rows / chain) + head(head_rows / chain))
    return dict(chain=chain, tail_s=tail, even_s=even)
