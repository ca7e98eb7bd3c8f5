"""Decode attention grouped by length (minicb/model_executor/ragged_attention.py) against the padded
reference (attention.decode_attention): the same outputs on random ragged batches, groups that cover
every row once, and a grouping that only pays for a group when it saves padding."""

import itertools
import random

import pytest
import torch

from minicb.model_executor.attention import decode_attention
from minicb.model_executor.ragged_attention import (
    decode_groups,
    group_rows,
    grouped_decode_attention,
)


def ragged_batch(
    seed: int, batch: int, block_size: int, kv_heads: int, group: int, max_blocks: int
):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks, head_dim = batch * max_blocks + 1, 8
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=torch.float64)
    v_cache = torch.randn_like(k_cache)
    sink = num_blocks - 1
    k_cache[sink], v_cache[sink] = 1e6, -1e6  # padding that leaked into a result would show
    free = list(range(num_blocks - 1))
    rng.shuffle(free)
    lens = [rng.randint(1, max_blocks * block_size) for _ in range(batch)]
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
    q = torch.randn(batch, kv_heads * group, head_dim, dtype=torch.float64)
    return q, k_cache, v_cache, tables, lens, sink


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block_size, kv_heads, group", [(4, 2, 2), (16, 3, 3), (1, 1, 4)])
def test_grouped_equals_the_padded_reference(seed, block_size, kv_heads, group):
    batch = [1, 3, 17, 64][seed % 4]
    q, k_cache, v_cache, tables, lens, sink = ragged_batch(
        seed, batch, block_size, kv_heads, group, max_blocks=12
    )
    width = max(map(len, tables))
    padded = torch.tensor([t + [sink] * (width - len(t)) for t in tables])
    expected = decode_attention(q, k_cache, v_cache, padded, torch.tensor(lens), 0.3)
    groups = decode_groups(tables, lens, block_size, sink, torch.float64, "cpu")
    got = grouped_decode_attention(q, k_cache, v_cache, groups, 0.3)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    # each row once
    assert sorted(r for rows in groups.rows for r in rows.tolist()) == list(range(batch))


@pytest.mark.parametrize("seed", range(3))
def test_grouped_applies_the_sinks_as_the_padded_reference_does(seed):
    # gpt-oss's full-attention layers take the CPU decode groups: each head's sink in each softmax
    q, k_cache, v_cache, tables, lens, sink = ragged_batch(seed, 17, 4, 2, 2, max_blocks=12)
    sinks = torch.randn(4, dtype=torch.float64) * 2
    width = max(map(len, tables))
    padded = torch.tensor([t + [sink] * (width - len(t)) for t in tables])
    expected = decode_attention(
        q, k_cache, v_cache, padded, torch.tensor(lens), 0.3, None, None, sinks
    )
    assert not torch.allclose(
        expected, decode_attention(q, k_cache, v_cache, padded, torch.tensor(lens), 0.3)
    )
    groups = decode_groups(tables, lens, 4, sink, torch.float64, "cpu")
    assert len(groups.rows) > 1  # several groups: the scatter back is exercised too
    got = grouped_decode_attention(q, k_cache, v_cache, groups, 0.3, None, sinks)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_groups_are_only_as_wide_as_their_widest_row():
    tables = [[7] * n for n in [2, 2, 3, 20, 2, 3]]
    groups = decode_groups(tables, [16 * len(t) for t in tables], 16, 0, torch.float32, "cpu")
    by_width = {t.shape[1]: sorted(r.tolist()) for r, t in zip(groups.rows, groups.tables)}
    # the long row alone; the short ones padded to 3, not 20
    assert by_width == {3: [0, 1, 2, 4, 5], 20: [3]}
    assert [m.shape for m in groups.masks] == [(5, 1, 48), (1, 1, 320)]  # (rows, query slots, keys)


def test_a_group_is_made_only_when_it_saves_more_than_it_costs():
    assert group_rows([4] * 10 + [5]) == [list(range(11))]  # 10 row-blocks saved < one group's cost
    assert group_rows([4] * 10 + [40], group_cost=16) == [list(range(10)), [10]]  # 360 saved
    assert group_rows([4, 4, 40, 40], group_cost=0) == [[0, 1], [2, 3]]
    assert group_rows([9, 1, 5], group_cost=0) == [[1], [2], [0]]  # free groups: one per width
    for n in (1, 7, 40):  # the cost of the chosen grouping is the least over every contiguous split
        widths = [random.Random(n).randint(1, 30) for _ in range(n)]
        cost = lambda gs: sum(len(g) * max(widths[r] for r in g) + 16 for g in gs)
        chosen = cost(group_rows(widths))
        order = sorted(range(n), key=widths.__getitem__)
        if n <= 10:  # every way to cut the sorted rows into contiguous groups
            splits = [
                [order[a:b] for a, b in zip((0, *cuts), (*cuts, n))]
                for k in range(n)
                for cuts in itertools.combinations(range(1, n), k)
            ]
            assert chosen == min(map(cost, splits))
        assert chosen <= cost([list(range(n))])
        assert chosen <= cost([[r] for r in range(n)])
