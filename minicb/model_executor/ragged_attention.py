"""Decode attention without padding to the batch's longest context (the eager CPU path).

attention.decode_attention, the readable reference (and the only shape a CUDA graph can hold),
gathers every decode row's blocks into one rectangle as wide as the longest block table, and masks
the rest, in every layer. A batch with one long request and many short ones then gathers and
scores mostly padding: 63 rows of 4 blocks beside one of 20 gather 64 x 20 blocks, where 272 hold
tokens. Here the rows are grouped by their number of blocks once per step, before the forward pass,
and every layer runs one gather and one attention per group, each only as wide as its own widest
row. The masks are built once per step too, not once per layer.

Grouping trades padding for calls: each group costs one more gather and one more SDPA call per
layer (tens of microseconds on a CPU), so rows of nearby lengths share a group. `group_rows` picks
the grouping by dynamic programming over the sorted block counts, pricing a group's padded
row-blocks plus a fixed GROUP_COST. The outputs are the reference's, up to the order of floating
point sums: tests/test_ragged_attention.py compares them on random ragged batches.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# What one more group costs, in row-blocks (one row's block of 16 tokens gathered and scored): the
# fixed cost of a gather and an SDPA call on a 2-core CPU is about that of 16 such row-blocks.
GROUP_COST = 16


def group_rows(num_blocks: list[int], group_cost: float = GROUP_COST) -> list[list[int]]:
    """Rows (indices into num_blocks) in groups of nearby block counts, minimizing
    sum over groups of (rows x the group's widest row) + group_cost per group."""
    order = sorted(range(len(num_blocks)), key=num_blocks.__getitem__)
    widths = sorted(set(num_blocks))  # a group always ends at the last row of some width
    ends = [sum(n <= w for n in num_blocks) for w in widths]  # rows up to and including width w
    best, cut = [0.0] + [float("inf")] * len(widths), [0] * (len(widths) + 1)
    for j in range(
        1, len(widths) + 1
    ):  # best[j]: cheapest grouping of the rows up to widths[j - 1]
        for i in range(j):  # the last group holds the rows of widths[i] .. widths[j - 1]
            cost = best[i] + (ends[j - 1] - (ends[i - 1] if i else 0)) * widths[j - 1] + group_cost
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], len(widths)
    while j > 0:
        i = cut[j]
        groups.append(order[(ends[i - 1] if i else 0) : ends[j - 1]])
        j = i
    return groups[::-1]


@dataclass
class DecodeGroups:
    """The decode rows of one step in groups (built once per step, used by every layer)."""

    rows: list[torch.Tensor]  # per group (G,) int64: which decode rows it holds
    # per group (G, width) int64: their block tables, padded to the group's widest
    tables: list[torch.Tensor]
    # per group (G, 1, 1, width * block_size): 0 where a key is the row's, -inf past it
    masks: list[torch.Tensor]
    num_rows: int
    in_order: bool  # one group holding every row in order: no scatter needed


def decode_groups(
    block_tables: list[list[int]],
    context_lens: list[int],
    block_size: int,
    pad_block_id: int,
    dtype: torch.dtype,
    device,
) -> DecodeGroups:
    """Group the decode rows (their block tables and context lengths) and build each group's
    inputs."""
    groups = group_rows([len(t) for t in block_tables])
    if len(groups) == 1:  # one group: keep the rows in their own order, nothing to scatter back
        groups = [list(range(len(block_tables)))]
    rows, tables, masks = [], [], []
    for g in groups:
        width = max(len(block_tables[r]) for r in g)
        tables.append(
            torch.tensor(
                [block_tables[r] + [pad_block_id] * (width - len(block_tables[r])) for r in g],
                dtype=torch.long,
                device=device,
            )
        )
        lens = torch.tensor([context_lens[r] for r in g], device=device)
        # (G, width * block_size)
        allowed = torch.arange(width * block_size, device=device) < lens[:, None]
        masks.append(
            torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(
                ~allowed, float("-inf")
            )[:, None, None, :]
        )
        rows.append(torch.tensor(g, dtype=torch.long, device=device))
    return DecodeGroups(rows, tables, masks, len(block_tables), in_order=len(groups) == 1)


def grouped_decode_attention(q, k_cache, v_cache, groups: DecodeGroups, scale, quant=None):
    """decode_attention's result, group by group. q: (B, num_heads, head_dim) -> (B, num_heads,
    head_dim)."""
    batch, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group_size = num_heads // kv_heads  # query heads per kv head (grouped-query attention)
    out = q if groups.in_order else torch.empty_like(q)
    for rows, tables, mask in zip(groups.rows, groups.tables, groups.masks):
        g, width = tables.shape
        length = width * block_size
        k = k_cache.index_select(0, tables.reshape(-1)).view(g, length, kv_heads, head_dim)
        v = v_cache.index_select(0, tables.reshape(-1)).view(g, length, kv_heads, head_dim)
        if quant is not None:  # a cache in another dtype than the model's (kv_quant.py)
            k, v = quant.dequantize(k, v, q.dtype)
        q_g = q if groups.in_order else q.index_select(0, rows)
        # (g, kv, group, hd)
        o = F.scaled_dot_product_attention(
            q_g.view(g, kv_heads, group_size, head_dim),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            scale=scale,
        )
        if groups.in_order:
            return o.reshape(batch, num_heads, head_dim)
        out.index_copy_(0, rows, o.reshape(g, num_heads, head_dim))
    return out
