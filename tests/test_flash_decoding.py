"""The online-softmax walk and split-KV decoding against minicb's decode_attention (float64, ragged
batches), the exact combine, and the byte counts against a case computed by hand."""

import math
import random
from dataclasses import replace

import pytest
import torch
from torch.testing import assert_close

from minicb.model_executor.attention import decode_attention
from minicb.reference.flash_decoding import (
    DecodeShape,
    RunningSoftmax,
    blocks_per_split,
    combine_partials,
    finish_softmax,
    gather_sdpa_traffic,
    materialized_traffic,
    online_softmax_decode,
    online_softmax_update,
    online_traffic,
    split_columns,
    split_kv_decode,
    split_kv_partials,
    split_kv_traffic,
    start_softmax,
    walk_blocks,
)

DT = torch.float64
EXACT = dict(atol=1e-12, rtol=1e-12)  # float64 rounding, nothing more


def ragged_batch(
    seed, block_size, num_heads, num_kv_heads, head_dim=8, extra_columns=0, q_scale=1.0
):
    """A decode batch over a shuffled paged cache: contexts of different lengths (1 included),
    tables padded with the sink block, every block nobody owns (the sink too) full of large finite
    garbage."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    lens = [1] + [rng.randint(1, 6 * block_size + 3) for _ in range(rng.randint(1, 4))]
    rng.shuffle(lens)
    needed = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(needed) + 3  # a few free blocks, then the sink
    ids = rng.sample(range(num_blocks), sum(needed))
    tables, at = [], 0
    for n in needed:
        tables.append(ids[at : at + n])
        at += n
    sink = num_blocks
    width = max(needed) + extra_columns  # extra columns: a CUDA graph's fixed width
    shape = (num_blocks + 1, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (
        torch.randn(shape, generator=g, dtype=DT),
        torch.randn(shape, generator=g, dtype=DT),
    )
    nobody = [b for b in range(num_blocks + 1) if b not in set(ids)]
    k_cache[nobody], v_cache[nobody] = 1e3, -1e3
    q = q_scale * torch.randn(len(lens), num_heads, head_dim, generator=g, dtype=DT)
    block_tables = torch.tensor([t + [sink] * (width - len(t)) for t in tables])
    return q, k_cache, v_cache, block_tables, torch.tensor(lens), head_dim**-0.5


# GQA, GQA, one kv head per query head, one kv head for all
HEADS = [(4, 2), (8, 2), (3, 3), (6, 1)]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_online_softmax_equals_decode_attention(block_size, heads):
    for seed in range(3):
        args = ragged_batch(seed, block_size, *heads, extra_columns=seed)
        assert_close(online_softmax_decode(*args), decode_attention(*args), **EXACT)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_split_kv_equals_decode_attention(block_size, heads):
    for seed in range(2):
        args = ragged_batch(10 + seed, block_size, *heads, extra_columns=seed)
        width = args[3].shape[1]
        expected = decode_attention(*args)
        for num_splits in sorted({1, 2, 3, width, width + 3}):  # the last: more splits than blocks
            assert_close(split_kv_decode(*args, num_splits), expected, **EXACT)


@pytest.mark.parametrize("window", [1, 3, 8])
def test_sliding_window_matches(window):
    args = ragged_batch(7, 4, 4, 2)
    expected = decode_attention(*args, sliding_window=window)
    assert_close(online_softmax_decode(*args, sliding_window=window), expected, **EXACT)
    assert_close(split_kv_decode(*args, 3, sliding_window=window), expected, **EXACT)


def test_large_scores_do_not_overflow():
    # Scores in the thousands: exp(score) overflows float64, exp(score - max) never does.
    args = ragged_batch(3, 4, 4, 2, q_scale=300.0)
    expected = decode_attention(*args)
    assert_close(online_softmax_decode(*args), expected, **EXACT)
    assert_close(split_kv_decode(*args, 4), expected, **EXACT)


def full_lse(q, k_cache, block_tables, context_lens, scale):
    """log-sum-exp of every sequence's whole score row, written out directly: (B, num_heads)."""
    rows = []
    for i, n in enumerate(context_lens.tolist()):
        keys = k_cache[block_tables[i]].flatten(0, 1)[:n]  # (n, kv_heads, head_dim)
        # (n, num_heads, head_dim)
        keys = keys.repeat_interleave(q.shape[1] // keys.shape[1], dim=1)
        rows.append((torch.einsum("hd,thd->ht", q[i], keys) * scale).logsumexp(dim=-1))
    return torch.stack(rows)


def test_combine_of_partials_equals_the_unsplit_output_and_lse():
    q, k_cache, v_cache, tables, lens, scale = ragged_batch(5, 4, 8, 2, extra_columns=2)
    whole_out, whole_lse = combine_partials(
        *split_kv_partials(q, k_cache, v_cache, tables, lens, scale, 1)
    )
    assert_close(full_lse(q, k_cache, tables, lens, scale), whole_lse, **EXACT)
    for num_splits in (2, 3, 5, 40):
        outs, lses = split_kv_partials(q, k_cache, v_cache, tables, lens, scale, num_splits)
        assert outs.shape == (*q.shape[:2], num_splits, q.shape[2]) and lses.shape == (
            *q.shape[:2],
            num_splits,
        )
        out, lse = combine_partials(outs, lses)
        assert_close(out, whole_out, **EXACT)
        assert_close(lse, whole_lse, **EXACT)
        # The combine is associative: merging merged halves gives the same result, even where one
        # half holds no position of a sequence (its merge is out 0, lse -inf: an empty partial
        # again).
        half = num_splits // 2
        left = combine_partials(outs[..., :half, :], lses[..., :half])
        right = combine_partials(outs[..., half:, :], lses[..., half:])
        again = combine_partials(
            torch.stack([left[0], right[0]], dim=-2), torch.stack([left[1], right[1]], dim=-1)
        )
        assert_close(again[0], whole_out, **EXACT)
        assert_close(again[1], whole_lse, **EXACT)
    empty = combine_partials(
        torch.zeros(2, 3, 4, dtype=DT), torch.full((2, 3), -math.inf, dtype=DT)
    )
    assert (empty[0] == 0).all() and torch.isneginf(empty[1]).all()


def test_empty_splits_weigh_nothing():
    q, k_cache, v_cache, tables, lens, scale = ragged_batch(2, 4, 4, 2)
    width = tables.shape[1]
    outs, lses = split_kv_partials(q, k_cache, v_cache, tables, lens, scale, width + 2)
    assert not outs.isnan().any()
    # no column at all
    assert torch.isneginf(lses[..., width:]).all() and (outs[..., width:, :] == 0).all()
    for i, n in enumerate(lens.tolist()):  # splits past a sequence's own blocks: empty for it
        assert torch.isneginf(lses[i, :, math.ceil(n / 4) :]).all()
        assert torch.isfinite(lses[i, :, : math.ceil(n / 4)]).all()


def test_split_columns():
    assert split_columns(5, 2) == [range(0, 3), range(3, 5)]
    assert split_columns(3, 5) == [range(0, 1), range(1, 2), range(2, 3), range(3, 3), range(3, 3)]
    assert blocks_per_split(64, 8) == 8
    with pytest.raises(ValueError, match="num_splits must be >= 1"):
        split_columns(4, 0)


def test_a_worked_online_softmax_by_hand():
    # Scores 1, 3 in the first block, 2 in the second; values 10, 20, 30 (head_dim 1).
    state = start_softmax((), 1, DT)
    state = online_softmax_update(
        state, torch.tensor([1.0, 3.0], dtype=DT), torch.tensor([[10.0], [20.0]], dtype=DT)
    )
    assert state.max.item() == 3.0
    assert_close(state.sum, torch.tensor(math.exp(-2) + 1, dtype=DT), **EXACT)
    state = online_softmax_update(
        state, torch.tensor([2.0], dtype=DT), torch.tensor([[30.0]], dtype=DT)
    )
    out, lse = finish_softmax(state)
    e = [math.exp(s) for s in (1.0, 3.0, 2.0)]
    assert_close(
        out, torch.tensor([(10 * e[0] + 20 * e[1] + 30 * e[2]) / sum(e)], dtype=DT), **EXACT
    )
    assert_close(lse, torch.tensor(math.log(sum(e)), dtype=DT), **EXACT)


# --- the checks can fail: wrong versions of each step are caught
# --------------------------------------


def update_without_rescale(state, scores, values):
    """The classic bug: the running max moves, the old sums are not shrunk by exp(old_max -
    new_max)."""
    new_max = torch.maximum(state.max, scores.amax(dim=-1))
    shift = torch.where(torch.isneginf(new_max), torch.zeros_like(new_max), new_max)
    p = torch.exp(scores - shift[..., None])
    return RunningSoftmax(
        new_max, state.sum + p.sum(dim=-1), state.acc + torch.einsum("...t,...td->...d", p, values)
    )


def test_forgetting_the_max_rescale_is_detected(monkeypatch):
    import minicb.reference.flash_decoding as fd

    args = ragged_batch(1, 4, 4, 2)
    expected = decode_attention(*args)
    monkeypatch.setattr(fd, "online_softmax_update", update_without_rescale)
    with pytest.raises(AssertionError):
        assert_close(fd.online_softmax_decode(*args), expected, **EXACT)


def test_wrong_combines_are_detected():
    q, k_cache, v_cache, tables, lens, scale = ragged_batch(4, 4, 4, 2, extra_columns=1)
    expected = decode_attention(q, k_cache, v_cache, tables, lens, scale)
    outs, lses = split_kv_partials(q, k_cache, v_cache, tables, lens, scale, 3)
    finite = torch.isfinite(lses)
    plain_mean = (outs * finite[..., None]).sum(-2) / finite.sum(-1)[..., None]  # ignores the lses
    with pytest.raises(AssertionError):
        assert_close(plain_mean, expected, **EXACT)
    # Weights exp(lse) without subtracting the largest: exact in theory, inf / inf = NaN once scores
    # are large.
    q_big = 300.0 * q
    outs, lses = split_kv_partials(q_big, k_cache, v_cache, tables, lens, scale, 3)
    expected = decode_attention(q_big, k_cache, v_cache, tables, lens, scale)
    unshifted = (lses.exp()[..., None] * outs).sum(-2) / lses.exp().sum(-1)[..., None]
    with pytest.raises(AssertionError):
        assert_close(unshifted, expected, **EXACT)
    assert_close(combine_partials(outs, lses)[0], expected, **EXACT)


def test_walk_checks_heads():
    q = torch.zeros(1, 3, 4, dtype=DT)
    k_cache = torch.zeros(2, 4, 2, 4, dtype=DT)
    table, lens = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    with pytest.raises(ValueError, match="num_heads=3 must be a multiple of num_kv_heads=2"):
        walk_blocks(q, k_cache, k_cache, table, lens, 1.0, range(1))


# --- bytes moved
# ----------------------------------------------------------------------------------------


def test_byte_counts_of_a_small_case_by_hand():
    # Two sequences of 3 and 9 tokens, blocks of 4 (tables of 1 and 3 blocks: width 3), 2 query
    # heads sharing 1 kv head, head_dim 2, float64 everywhere. One position's K and V: 2 * 1 * 2 * 8
    # = 32 bytes; one row of q or of the output: 2 heads * 2 * 8 = 32 bytes.
    shape = DecodeShape(
        context_lens=(3, 9),
        block_size=4,
        num_heads=2,
        num_kv_heads=1,
        head_dim=2,
        dtype_bytes=8,
        acc_bytes=8,
    )
    assert (shape.width, shape.kv_bytes_per_position, shape.head_bytes) == (3, 32, 32)
    q_out = 2 * 2 * 32  # 2 rows of q read, 2 rows of output written
    # Gather: 2 rows x 3 blocks x 4 positions = 24 positions read from the cache (768 B), written to
    # the copy and read back by SDPA (2 x 768 B).
    g = gather_sdpa_traffic(shape)
    assert (g.kv_read, g.kv_copy, g.scores, g.partials, g.q_out) == (768, 1536, 0, 0, q_out)
    assert g.total == 768 + 1536 + 128 == 2432
    # Materialized: + scores of 2 heads x 24 positions x 8 B = 384 B, written, read, written
    # (probs), read.
    assert (
        materialized_traffic(shape).scores == 4 * 384
        and materialized_traffic(shape).total == 2432 + 1536
    )
    # In place: only the 1 + 3 blocks the sequences own, 16 positions x 32 B.
    o = online_traffic(shape)
    assert (o.kv_read, o.kv_copy, o.scores, o.partials, o.total) == (512, 0, 0, 0, 512 + 128)
    # 2 splits of ceil(3 / 2) = 2 blocks: sequence 0 (1 block) runs 1 split, sequence 1 (3 blocks)
    # runs 2. Each of the 3 writes a partial of 2 heads x (2 + 1) x 8 B = 48 B, and the combine
    # reads it back; each reads q (3 x 32 B), and the combine writes the 2 output rows (2 x 32 B).
    s = split_kv_traffic(shape, 2)
    assert (s.kv_read, s.partials, s.q_out, s.total) == (
        512,
        2 * 3 * 48,
        3 * 32 + 2 * 32,
        512 + 288 + 160,
    )
    assert "total=960 B" in repr(s)


def test_byte_counts_from_tensors_and_their_relations():
    q, k_cache, v_cache, tables, lens, scale = ragged_batch(6, 4, 8, 2, extra_columns=5)
    shape = DecodeShape.of(q, k_cache, tables, lens)
    assert (
        shape.block_size,
        shape.num_heads,
        shape.num_kv_heads,
        shape.head_dim,
        shape.dtype_bytes,
    ) == (4, 8, 2, 8, 8)
    assert shape.width == tables.shape[1] and shape.context_lens == tuple(lens.tolist())
    # The padded width costs the gather, not the walk; the walk reads what it owns and no more than
    # the gather.
    narrow = replace(shape, table_width=None)
    assert online_traffic(narrow) == online_traffic(shape)
    assert gather_sdpa_traffic(narrow).kv_read < gather_sdpa_traffic(shape).kv_read
    assert online_traffic(shape).kv_read <= gather_sdpa_traffic(narrow).kv_read
    # One split: one partial per sequence.
    one = split_kv_traffic(shape, 1)
    assert one.partials == 2 * len(lens) * 8 * (8 + 1) * 4
