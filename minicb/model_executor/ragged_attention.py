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

A decode row verifying k speculative drafts has 1 + k queries (vLLM V1: one decode row, not k + 1):
a group holds its rows' queries right-aligned in Q slots, Q its longest row's query length, with
one mask per query slot, and the group's gather is read by all of them at once. A shorter row's
leading slots repeat its first query and are dropped after.
"""

from dataclasses import dataclass, field

import torch

from .attention_sinks import sdpa_with_sinks, sink_rows

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
    # per group (G * Q,) int64: which decode token each query slot takes (rows right-aligned in Q
    # slots; a shorter row's leading slots repeat its first token)
    queries: list[torch.Tensor]
    # per group (G, width) int64: their block tables, padded to the group's widest
    tables: list[torch.Tensor]
    # per group (G, Q, width * block_size): 0 where query slot j may see the key, -inf elsewhere
    masks: list[torch.Tensor]
    # per group: None when every slot is a real token, else (real slots,) int64 into the G * Q
    real_slots: list[torch.Tensor | None]
    num_tokens: int  # the decode tokens: every row's query length, summed
    in_order: bool  # one group holding every token in order: no scatter needed
    # per (group index, query heads per kv head): the mask repeated over those heads, made at first
    # use, as decode_groups cannot know the model's heads
    expanded: dict = field(default_factory=dict)

    def mask(self, i: int, group_size: int) -> torch.Tensor:
        """Group i's mask for SDPA: (G, 1, Q * group_size, keys), the query slot major."""
        key = (i, group_size)
        if key not in self.expanded:
            m = self.masks[i]
            g, q, length = m.shape
            if q == 1:  # (G, 1, 1, keys) broadcasts over the heads
                self.expanded[key] = m[:, None]
            else:
                m = m[:, None, :, None, :].expand(g, 1, q, group_size, length)
                self.expanded[key] = m.reshape(g, 1, q * group_size, length)
        return self.expanded[key]


def decode_groups(
    block_tables: list[list[int]],
    context_lens: list[int],
    block_size: int,
    pad_block_id: int,
    dtype: torch.dtype,
    device,
    query_lens: list[int] | None = None,
) -> DecodeGroups:
    """Group the decode rows (their block tables, context lengths and query lengths, 1 each when
    None) and build each group's inputs."""
    query_lens = query_lens or [1] * len(block_tables)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    groups = group_rows([len(t) for t in block_tables])
    if len(groups) == 1:  # one group: keep the rows in their own order, nothing to scatter back
        groups = [list(range(len(block_tables)))]
    queries, tables, masks, real_slots = [], [], [], []
    for g in groups:
        width = max(len(block_tables[r]) for r in g)
        slots = max(query_lens[r] for r in g)  # Q: query slots per row in this group
        tables.append(
            torch.tensor(
                [block_tables[r] + [pad_block_id] * (width - len(block_tables[r])) for r in g],
                dtype=torch.long,
                device=device,
            )
        )
        # slot j of row r: its token (slot - padding), or its first token where it has none
        pads = [slots - query_lens[r] for r in g]
        queries.append(
            torch.tensor(
                [starts[r] + max(j - p, 0) for r, p in zip(g, pads) for j in range(slots)],
                dtype=torch.long,
                device=device,
            )
        )
        real = [i * slots + j for i, p in enumerate(pads) for j in range(p, slots)]
        is_full = len(real) == len(g) * slots
        real_slots.append(None if is_full else torch.tensor(real, dtype=torch.long, device=device))
        lens = torch.tensor([context_lens[r] for r in g], device=device)
        # (G, Q): slot j's position, context_len - Q + j, at least 0 (a padding slot sees key 0)
        q_pos = (lens[:, None] - slots + torch.arange(slots, device=device)).clamp(min=0)
        allowed = torch.arange(width * block_size, device=device) <= q_pos[:, :, None]
        masks.append(
            torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(
                ~allowed, float("-inf")
            )
        )
    in_order = len(groups) == 1 and real_slots[0] is None
    rows = [torch.tensor(g, dtype=torch.long, device=device) for g in groups]
    return DecodeGroups(rows, queries, tables, masks, real_slots, starts[-1], in_order)


def grouped_decode_attention(
    q, k_cache, v_cache, groups: DecodeGroups, scale, quant=None, sinks=None
):
    """decode_attention's result, group by group. q: (num_decode_tokens, num_heads, head_dim) ->
    the same shape. sinks: (num_heads,) gpt-oss's logit per head (attention_sinks.py), or None."""
    _, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group_size = num_heads // kv_heads  # query heads per kv head (grouped-query attention)
    out = None if groups.in_order else torch.empty_like(q)
    for i, (queries, tables) in enumerate(zip(groups.queries, groups.tables)):
        g, width = tables.shape
        slots = queries.shape[0] // g  # Q
        length = width * block_size
        k = k_cache.index_select(0, tables.reshape(-1)).view(g, length, kv_heads, head_dim)
        v = v_cache.index_select(0, tables.reshape(-1)).view(g, length, kv_heads, head_dim)
        if quant is not None:  # a cache in another dtype than the model's (kv_quant.py)
            k, v = quant.dequantize(k, v, q.dtype)
        q_g = q if groups.in_order else q.index_select(0, queries)  # (G * Q, H, D)
        # (G, kv, Q * group, hd): a row's Q queries of the heads sharing a kv head, slot major
        rows = q_g.view(g, slots, kv_heads, group_size, head_dim).transpose(1, 2)
        o = sdpa_with_sinks(
            rows.reshape(g, kv_heads, slots * group_size, head_dim),
            k.transpose(1, 2),
            v.transpose(1, 2),
            groups.mask(i, group_size),
            scale,
            None if sinks is None else sink_rows(sinks, kv_heads, slots),
        )
        # (G, kv, Q, group, hd) -> (G * Q, H, D)
        o = o.view(g, kv_heads, slots, group_size, head_dim).transpose(1, 2)
        o = o.reshape(g * slots, num_heads, head_dim)
        if groups.in_order:
            return o
        real = groups.real_slots[i]
        if real is None:
            out.index_copy_(0, queries, o)
        else:
            out.index_copy_(0, queries.index_select(0, real), o.index_select(0, real))
    return out
