"""Paged attention in plain PyTorch (no Triton, no custom kernels).

Idea (PagedAttention, Kwon et al., SOSP 2023): a sequence's keys and values live in
blocks scattered over the KV cache; its block_table lists them in order. Three steps:

  store_kv           write this step's K/V to their cache locations (cache_locs), one index_copy_
  decode_attention   one query per sequence: gather the blocks of every table, mask the
                     positions past context_len, attend. Fixed shapes, so it can be captured
                     in a CUDA graph.
  prefill_attention  a chunk of queries per sequence (chunked prefill, Sarathi,
                     Agrawal et al. 2023): attend causally to the cached prefix + the chunk.

One flat batch mixes both: the first `num_decodes` sequences are decodes (one token each),
the rest are prefill chunks. Grouped-query attention (Ainslie et al., 2023): `group` query
heads share one kv head; we reshape the queries instead of copying K/V `group` times.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import cdiv
from .cpu_attention import masked_chunk_attention
from .paged_flash import flash_pages_attention
from .ragged_attention import grouped_decode_attention

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
    num_decodes: int  # the first num_decodes sequences have exactly one query token
    query_start_loc_host: list[int]  # host copies: the prefill loop never waits for the device
    context_lens_host: list[int]
    # eager CPU steps: the decode rows grouped by length (ragged_attention.py)
    decode_groups: object = None
    # CUDA: the decode rows' (row, block) pairs, read in place (paged_flash.py)
    pages: object = None

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
    ) -> "AttentionMetadata":
        """Metadata from plain lists: sequence i has `query_lens[i]` new tokens, the last
        ones of its `context_lens[i]` tokens, stored in the blocks `block_tables[i]`."""
        if not len(block_tables) == len(context_lens) == len(query_lens):
            raise ValueError(
                "block_tables, context_lens and query_lens must have one entry per sequence"
            )
        if any(q != 1 for q in query_lens[:num_decodes]):
            raise ValueError(f"the first num_decodes={num_decodes} sequences must have query_len 1")
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
            return torch.tensor(x, dtype=torch.long, device=device)

        return cls(
            cache_locs=as_tensor(locs),
            block_tables=as_tensor(padded),
            context_lens=as_tensor(context_lens),
            query_start_loc=as_tensor(starts),
            num_decodes=num_decodes,
            query_start_loc_host=starts,
            context_lens_host=list(context_lens),
        )


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
    q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window=None, quant=None
):
    """One query per sequence against its cached context.

    q: (B, num_heads, head_dim); block_tables: (B, max_blocks); context_lens: (B,), each >= 1
    (a padded row uses 1 and a table of sink ids). Returns (B, num_heads, head_dim). Graph-safe:
    every shape comes from tensor shapes, never from tensor values (no .item(), no boolean
    indexing).
    """
    batch, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = num_heads // kv_heads
    max_len = block_tables.shape[1] * block_size  # gather width: decided by the caller

    # Gather each sequence's blocks in table order: (B, max_len, kv_heads, head_dim). This copy is
    # the price of paging in plain PyTorch; a fused kernel (vLLM's) reads the blocks in place.
    flat_tables = block_tables.reshape(-1)
    k = k_cache.index_select(0, flat_tables).view(batch, max_len, kv_heads, head_dim)
    v = v_cache.index_select(0, flat_tables).view(batch, max_len, kv_heads, head_dim)
    if quant is not None:  # back to the model's dtype (fp8: times the layer's scale)
        k, v = quant.dequantize(k, v, q.dtype)

    # Position t of the gathered rows holds absolute position t; only positions < context_len are
    # this sequence's (the rest are the tail of its last block, or sink padding).
    positions = torch.arange(max_len, device=q.device)
    allowed = positions < context_lens[:, None]  # (B, max_len)
    if sliding_window is not None:  # the query sits at position context_len - 1
        allowed &= positions > context_lens[:, None] - 1 - sliding_window

    # Grouped-query attention: the `group` query heads that share kv head h attend to the same keys,
    # so they are handed to SDPA as `group` queries of one (sequence, kv head) pair, and K/V are
    # never copied per query head. Per (sequence, kv head): softmax(q K^T * scale, masked) V, with
    # the softmax accumulated in float32 (float64 stays float64) by the fused kernel.
    out = F.scaled_dot_product_attention(
        q.view(batch, kv_heads, group, head_dim),  # (B, kv_heads, group, head_dim)
        k.transpose(1, 2),  # (B, kv_heads, max_len, head_dim), a strided view
        v.transpose(1, 2),
        attn_mask=allowed[:, None, None, :],  # broadcast over kv heads and the group's queries
        scale=scale,
    )
    return out.reshape(batch, num_heads, head_dim)


def prefill_attention(
    q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale, sliding_window=None, quant=None
):
    """Causal attention for every prefill chunk of the batch (sequences num_decodes..num_seqs-1).

    q: (num_tokens, num_heads, head_dim), k/v: (num_tokens, kv_heads, head_dim) for the
    whole batch; this step's K/V must already be stored. Returns the outputs of the
    prefill tokens only: (num_tokens - num_decodes, num_heads, head_dim).
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
            prefix_len == 0 and sliding_window is None and q.device.type in CAUSAL_FLASH_DEVICES
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
            out = masked_chunk_attention(q[start:end], keys, values, allowed, scale)
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


def paged_attention(
    q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale, sliding_window=None, quant=None
):
    """Store this step's K/V, then attend: decodes first, prefill chunks after.

    q: (num_tokens, num_heads, head_dim), k/v: (num_tokens, kv_heads, head_dim). Returns
    (num_tokens, num_heads, head_dim).
    """
    store_kv(k, v, k_cache, v_cache, meta.cache_locs, quant)
    nd = meta.num_decodes
    parts = []
    if nd > 0:
        tables = meta.block_tables[:nd]
        lens = meta.context_lens[:nd]
        if meta.pages is not None:  # no gather: flash attention per (row, block) pair, then combine
            parts.append(flash_pages_attention(q[:nd], k_cache, v_cache, meta.pages, scale))
        elif meta.decode_groups is not None and sliding_window is None:
            parts.append(
                grouped_decode_attention(q[:nd], k_cache, v_cache, meta.decode_groups, scale, quant)
            )
        else:
            parts.append(
                decode_attention(
                    q[:nd], k_cache, v_cache, tables, lens, scale, sliding_window, quant
                )
            )
    if meta.num_seqs > nd:
        parts.append(
            prefill_attention(q, k, v, k_cache, v_cache, meta, scale, sliding_window, quant)
        )
    return parts[0] if len(parts) == 1 else torch.cat(parts)
