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
graph's bucket are B x W, and the pairs past a row's context cost a launch that exits at once. Where
it runs (flash_pages_supported): CUDA GPUs from sm80 (A100, H100), float16/bfloat16, a cache in the
model's dtype (not fp8), head_dim <= 256. Elsewhere the padded gather runs. The block size matters
here: a pair per 16-token block makes tiny problems (4.2 ms per layer on the H100 at W2's shape,
slower than the gather); 256-token blocks (1,197 pairs) took 0.68 ms. That is why block_size
defaults to 256 on CUDA (config.py).

Rows of several queries (a decode row verifying k drafts: vLLM V1 verifies its 1 + k tokens as one
row). Keys of a block that every query of the row may see need no mask, so a (row, block) pair
holds all Q of the row's query slots, over only the tokens cached BEFORE this step (used = context
- query_len), non-causal: the cache is still read once per row. The row's own new tokens, which its
queries see causally, are one more small problem per row, read from this step's K/V where the model
computed them (chunk_attention_*: flash varlen with is_causal, square per row). The combine then
weighs each query's W pair partials and its own-chunk partial by their log-sum-exps. A row shorter
than Q (a batch of mixed draft counts) sits right-aligned in its Q slots; the leading slots are
computed and dropped.

A sliding window of W (Mistral, Gemma 3's local layers, gpt-oss): a row's query, the token at
context - 1, sees the keys from context - W on. In each pair, the block's tokens before that are
skipped by starting its keys later in the flat cache (cu_seq_k) and using fewer of them (used); a
block wholly before the window, freed or not, becomes an empty pair. Pages carry the window they
were built for, and a layer with another window (a model whose hybrid KV cache manager is disabled)
reads through the gather. Rows of several queries see windows that start at different tokens, which
one range per pair cannot say: a windowed group's verify rows read through the gather too.

Attention sinks (gpt-oss): a learned logit per head that takes a share of the softmax mass and gives
no value. In the combine it is one more partial, of log-sum-exp = the sink and output 0.
"""

from dataclasses import dataclass

import torch

from .hf_config import head_dim_of

FLASH_DTYPES = (torch.float16, torch.bfloat16)


@dataclass
class PagePairs:
    """The (row, block column) pairs of one decode step, row-major: pair p = i * W + j. Built once a
    step."""

    # (P + 1,) int32: pair p's keys start at flat cache row cu_seq_k[p]; last = cache rows
    cu_seq_k: torch.Tensor
    used: torch.Tensor  # (P,) int32: tokens of the block that belong to the row (0..block_size)
    cu_seq_q: torch.Tensor  # (P + 1,) int32: 0, Q, 2Q, ...: Q query slots per pair
    rows: int  # B
    width: int  # W: block-table columns per row
    kernel: object  # pairs_attention_flash on CUDA, pairs_attention_reference elsewhere (CPU tests)
    queries: int = 1  # Q: query slots per row (1 + k for rows verifying k drafts)
    # Q > 1 only: (B + 1,) int32 cumulative query lengths of the rows (their own new tokens)
    cu_seq_new: torch.Tensor | None = None
    # Q > 1 only: (tokens,) int64 each token's slot in the (B * Q) layout, None when all rows have Q
    slots: torch.Tensor | None = None
    chunk_kernel: object = None  # chunk_attention_flash on CUDA, chunk_attention_reference else
    window: int | None = None  # the sliding window the pairs were cut to (None: full attention)


def page_pairs(
    block_tables,
    context_lens,
    block_size: int,
    num_locations: int,
    query_len: int = 1,
    query_start_loc=None,
    slots=None,
    sliding_window: int | None = None,
) -> PagePairs:
    """block_tables: (B, W) int64, context_lens: (B,) int64 -> the B x W pairs. Device ops only.
    Rows of up to query_len > 1 queries also need query_start_loc, (B + 1,) their cumulative query
    lengths, and slots (AttentionMetadata.decode_slots): the pairs then cover the tokens cached
    before this step, and the rows' own tokens are attended apart (the module docstring). With a
    sliding_window (rows of one query only), each pair keeps only its block's tokens in the
    window."""
    if sliding_window is not None and query_len > 1:
        raise ValueError("a sliding window's pairs are for rows of one query: use the gather")
    rows, width = block_tables.shape
    device = block_tables.device
    # (W,) of column j's block
    first_token = torch.arange(width, device=device) * block_size
    cached = context_lens
    if query_len > 1:  # the pairs hold the keys every query of the row sees
        cached = context_lens - (query_start_loc[1:] - query_start_loc[:-1])
    # (B, W): tokens of row i in column j
    used = (cached[:, None] - first_token).clamp(0, block_size)
    starts = block_tables * block_size  # (B, W) the block's first row in the flat cache
    if sliding_window is not None:  # (B, W): the block's tokens before context - W
        skip = (cached[:, None] - sliding_window - first_token).clamp(0, block_size)
        used, starts = (used - skip).clamp(min=0), starts + skip
    starts = starts.reshape(-1)
    end = torch.full((1,), num_locations, dtype=starts.dtype, device=starts.device)
    cu_seq_q = torch.arange(rows * width + 1, dtype=torch.int32, device=device) * query_len
    on_cuda = device.type == "cuda"
    return PagePairs(
        torch.cat([starts, end]).to(torch.int32),
        used.reshape(-1).to(torch.int32),
        cu_seq_q,
        rows,
        width,
        pairs_attention_flash if on_cuda else pairs_attention_reference,
        query_len,
        None if query_len == 1 else query_start_loc.to(torch.int32),
        slots,
        chunk_attention_flash if on_cuda else chunk_attention_reference,
        sliding_window,
    )


def decode_pages(meta, block_size: int, num_locations: int, window=None) -> PagePairs | None:
    """The decode rows of `meta` (an AttentionMetadata, one KV cache group's) as (row, block) pairs
    cut to the group's `window`; None for a windowed group with rows of several queries, which read
    through the gather (the module docstring)."""
    nd = meta.num_decodes
    if window is not None and meta.decode_query_len > 1:
        return None
    return page_pairs(
        meta.block_tables[:nd],
        meta.context_lens[:nd],
        block_size,
        num_locations,
        meta.decode_query_len,
        meta.query_start_loc[: nd + 1],
        meta.decode_slots,
        window,
    )


def pairs_attention_reference(
    q_pairs, k_flat, v_flat, pairs: PagePairs, block_size: int, scale: float
):
    """What the flash kernel computes, in plain PyTorch. q_pairs: (P * Q, H, D), pair p's Q queries
    at rows p * Q .. p * Q + Q - 1; k_flat, v_flat: (L, KV, D). Returns (out (P * Q, H, D), lse
    (H, P * Q) float32, float64 for float64 inputs). A pair with no tokens gets out 0 and lse +inf,
    as the kernel's early exit writes them: combine_pairs must never trust those."""
    num_pairs = pairs.used.shape[0]
    num_slots, num_heads, head_dim = q_pairs.shape
    queries = num_slots // num_pairs
    kv_heads = k_flat.shape[1]
    # (P, bs)
    idx = pairs.cu_seq_k[:-1, None].long() + torch.arange(block_size, device=q_pairs.device)
    # a block's last rows may lie past the cache when unused
    idx = idx.clamp(max=k_flat.shape[0] - 1)
    keys, values = k_flat[idx], v_flat[idx]  # (P, bs, KV, D): a copy, fine for a reference
    # the kernel accumulates in float32
    acc = torch.float64 if q_pairs.dtype == torch.float64 else torch.float32
    # (P, KV, Q * group, D): a pair's queries, the heads of one kv head each
    q = q_pairs.view(num_pairs, queries, kv_heads, num_heads // kv_heads, head_dim)
    q = q.transpose(1, 2).reshape(num_pairs, kv_heads, -1, head_dim)
    scores = torch.einsum("pkgd,ptkd->pkgt", q.to(acc), keys.to(acc)) * scale  # (P, KV, Q*g, bs)
    valid = torch.arange(block_size, device=q_pairs.device) < pairs.used[:, None]  # (P, bs)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (P, KV, Q * group), -inf for an empty pair
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("pkgt,ptkd->pkgd", probs, values.to(acc))  # (P, KV, Q * group, D)
    out = out.view(num_pairs, kv_heads, queries, -1, head_dim).transpose(1, 2)
    out = out.reshape(num_slots, num_heads, head_dim)
    lse = lse.view(num_pairs, kv_heads, queries, -1).transpose(1, 2).reshape(num_slots, num_heads)
    empty = (pairs.used == 0)[:, None].expand(num_pairs, queries).reshape(-1, 1)  # (P * Q, 1)
    lse = lse.masked_fill(empty, float("inf"))
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
        pairs.queries,
        block_size,
        0.0,
        False,
        False,
        scale=scale,
        seqused_k=pairs.used,
    )
    # lse: (H, P * Q), one per head and query slot
    return out, lse.reshape(q_pairs.shape[1], q_pairs.shape[0])


def chunk_attention_reference(q, k, v, cu_seq, max_len: int, scale: float):
    """Each row's new tokens attending causally to each other, in plain PyTorch: q (T, H, D), k, v
    (T, KV, D), row r's tokens at cu_seq[r] .. cu_seq[r + 1] - 1 (at most max_len). Returns (out (T,
    H, D), lse (H, T)), as chunk_attention_flash. Device ops only."""
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    tokens = torch.arange(num_tokens, device=q.device)
    row = torch.bucketize(tokens, cu_seq[1:].long(), right=True)  # (T,)
    first = cu_seq[:-1].long()[row]  # (T,): the row's first token
    offsets = torch.arange(max_len, device=q.device)
    idx = (first[:, None] + offsets).clamp(max=num_tokens - 1)  # (T, max_len): candidate keys
    allowed = first[:, None] + offsets <= tokens[:, None]  # its row's tokens up to itself
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    rows = q.view(num_tokens, kv_heads, num_heads // kv_heads, head_dim).to(acc)
    scores = torch.einsum("tkgd,tskd->tkgs", rows, k[idx].to(acc)) * scale
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (T, KV, group): finite, a token sees itself
    out = torch.einsum("tkgs,tskd->tkgd", torch.exp(scores - lse[..., None]), v[idx].to(acc))
    out = out.reshape(num_tokens, num_heads, head_dim).to(q.dtype)
    return out, lse.reshape(num_tokens, num_heads).t().contiguous()


def chunk_attention_flash(q, k, v, cu_seq, max_len: int, scale: float):
    """The same through the flash kernel: varlen, causal (square per row, so top-left and
    bottom-right alignment agree)."""
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seq, cu_seq, max_len, max_len, 0.0, True, False, scale=scale
    )
    return out, lse.reshape(q.shape[1], q.shape[0])


def combine_pairs(out, lse, pairs: PagePairs, sinks=None):
    """(P, H, D) partial outputs + (H, P) log-sum-exps -> (B, H, D): each row's exact attention
    output (rows of one query). sinks: (H,) attention sinks' logits, or None."""
    num_heads, head_dim = out.shape[1:]
    lse = lse.t().reshape(pairs.rows, pairs.width, num_heads)  # (B, W, H)
    empty = (pairs.used == 0).view(pairs.rows, pairs.width, 1)
    acc = torch.float64 if out.dtype == torch.float64 else torch.float32
    lse = lse.to(acc).masked_fill(empty, float("-inf"))
    parts = out.view(pairs.rows, pairs.width, num_heads, head_dim).to(acc)
    return _weigh(lse, parts, sinks).to(out.dtype)  # (B, H, D)


def _weigh(lse, parts, sinks):
    """Partials (N, W, H, D) weighed by their share of the softmax mass, lse (N, W, H); a sink is
    one more partial, of output 0."""
    if sinks is not None:
        lse = torch.cat([lse, sinks.to(lse.dtype).expand(lse.shape[0], 1, -1)], dim=1)
        parts = torch.cat([parts, parts.new_zeros(parts.shape[0], 1, *parts.shape[2:])], dim=1)
    weights = torch.softmax(lse, dim=1)  # (N, W, H): share of the mass
    return (weights[..., None] * parts).sum(dim=1)


def flash_pages_attention(
    q, k_cache, v_cache, pairs: PagePairs, scale: float, k=None, v=None, sinks=None
):
    """Decode attention over the paged cache with no gather. q: (tokens, H, D), the decode rows'
    tokens (one per row when pairs.queries is 1); caches (num_blocks + 1, bs, KV, D); k, v: (tokens
    or more, KV, D), this step's keys and values (needed for rows of several queries); sinks: (H,)
    attention sinks' logits, or None. Returns (tokens, H, D)."""
    if pairs.queries > 1:
        return _multi_query_pages(q, k_cache, v_cache, pairs, scale, k, v, sinks)
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
    return combine_pairs(out, lse, pairs, sinks)


def _multi_query_pages(q, k_cache, v_cache, pairs: PagePairs, scale: float, k, v, sinks=None):
    """flash_pages_attention for rows of up to Q = pairs.queries tokens: the cached prefix through
    the (row, block) pairs, the rows' own tokens through the causal chunk kernel, then per token the
    combine over W + 1 partials."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    rows, width, slots = pairs.rows, pairs.width, pairs.queries
    padded = q  # (B * Q, H, D): rows right-aligned in their Q slots
    if pairs.slots is not None:
        padded = q.new_zeros(rows * slots, num_heads, head_dim).index_copy_(0, pairs.slots, q)
    q_pairs = padded.view(rows, 1, slots, num_heads, head_dim).expand(
        rows, width, slots, num_heads, head_dim
    )
    out, lse = pairs.kernel(
        q_pairs.reshape(-1, num_heads, head_dim),
        k_cache.view(-1, kv_heads, head_dim),
        v_cache.view(-1, kv_heads, head_dim),
        pairs,
        block_size,
        scale,
    )
    # (B, W, Q, ...) -> per query slot (B * Q, W, ...), then the real tokens only
    out = out.view(rows, width, slots, num_heads, head_dim).transpose(1, 2)
    out = out.reshape(rows * slots, width, num_heads, head_dim)
    lse = lse.t().reshape(rows, width, slots, num_heads).transpose(1, 2)
    lse = lse.reshape(rows * slots, width, num_heads)
    empty = (pairs.used == 0).view(rows, 1, width).expand(rows, slots, width)
    empty = empty.reshape(rows * slots, width)
    if pairs.slots is not None:
        out = out.index_select(0, pairs.slots)
        lse = lse.index_select(0, pairs.slots)
        empty = empty.index_select(0, pairs.slots)
    # the rows' own tokens, from this step's K/V (the kernel wants them contiguous)
    own_k, own_v = k[:num_tokens].contiguous(), v[:num_tokens].contiguous()
    own, own_lse = pairs.chunk_kernel(q.contiguous(), own_k, own_v, pairs.cu_seq_new, slots, scale)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    # (tokens, W + 1, H): each partial's share of the mass; the own chunk is never empty
    lse = torch.cat(
        [lse.to(acc).masked_fill(empty[..., None], float("-inf")), own_lse.t()[:, None].to(acc)],
        dim=1,
    )
    parts = torch.cat([out, own[:, None]], dim=1).to(acc)  # (tokens, W + 1, H, D)
    return _weigh(lse, parts, sinks).to(q.dtype)


def flash_pages_supported(device, dtype, head_dim: int, quantized: bool) -> str | None:
    """None when flash pages can run here, else why not (the padded gather runs instead). On CPU it
    runs only when asked for (attention_backend="flash_pages"), through
    pairs_attention_reference."""
    device = torch.device(device)
    if quantized:
        return "the KV cache is quantized (fp8): the kernel reads only the model's dtype"
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
    why = flash_pages_supported(
        config.device, getattr(torch, config.dtype), head_dim_of(hf_config), quantized
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
