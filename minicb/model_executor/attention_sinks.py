"""Attention sinks: one learned logit per query head that joins every softmax (gpt-oss; the idea of
Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks", learned instead of
kept as the first tokens).

A softmax row must give its keys weights that sum to 1, so a head with nothing worth reading still
has to read something. A sink is one more score in the row, softmax([q K^T * scale, sink]), whose
column is dropped after the softmax: the weights over the real keys then sum to
1 / (1 + exp(sink - lse)), less than 1, and a head can read almost nothing.

The same thing without a new kernel: attend to one more key whose value is zero and whose score
is the sink. Its key is zero too (q . 0 = 0, exactly), and the additive mask adds the sink to that
column, so SDPA computes the gpt-oss softmax exactly, on every path that has a mask (the decode
gather, the CPU decode groups, a masked prefill chunk), and inside a CUDA graph (fixed shapes).
"""

import torch
import torch.nn.functional as F


def sink_rows(sinks: torch.Tensor, kv_heads: int, num_queries: int) -> torch.Tensor:
    """(num_heads,) -> (kv_heads, num_queries * group, 1): each SDPA row's sink where a (sequence,
    kv head) pair's rows hold its queries slot major (query j of head h * group + g at row
    j * group + g), as the decode paths lay them out."""
    group = sinks.shape[0] // kv_heads
    per_row = sinks.view(kv_heads, 1, group).expand(kv_heads, num_queries, group)
    return per_row.reshape(kv_heads, num_queries * group, 1)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: may attend) as SDPA's additive one: 0 where allowed, -inf elsewhere."""
    if allowed.dtype != torch.bool:
        return allowed
    zeros = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return zeros.masked_fill_(~allowed, float("-inf"))


def sdpa_with_sinks(q, k, v, attn_mask, scale, sinks=None, **sdpa_kwargs) -> torch.Tensor:
    """F.scaled_dot_product_attention, and with `sinks` (broadcastable to q.shape[:-1] + (1,)) each
    row's softmax also holds its sink's logit, whose weight reads nothing. q: (..., rows, head_dim);
    k, v: (..., keys, head_dim); attn_mask: boolean or additive, broadcastable to (..., rows,
    keys)."""
    if sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, scale=scale, **sdpa_kwargs
        )
    mask = additive_mask(attn_mask, q.dtype)
    rows = torch.broadcast_shapes(mask.shape[:-1], sinks.shape[:-1], q.shape[:-1])
    # one more key column: its score is the sink (0 from the zero key, plus the mask's sink)
    mask = torch.cat(
        (mask.expand(*rows, mask.shape[-1]), sinks.to(q.dtype).expand(*rows, 1)), dim=-1
    )
    k = F.pad(k, (0, 0, 0, 1))  # (..., keys + 1, head_dim): a zero key ...
    v = F.pad(v, (0, 0, 0, 1))  # ... whose value is zero: the sink's weight adds nothing
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, **sdpa_kwargs)
