"""Paged attention in plain PyTorch (no Triton, no custom kernels).

Idea (PagedAttention, Kwon et al., SOSP 2023): a sequence's keys and values live in
blocks scattered over the KV cache; its block_table lists them in order. Three steps:

  store_kv           write this step's K/V to their cache locations (cache_locs), one index_copy_
  decode_attention   a few queries per sequence (a decode's one, or a speculative row's 1 + k):
                     gather the blocks of every table once, mask the positions each query may
                     not see, attend. Fixed shapes, so it can be captured in a CUDA graph.
  prefill_attention  a chunk of queries per sequence (chunked prefill, Sarathi,
                     Agrawal et al. 2023): attend causally to the cached prefix + the chunk.

One flat batch mixes both: the first `num_decodes` sequences are decodes, the rest are prefill
chunks. A decode row has 1 query token, or 1 + k when it verifies k speculative drafts: as in
vLLM V1 (an attention backend's `reorder_batch_threshold`, `split_decodes_and_prefills`), such a
row is still a decode, ONE row whose tokens attend causally within it and to its cache, which is
read once for all of them. Grouped-query attention (Ainslie et al., 2023): `group` query heads
share one kv head; we reshape the queries instead of copying K/V `group` times. gpt-oss's attention
sinks (`sinks`, one logit per query head in every softmax) take every path: attention_sinks.py.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import cdiv
from .attention_sinks import sdpa_with_sinks, sink_rows
from .cpu_attention import masked_chunk_attention
from .paged_flash import flash_pages_attention
from .ragged_attention import grouped_decode_attention


def to_device(values, device, dtype=torch.long) -> torch.Tensor:
    """A host list as a tensor on `device`, without making the host wait (vLLM's async_tensor_h2d).
    torch.tensor(values, device="cuda") copies from pageable memory and then synchronizes the
    stream: the host waits for every kernel queued before, so with async scheduling the inputs of
    step N+1 could not be built while step N runs. A copy from pinned memory joins the stream's
    queue instead, and torch's pinned-memory cache keeps that buffer until the copy has run."""
    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


# where prefill_attention passes is_causal rather than a mask (tests add "cpu")
CAUSAL_FLASH_DEVICES = ("cuda",)


def cache_locations(block_tables, context_lens, query_lens, block_size: int) -> list[int]:
    """Where each new token's K/V goes: position p of a sequence lives in block table[p //
    block_size] at offset p % block_size, i.e. at cache location block_id * block_size + offset. The
    new tokens of a sequence are its last query_len ones."""
    return [
        table[pos // block_size] * block_size + pos % block_size
        for table, ctx, qlen in zip(block_tables, context_lens, query_lens)
        for pos in range(ctx - qlen, ctx)
    ]


def pad_tables(block_tables, width: int, pad_block_id: int) -> list[list[int]]:
    """Block tables as one rectangle of `width` columns, padded with the sink block (reads nothing
    real)."""
    return [t + [pad_block_id] * (width - len(t)) for t in block_tables]


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each sequence may attend to."""

    # (num_tokens,) int64: where each token's K/V goes, its cache location block_id * block_size +
    # offset (vLLM calls this tensor slot_mapping; minicb keeps "slot" for a batch row)
    cache_locs: torch.Tensor
    block_tables: torch.Tensor  # (num_seqs, max_blocks) int64, padded with the sink block id
    context_lens: torch.Tensor  # (num_seqs,) int64: tokens in the cache AFTER this step's writes
    query_start_loc: torch.Tensor  # (num_seqs + 1,) int64: cumulative query lengths
    # the first num_decodes sequences are decodes: 1 query token each, or 1 + k verifying k drafts
    num_decodes: int
    query_start_loc_host: list[int]  # host copies: the prefill loop never waits for the device
    context_lens_host: list[int]
    # vLLM's name: the tokens of the decode rows, the first num_decode_tokens of the batch (None:
    # one per decode row)
    num_decode_tokens: int | None = None
    # query slots per decode row in the padded (num_decodes, Q, heads, head_dim) layout that
    # decode_attention takes: at least every decode row's query_len (a CUDA graph of speculative
    # rows holds 1 + k, vLLM's uniform_decode_query_len)
    decode_query_len: int = 1
    # (num_decode_tokens,) int64: decode token t's place in that layout, row b's tokens right-
    # aligned at b * Q + Q - query_len + j; None when every decode row has Q tokens (a plain view)
    decode_slots: torch.Tensor | None = None
    # eager CPU steps: the decode rows grouped by length (ragged_attention.py)
    decode_groups: object = None
    # CUDA: the decode rows' (row, block) pairs, read in place (paged_flash.py)
    pages: object = None

    def __post_init__(self):
        if self.num_decode_tokens is None:
            self.num_decode_tokens = self.num_decodes

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]  # a shape, not a value: safe inside a CUDA graph

    @property
    def num_tokens(self) -> int:
        return self.cache_locs.shape[0]

    @classmethod
    def build(
        cls,
        block_tables: list[list[int]],
        context_lens: list[int],
        query_lens: list[int],
        num_decodes: int,
        block_size: int,
        pad_block_id: int,
        device="cpu",
        decode_query_len: int | None = None,
    ) -> "AttentionMetadata":
        """Metadata from plain lists: sequence i has `query_lens[i]` new tokens, the last
        ones of its `context_lens[i]` tokens, stored in the blocks `block_tables[i]`. The first
        `num_decodes` are decode rows of 1..decode_query_len tokens (default: their longest)."""
        if not len(block_tables) == len(context_lens) == len(query_lens):
            raise ValueError(
                "block_tables, context_lens and query_lens must have one entry per sequence"
            )
        decode_lens = query_lens[:num_decodes]
        if decode_query_len is None:
            decode_query_len = max(decode_lens, default=1)
        if not all(1 <= q <= decode_query_len for q in decode_lens):
            raise ValueError(
                f"the first num_decodes={num_decodes} sequences are decode rows: each query_len "
                f"must be between 1 and decode_query_len={decode_query_len}, got {decode_lens}"
            )
        starts = [0]
        for table, ctx, qlen in zip(block_tables, context_lens, query_lens):
            if not 1 <= qlen <= ctx:
                raise ValueError(f"query_len {qlen} must be between 1 and context_len {ctx}")
            if len(table) * block_size < ctx:
                raise ValueError(
                    f"block table of {len(table)} blocks cannot hold context_len {ctx}"
                )
            starts.append(starts[-1] + qlen)
        locs = cache_locations(block_tables, context_lens, query_lens, block_size)
        padded = pad_tables(
            block_tables, max((len(t) for t in block_tables), default=0), pad_block_id
        )

        def as_tensor(x):
            return to_device(x, device)

        is_uniform = all(q == decode_query_len for q in decode_lens)
        slots = None if is_uniform else as_tensor(decode_slots(decode_lens, decode_query_len))
        return cls(
            cache_locs=as_tensor(locs),
            block_tables=as_tensor(padded),
            context_lens=as_tensor(context_lens),
            query_start_loc=as_tensor(starts),
            num_decodes=num_decodes,
            query_start_loc_host=starts,
            context_lens_host=list(context_lens),
            num_decode_tokens=sum(decode_lens),
            decode_query_len=decode_query_len,
            decode_slots=slots,
        )


def decode_slots(query_lens: list[int], width: int) -> list[int]:
    """Where each decode token goes in a (rows x width) layout: row b's query_lens[b] tokens
    right-aligned, at b * width + width - query_lens[b] + j, so that the last slot of every row is
    its newest token."""
    return [b * width + width - n + j for b, n in enumerate(query_lens) for j in range(n)]


def store_kv(k, v, k_cache, v_cache, cache_locs, quant=None) -> None:
    """Write K/V of shape (num_tokens, kv_heads, head_dim) at their cache locations in the paged
    cache. `quant` (a KVQuant, kv_quant.py): the cache holds another dtype, e.g. fp8 with a scale
    per layer."""
    if quant is not None:
        k, v = quant.quantize(k, v)
    kv_heads, head_dim = k_cache.shape[-2:]
    # (num_blocks, block_size, kv_heads, head_dim) seen as (num_locations, kv_heads, head_dim)
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, cache_locs, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, cache_locs, v)


def decode_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    scale,
    sliding_window=None,
    quant=None,
    sinks=None,
):
    """A few queries per sequence against its cached context, the cache gathered once per row.

    q: (B, Q, num_heads, head_dim), each row's queries right-aligned: slot j of row b sits at
    position context_lens[b] - Q + j and sees keys 0..that position (a decode has Q = 1; a row
    verifying k drafts Q = 1 + k; a shorter row's leading slots are computed and discarded by the
    caller). q may also be (B, num_heads, head_dim): one query per row. block_tables: (B,
    max_blocks); context_lens: (B,), each >= 1 (a padded row uses 1 and a table of sink ids).
    Returns q's shape. Graph-safe: every shape comes from tensor shapes, never from tensor values
    (no .item(), no boolean indexing).
    """
    one_query = q.dim() == 3
    if one_query:
        q = q[:, None]  # (B, 1, num_heads, head_dim)
    batch, num_queries, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = num_heads // kv_heads
    max_len = block_tables.shape[1] * block_size  # gather width: decided by the caller

    # Gather each sequence's blocks in table order: (B, max_len, kv_heads, head_dim). This copy is
    # the price of paging in plain PyTorch; a fused kernel (vLLM's) reads the blocks in place. It is
    # made once per row, however many queries the row has.
    flat_tables = block_tables.reshape(-1)
    k = k_cache.index_select(0, flat_tables).view(batch, max_len, kv_heads, head_dim)
    v = v_cache.index_select(0, flat_tables).view(batch, max_len, kv_heads, head_dim)
    if quant is not None:  # back to the model's dtype (fp8: times the layer's scale)
        k, v = quant.dequantize(k, v, q.dtype)

    # Position t of the gathered rows holds absolute position t; query slot j may see positions up
    # to its own (the rest are later tokens, the tail of the last block, or sink padding). A slot
    # before a row's first query sits at a negative position: clamped to 0, it sees key 0, so its
    # discarded output is never NaN.
    offsets = torch.arange(num_queries - 1, -1, -1, device=q.device)  # Q - 1 - j
    q_pos = (context_lens[:, None] - 1 - offsets).clamp(min=0)  # (B, Q)
    positions = torch.arange(max_len, device=q.device)
    allowed = positions <= q_pos[:, :, None]  # (B, Q, max_len)
    if sliding_window is not None:
        allowed &= positions > q_pos[:, :, None] - sliding_window

    # Grouped-query attention: the `group` query heads that share kv head h attend to the same keys,
    # so they and the row's Q queries are handed to SDPA as Q x group queries of one (sequence, kv
    # head) pair, and K/V are never copied per query head. Per (sequence, kv head): softmax(q K^T *
    # scale, masked) V, with the softmax accumulated in float32 (float64 stays float64) by the fused
    # kernel.
    rows = q.view(batch, num_queries, kv_heads, group, head_dim).transpose(1, 2)
    mask = allowed[:, None, :, None, :]  # (B, 1, Q, 1, max_len): over kv heads and the group
    if num_queries > 1:  # a row's Q x group queries each with its own mask
        mask = mask.expand(batch, 1, num_queries, group, max_len)
    out = sdpa_with_sinks(
        rows.reshape(batch, kv_heads, num_queries * group, head_dim),  # (B, kv, Q * group, hd)
        k.transpose(1, 2),  # (B, kv_heads, max_len, head_dim), a strided view
        v.transpose(1, 2),
        mask.reshape(batch, 1, -1, max_len),
        scale,
        None if sinks is None else sink_rows(sinks, kv_heads, num_queries),
    )
    # (B, kv, Q, group, hd) -> (B, Q, num_heads, hd)
    out = out.view(batch, kv_heads, num_queries, group, head_dim).transpose(1, 2)
    out = out.reshape(batch, num_queries, num_heads, head_dim)
    return out[:, 0] if one_query else out


def pad_decode_queries(q, meta: "AttentionMetadata"):
    """The decode tokens' queries (num_decode_tokens, H, D) in decode_attention's padded layout
    (num_decodes, Q, H, D), right-aligned; a shorter row's leading slots hold zeros."""
    rows, width = meta.num_decodes, meta.decode_query_len
    if meta.decode_slots is None:  # every row has Q tokens: a view
        return q.view(rows, width, *q.shape[1:])
    padded = q.new_zeros(rows * width, *q.shape[1:])
    return padded.index_copy_(0, meta.decode_slots, q).view(rows, width, *q.shape[1:])


def unpad_decode_outputs(out, meta: "AttentionMetadata"):
    """(num_decodes, Q, H, D) -> the real decode tokens' outputs, (num_decode_tokens, H, D)."""
    flat = out.reshape(-1, *out.shape[2:])
    return flat if meta.decode_slots is None else flat.index_select(0, meta.decode_slots)


def prefill_attention(
    q,
    k,
    v,
    k_cache,
    v_cache,
    meta: AttentionMetadata,
    scale,
    sliding_window=None,
    quant=None,
    sinks=None,
):
    """Causal attention for every prefill chunk of the batch (sequences num_decodes..num_seqs-1).

    q: (num_tokens, num_heads, head_dim), k/v: (num_tokens, kv_heads, head_dim) for the
    whole batch; this step's K/V must already be stored. Returns the outputs of the
    prefill tokens only: (num_tokens - num_decode_tokens, num_heads, head_dim).
    """
    block_size = k_cache.shape[1]
    starts = meta.query_start_loc_host
    outs = []
    for i in range(meta.num_decodes, meta.num_seqs):
        start, end = starts[i], starts[i + 1]
        query_len = end - start
        context_len = meta.context_lens_host[i]
        prefix_len = context_len - query_len  # tokens cached by earlier steps
        uses_chunk_kv_only = prefix_len == 0 and quant is None
        if uses_chunk_kv_only:  # nothing cached before: the chunk's own K/V is everything
            keys, values = k[start:end], v[start:end]
        else:  # gather the prefix + chunk from the cache: (context_len, kv_heads, head_dim)
            table = meta.block_tables[i, : cdiv(context_len, block_size)]
            keys = k_cache.index_select(0, table).flatten(0, 1)[:context_len]
            values = v_cache.index_select(0, table).flatten(0, 1)[:context_len]
            # a quantized cache is read back, as every later step will read it
            if quant is not None:
                keys, values = quant.dequantize(keys, values, q.dtype)

        # Query j sits at absolute position prefix_len + j and sees keys 0..prefix_len + j.
        q_pos = torch.arange(prefix_len, context_len, device=q.device)[:, None]
        k_pos = torch.arange(context_len, device=q.device)[None, :]
        allowed = k_pos <= q_pos  # (query_len, context_len)
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        # A whole prompt on a GPU: is_causal instead of the same mask lets SDPA pick flash
        # attention; with a mask and GQA it falls back to a kernel that writes every score (9.7 GiB
        # for 8,192 tokens, H200).
        causal = (
            prefix_len == 0
            and sliding_window is None
            and sinks is None
            and q.device.type in CAUSAL_FLASH_DEVICES
        )
        if causal:  # SDPA wants (heads, len, head_dim); enable_gqa shares kv heads across groups
            out = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1),
                keys.transpose(0, 1),
                values.transpose(0, 1),
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )
        else:  # SDPA with the mask, or on a CPU softmax(q K^T) V from the definition
            out = masked_chunk_attention(q[start:end], keys, values, allowed, scale, sinks)
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


