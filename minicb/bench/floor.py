"""The bound of a workload on this machine: how fast could any system run it here?

Two floors, each measured on the machine the benchmark runs on, and the workload cannot run faster
than the larger of them:

  compute floor     every FLOP the workload needs, over the best float32 GEMM speed measured here
                    (cpu_kernels.gemm_peaks: the faster of torch.matmul and oneDNN's packed GEMM).
  sequential floor  the longest request needs one forward pass per output token (its prefill, then
                    one decode step per further token), one after the other, and each pass reads
                    every weight once: output tokens x weight bytes / the memory bandwidth measured here.
                    No batching shortens that chain (only speculative decoding does, which W1 does not use).

FLOPs, counted exactly for a Llama-family decoder (non-embedding params N, LM head params H, per
layer h query heads of d dims): every prompt token and every output token but the last passes
through the layers (2N each), every output token comes out of the LM head (2H each: the first from
the prompt's last position), and attention adds 4 h d FLOPs per layer per (query, key) pair it
scores: QK^T and the weighted sum of V, each 2 h d, at the real context length of each token (a
prompt token at position j scores j + 1 keys). Padding, masks and recomputation are not work the
workload needs, so they count in no floor.
"""


def memory_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: the best of a few sums over a float32 array much larger than any cache."""
    import torch

    from ..cpu_kernels import best_time

    x = torch.ones(nbytes // 4)
    return nbytes / best_time(x.sum, runs=repeats)  # its warm-up touches every page first


def model_sizes(loaded) -> dict[str, int]:
    """What the FLOPs need, from a LoadedModel's weights: non-embedding parameters (layers and final
    norm), LM head parameters, layers, and the width of attention (query heads x head dim)."""
    cfg = loaded.hf_config
    non_embedding = sum(t.numel() for name, t in loaded.state_dict.items()
                        if "embed_tokens" not in name and "lm_head" not in name and "rotary_emb" not in name)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return dict(non_embedding=non_embedding, lm_head=cfg.vocab_size * cfg.hidden_size,
                layers=cfg.num_hidden_layers, attention_width=heads * head_dim,
                weight_bytes=(non_embedding + cfg.vocab_size * cfg.hidden_size) * 4)  # float32, tied or not: one read


def workload_flops(loaded, prompt_lens: list[int], output_lens: list[int]) -> dict[str, float]:
    """FLOPs of the workload, split as the module's docstring counts them."""
    m = model_sizes(loaded)
    fed = sum(prompt_lens) + sum(output_lens) - len(output_lens)  # tokens through the layers
    # (query, key) pairs: a request whose prompt has p tokens and whose output has o feeds positions
    # 0 .. p + o - 2, and position j scores j + 1 keys: the sum 1 + 2 + ... + (p + o - 1)
    pairs = sum((p + o - 1) * (p + o) // 2 for p, o in zip(prompt_lens, output_lens))
    parts = dict(layers=2 * m["non_embedding"] * fed, lm_head=2 * m["lm_head"] * sum(output_lens),
                 attention=4 * m["attention_width"] * m["layers"] * pairs)
    return parts | {"total": sum(parts.values())}


def workload_floor(loaded, prompt_lens, output_lens, gemm_peak_flops: float, bandwidth: float) -> dict:
    """Both floors in seconds, and which one binds (float32 weights, as W1 runs)."""
    flops, weight_nbytes = workload_flops(loaded, prompt_lens, output_lens), model_sizes(loaded)["weight_bytes"]
    compute = flops["total"] / gemm_peak_flops
    sequential = max(output_lens) * weight_nbytes / bandwidth
    return dict(flops=flops, compute_s=compute, sequential_s=sequential, floor_s=max(compute, sequential),
                binding="compute" if compute >= sequential else "sequential", longest_output=max(output_lens),
                weight_bytes=weight_nbytes, bandwidth=bandwidth, gemm_peak_flops=gemm_peak_flops)
