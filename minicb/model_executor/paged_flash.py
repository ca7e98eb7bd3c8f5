"""Decode attention that reads the paged KV cache in place: one flash-attention problem per (row,
block) pair.

attention.decode_attention, the readable reference, first copies every row's blocks into one padded
rectangle (index_select), then attends with a mask. On an H100 that copy was 57% of a decode step's
GPU time at batch 256, and the whole layer read the K/V about 5x slower than the memory allows
(figures/gpu_h100_2026-11-23.md and .jsonl). No public PyTorch attention op takes a block table, but
the flash-attention kernel behind SDPA has a variable-length mode: the keys of "sequence" j are rows
cu_seq_k[j] .. cu_seq_k[j] + seqused_k[j] of one flat key tensor, and it returns each sequence's
output AND the log-sum-exp of its scores. That is enough to skip the copy:

  1. page_pairs      every (row i, block column j) is its own tiny problem: one query (row i's),
                     keys = block table[i, j] read where it lies in the flat cache, and as many of
                     its block_size tokens as row i really has there (0 for a column past its
                     context).
  2. the kernel      flash varlen over all B x W pairs at once (pairs_attention_flash on CUDA;
                     pairs_attention_reference is the same computation in plain PyTorch, for CPU
                     tests).
  3. combine_pairs   row i's answer is its W partial outputs weighted by each one's share of the
     softmax
                     mass, softmax over j of the log-sum-exps: exactly FlashDecoding's combine (see
                     flash_decoding.py, where it is derived and checked block by block).

Only queries are copied (W per row), never keys or values. Every shape comes from tensor shapes and
every index is computed on the device, so a CUDA graph can hold the whole of it; the pairs of a
graph's bucket are B x W, and the pairs past a row's context cost a launch that exits at once.
Where it runs (flash_pages_supported): CUDA GPUs from sm80 (A100, H100), float16/bfloat16, a cache
in the model's dtype (not fp8), no sliding window, head_dim <= 256. Elsewhere the padded gather
runs. The block size matters here: a pair per 16-token block makes tiny problems (4.2 ms per layer
on the H100 at W2's shape, slower than the gather); 256-token blocks (1,197 pairs) took 0.68 ms.
That is why block_size defaults to 256 on CUDA (config.py).
"""

from dataclasses import dataclass

import torch

from .hf_config import head_dim_of, sliding_window_of

FLASH_DTYPES = (torch.float16, torch.bfloat16)


@dataclass
class PagePairs:
    """The (row, block column) pairs of one decode step, row-major: pair p = i * W + j. Built once a
    step."""

    # (P + 1,) int32: pair p's keys start at flat cache row cu_seq_k[p]; last = cache rows
    cu_seq_k: torch.Tensor
    used: torch.Tensor  # (P,) int32: tokens of the block that belong to the row (0..block_size)
    cu_seq_q: torch.Tensor  # (P + 1,) int32: 0, 1, 2, ...: one query per pair
    rows: int  # B
    width: int  # W: block-table columns per row
    kernel: object  # pairs_attention_flash on CUDA, pairs_attention_reference elsewhere (CPU tests)


def page_pairs(block_tables, context_lens, block_size: int, num_locations: int) -> PagePairs:
    """block_tables: (B, W) int64, context_lens: (B,) int64 -> the B x W pairs. Device ops only."""
    rows, width = block_tables.shape
    # (W,) of column j's block
    first_token = torch.arange(width, device=block_tables.device) * block_size
    # (B, W): tokens of row i in column j
    used = (context_lens[:, None] - first_token).clamp(0, block_size)
    starts = (block_tables * block_size).reshape(-1)  # (P,) the block's first row in the flat cache
    end = torch.full((1,), num_locations, dtype=starts.dtype, device=starts.device)
    cu_seq_q = torch.arange(rows * width + 1, dtype=torch.int32, device=block_tables.device)
    kernel = (
        pairs_attention_flash if block_tables.device.type == "cuda" else pairs_attention_reference
    )
    return PagePairs(
        torch.cat([starts, end]).to(torch.int32),
        used.reshape(-1).to(torch.int32),
        cu_seq_q,
        rows,
        width,
        kernel,
    )