def paged_attention(
    q,
    k,
    v,
    k_cache,
    v_cache,
    meta: AttentionMetadata,
    scale,
    sliding_window=None,
    quant=None,
    sinks=None,
):
    """Store this step's K/V, then attend: decodes first, prefill chunks after.

    q: (num_tokens, num_heads, head_dim), k/v: (num_tokens, kv_heads, head_dim). Returns
    (num_tokens, num_heads, head_dim).
    """
    store_kv(k, v, k_cache, v_cache, meta.cache_locs, quant)
    nd = meta.num_decodes
    parts = []
    if nd > 0:
        q_dec = q[: meta.num_decode_tokens]  # (num_decode_tokens, H, D)
        pages = meta.pages  # no gather: flash attention per (row, block) pair, then combine
        if pages is not None and pages.window == sliding_window:  # cut to this layer's window
            parts.append(flash_pages_attention(q_dec, k_cache, v_cache, pages, scale, k, v, sinks))
        elif meta.decode_groups is not None and sliding_window is None:
            parts.append(
                grouped_decode_attention(
                    q_dec, k_cache, v_cache, meta.decode_groups, scale, quant, sinks
                )
            )
        else:
            tables = meta.block_tables[:nd]
            lens = meta.context_lens[:nd]
            padded = pad_decode_queries(q_dec, meta)  # (nd, Q, H, D)
            out = decode_attention(
                padded, k_cache, v_cache, tables, lens, scale, sliding_window, quant, sinks
            )
            parts.append(unpad_decode_outputs(out, meta))
    if meta.num_seqs > nd:
        parts.append(
            prefill_attention(q, k, v, k_cache, v_cache, meta, scale, sliding_window, quant, sinks)
        )
    return parts[0] if len(parts) == 1 else torch.cat(parts)