def pairs_attention_reference(
    q_pairs, k_flat, v_flat, pairs: PagePairs, block_size: int, scale: float
):
    """What the flash kernel computes, in plain PyTorch. q_pairs: (P, H, D); k_flat, v_flat: (L, KV,
    D). Returns (out (P, H, D), lse (H, P) float32, float64 for float64 inputs). A pair with no
    tokens gets out 0 and lse +inf, as the kernel's early exit writes them: combine_pairs must never
    trust those."""
    num_pairs, num_heads, head_dim = q_pairs.shape
    kv_heads = k_flat.shape[1]
    # (P, bs)
    idx = pairs.cu_seq_k[:-1, None].long() + torch.arange(block_size, device=q_pairs.device)
    # a block's last rows may lie past the cache when unused
    idx = idx.clamp(max=k_flat.shape[0] - 1)
    keys, values = k_flat[idx], v_flat[idx]  # (P, bs, KV, D): a copy, fine for a reference
    # the kernel accumulates in float32
    acc = torch.float64 if q_pairs.dtype == torch.float64 else torch.float32
    q = q_pairs.view(num_pairs, kv_heads, num_heads // kv_heads, head_dim)  # (P, KV, group, D)
    scores = torch.einsum("pkgd,ptkd->pkgt", q.to(acc), keys.to(acc)) * scale  # (P, KV, group, bs)
    valid = torch.arange(block_size, device=q_pairs.device) < pairs.used[:, None]  # (P, bs)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (P, KV, group), -inf for an empty pair
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("pkgt,ptkd->pkgd", probs, values.to(acc)).reshape(
        num_pairs, num_heads, head_dim
    )
    lse = lse.reshape(num_pairs, num_heads).masked_fill(pairs.used[:, None] == 0, float("inf"))
    return out.to(q_pairs.dtype), lse.t().contiguous()


def pairs_attention_flash(q_pairs, k_flat, v_flat, pairs: PagePairs, block_size: int, scale: float):
    """The same through PyTorch's flash-attention kernel (varlen mode, keys in place, GQA
    native)."""
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q_pairs,
        k_flat,
        v_flat,
        pairs.cu_seq_q,
        pairs.cu_seq_k,
        1,
        block_size,
        0.0,
        False,
        False,
        scale=scale,
        seqused_k=pairs.used,
    )
    # lse: (H, P), one per head and pair
    return out, lse.reshape(q_pairs.shape[1], q_pairs.shape[0])


def combine_pairs(out, lse, pairs: PagePairs):
    """(P, H, D) partial outputs + (H, P) log-sum-exps -> (B, H, D): each row's exact attention
    output."""
    num_heads, head_dim = out.shape[1:]
    lse = lse.t().reshape(pairs.rows, pairs.width, num_heads)  # (B, W, H)
    empty = (pairs.used == 0).view(pairs.rows, pairs.width, 1)
    acc = torch.float64 if out.dtype == torch.float64 else torch.float32
    # (B, W, H): share of the mass
    weights = torch.softmax(lse.to(acc).masked_fill(empty, float("-inf")), dim=1)
    parts = out.view(pairs.rows, pairs.width, num_heads, head_dim).to(acc)
    return (weights[..., None] * parts).sum(dim=1).to(out.dtype)  # (B, H, D)


def flash_pages_attention(q, k_cache, v_cache, pairs: PagePairs, scale: float):
    """Decode attention over the paged cache with no gather. q: (B, H, D); caches (num_blocks + 1,
    bs, KV, D). Returns (B, H, D)."""
    batch, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    q_pairs = (
        q[:, None].expand(batch, pairs.width, num_heads, head_dim).reshape(-1, num_heads, head_dim)
    )
    out, lse = pairs.kernel(
        q_pairs,
        k_cache.view(-1, kv_heads, head_dim),
        v_cache.view(-1, kv_heads, head_dim),
        pairs,
        block_size,
        scale,
    )
    return combine_pairs(out, lse, pairs)


def flash_pages_supported(
    device, dtype, head_dim: int, quantized: bool, sliding_window
) -> str | None:
    """None when flash pages can run here, else why not (the padded gather runs instead). On CPU it
    runs only when asked for (attention_backend="flash_pages"), through
    pairs_attention_reference."""
    device = torch.device(device)
    if quantized:
        return "the KV cache is quantized (fp8): the kernel reads only the model's dtype"
    if sliding_window is not None:
        return "the model uses a sliding window"
    if device.type != "cuda":
        return None
    if dtype not in FLASH_DTYPES:
        return f"dtype {dtype} (flash attention takes float16 and bfloat16)"
    if head_dim > 256 or head_dim % 8:
        return f"head_dim {head_dim} (flash attention takes multiples of 8 up to 256)"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "the GPU is older than sm80 (no flash attention)"
    if "seqused_k" not in str(torch.ops.aten._flash_attention_forward.default._schema):
        return f"torch {torch.__version__} has no seqused_k in its flash-attention op"
    return None


def choose_attention_backend(config, hf_config, quantized: bool) -> str:
    """ "gather" or "flash_pages" from config.attention_backend ("auto": flash_pages on CUDA where
    it runs)."""
    if config.attention_backend == "gather":
        return "gather"
    windows = {sliding_window_of(hf_config, i) for i in range(hf_config.num_hidden_layers)} - {None}
    why = flash_pages_supported(
        config.device,
        getattr(torch, config.dtype),
        head_dim_of(hf_config),
        quantized,
        next(iter(windows), None),
    )
    if config.attention_backend == "flash_pages" and why is not None:
        raise ValueError(
            f"attention_backend='flash_pages' cannot run here: {why}; use 'auto' or 'gather'"
        )
    return (
        "flash_pages"
        if why is None
        and (
            config.attention_backend == "flash_pages" or torch.device(config.device).type == "cuda"
        )
        else "gather"
    )
