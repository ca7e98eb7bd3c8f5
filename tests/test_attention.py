"""Paged attention and the KV cache against dense attention written out the slow, obvious way
(float64)."""

import random

import pytest
import torch
from transformers import LlamaConfig

import minicb.model_executor.attention
import minicb.model_executor.cpu_attention
from minicb.model_executor.attention import (
    AttentionMetadata,
    decode_attention,
    paged_attention,
    prefill_attention,
    store_kv,
)
from minicb.model_executor.hf_config import kv_bytes_per_token
from minicb.worker.kv_cache import KVCache

DT = torch.float64
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8  # grouped-query: 2 query heads per kv head
SCALE = HEAD_DIM**-0.5


def small_config(layers=2):
    return LlamaConfig(
        hidden_size=32,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        num_hidden_layers=layers,
        intermediate_size=64,
        vocab_size=64,
    )


def random_cache(num_blocks, block_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks + 1, block_size, KV_HEADS, HEAD_DIM)  # + the sink block
    return torch.randn(shape, generator=g, dtype=DT), torch.randn(shape, generator=g, dtype=DT)


def dense_attention(q, keys, values, query_positions, sliding_window=None, sinks=None):
    """q: (n, HEADS, D) at absolute query_positions; keys/values: (ctx, KV_HEADS, D) at positions
    0..ctx-1; sinks: (HEADS,), gpt-oss's logit per head, one more column of every softmax that is
    dropped after it."""
    group = HEADS // KV_HEADS
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * SCALE
    k_pos = torch.arange(keys.shape[0])
    allowed = k_pos[None, :] <= torch.as_tensor(query_positions)[:, None]
    if sliding_window is not None:
        allowed &= k_pos[None, :] > torch.as_tensor(query_positions)[:, None] - sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:  # (HEADS, n, ctx + 1): the sink's column last
        sink_column = sinks[:, None, None].expand(-1, scores.shape[1], 1)
        probs = torch.cat((scores, sink_column), dim=-1).softmax(-1)[..., :-1]
        return torch.einsum("hqk,khd->qhd", probs, values)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def random_sinks(with_sinks: bool):
    """gpt-oss's sinks, large enough to take much of a row's mass, or None."""
    return (
        torch.randn(HEADS, dtype=DT, generator=torch.Generator().manual_seed(7)) * 2
        if with_sinks
        else None
    )


def cached_tokens(cache, table, ctx, block_size):
    """Read a sequence's first ctx slots one by one: (ctx, KV_HEADS, D)."""
    return torch.stack([cache[table[p // block_size], p % block_size] for p in range(ctx)])


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("sliding_window", [None, 3])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_decode_attention_equals_dense_masked_attention(block_size, sliding_window, with_sinks):
    num_blocks = 40
    k_cache, v_cache = random_cache(num_blocks, block_size)
    rng = random.Random(block_size)
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    context_lens = [1, 5, 17, 9]
    tables = []
    for ctx in context_lens:
        n = -(-ctx // block_size)
        tables.append([ids.pop() for _ in range(n)])
    meta = AttentionMetadata.build(tables, context_lens, [1] * 4, 4, block_size, num_blocks)
    q = torch.randn(4, HEADS, HEAD_DIM, dtype=DT)
    sinks = random_sinks(with_sinks)
    out = decode_attention(
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.context_lens,
        SCALE,
        sliding_window,
        None,
        sinks,
    )
    for i, (table, ctx) in enumerate(zip(tables, context_lens)):
        keys = cached_tokens(k_cache, table, ctx, block_size)
        values = cached_tokens(v_cache, table, ctx, block_size)
        expected = dense_attention(q[i : i + 1], keys, values, [ctx - 1], sliding_window, sinks)[0]
        torch.testing.assert_close(out[i], expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("sliding_window", [None, 3])
def test_decode_rows_of_several_queries_apply_the_sinks(sliding_window):
    # a speculative row's 1 + k queries share one gather: each query slot and head its own sink
    block_size, num_blocks = 4, 12
    k_cache, v_cache = random_cache(num_blocks, block_size, seed=3)
    tables, lens = torch.tensor([[3, 7, 1], [5, 2, 12]]), torch.tensor([10, 7])
    q = torch.randn(2, 3, HEADS, HEAD_DIM, dtype=DT)  # (rows, Q, heads, head_dim)
    sinks = random_sinks(True)
    out = decode_attention(q, k_cache, v_cache, tables, lens, SCALE, sliding_window, None, sinks)
    for i in range(2):
        ctx = int(lens[i])
        keys = cached_tokens(k_cache, tables[i].tolist(), ctx, block_size)
        values = cached_tokens(v_cache, tables[i].tolist(), ctx, block_size)
        positions = list(range(ctx - 3, ctx))
        expected = dense_attention(q[i], keys, values, positions, sliding_window, sinks)
        torch.testing.assert_close(out[i], expected, rtol=0, atol=1e-12)


def test_decode_attention_does_not_depend_on_the_gather_width():
    # Inside a CUDA graph the table width is fixed (max_model_len / block_size), in eager mode it
    # follows the longest table: extra sink columns must not change a single bit.
    block_size, num_blocks = 4, 12
    k_cache, v_cache = random_cache(num_blocks, block_size, seed=1)
    tables = torch.tensor([[3, 7, 1], [5, 12, 12]])  # 12 = sink padding
    lens = torch.tensor([10, 2])
    q = torch.randn(2, HEADS, HEAD_DIM, dtype=DT)
    exact = decode_attention(q, k_cache, v_cache, tables, lens, SCALE)
    wide_tables = torch.cat([tables, torch.full((2, 9), 12)], dim=1)
    wide = decode_attention(q, k_cache, v_cache, wide_tables, lens, SCALE)
    torch.testing.assert_close(wide, exact, rtol=0, atol=1e-14)


def test_padded_rows_write_only_the_sink_and_do_not_change_real_rows():
    block_size, num_blocks = 4, 10
    cache = KVCache(small_config(layers=1), num_blocks, block_size, DT, "cpu")
    k_cache, v_cache = cache.k_caches[0], cache.v_caches[0]
    k_cache.copy_(torch.randn_like(k_cache))
    v_cache.copy_(torch.randn_like(v_cache))
    sink = cache.sink_block_id

    tables, lens = [[2, 6], [9]], [6, 3]  # two real decodes: positions 5 and 2
    real = AttentionMetadata.build(tables, lens, [1, 1], 2, block_size, sink)
    # the same two rows plus three padded rows, as a graph bucket of 5 would see them
    padded = AttentionMetadata(
        cache_locs=torch.cat([real.cache_locs, torch.full((3,), cache.sink_loc)]),
        block_tables=torch.cat([real.block_tables, torch.full((3, 2), sink)]),
        context_lens=torch.cat([real.context_lens, torch.ones(3, dtype=torch.long)]),
        query_start_loc=torch.arange(6),
        num_decodes=5,
        query_start_loc_host=list(range(6)),
        context_lens_host=lens + [1, 1, 1],
    )

    q, k, v = (torch.randn(5, h, HEAD_DIM, dtype=DT) for h in (HEADS, KV_HEADS, KV_HEADS))
    k_before, v_before = k_cache.clone(), v_cache.clone()
    out_real = paged_attention(q[:2], k[:2], v[:2], k_cache, v_cache, real, SCALE)
    k_after_real, v_after_real = k_cache.clone(), v_cache.clone()

    k_cache.copy_(k_before)
    v_cache.copy_(v_before)
    out_padded = paged_attention(q, k, v, k_cache, v_cache, padded, SCALE)
    # every block but the sink holds exactly what the real rows alone wrote
    assert torch.equal(k_cache[:sink], k_after_real[:sink])
    assert torch.equal(v_cache[:sink], v_after_real[:sink])
    assert not torch.equal(k_cache[sink], k_before[sink])  # the padding did land in the sink
    torch.testing.assert_close(out_padded[:2], out_real, rtol=0, atol=1e-14)
    # and the real rows did write their slots: block 6 offset 1 (position 5), block 9 offset 2
    assert torch.equal(k_cache[6, 1], k[0]) and torch.equal(v_cache[9, 2], v[1])


@pytest.mark.parametrize("sliding_window", [None, 4])
@pytest.mark.parametrize(
    "causal_devices", [("cuda",), ("cuda", "cpu")]
)  # the second: whole prompts with is_causal
@pytest.mark.parametrize("explicit_scores_max", [0, 2**24])  # masked chunks: SDPA / explicit
@pytest.mark.parametrize("with_sinks", [False, True])
def test_prefill_attention_over_a_cached_prefix_equals_dense_causal_attention(
    sliding_window, causal_devices, explicit_scores_max, with_sinks, monkeypatch
):
    monkeypatch.setattr(minicb.model_executor.attention, "CAUSAL_FLASH_DEVICES", causal_devices)
    monkeypatch.setattr(
        minicb.model_executor.cpu_attention, "EXPLICIT_SCORES_MAX", explicit_scores_max
    )
    block_size, num_blocks = 3, 20
    k_cache, v_cache = random_cache(num_blocks, block_size, seed=2)
    # seq 0: decode; seq 1: chunk of 4 after a cached prefix of 7; seq 2: fresh prompt of 5
    tables = [[4], [11, 2, 17, 8], [0, 19]]
    context_lens, query_lens = [2, 11, 5], [1, 4, 5]
    meta = AttentionMetadata.build(tables, context_lens, query_lens, 1, block_size, num_blocks)
    n = sum(query_lens)
    q, k, v = (torch.randn(n, h, HEAD_DIM, dtype=DT) for h in (HEADS, KV_HEADS, KV_HEADS))
    sinks = random_sinks(with_sinks)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, SCALE, sliding_window, None, sinks)
    assert out.shape == (n, HEADS, HEAD_DIM)

    start = 0
    for table, ctx, qlen in zip(tables, context_lens, query_lens):
        keys = cached_tokens(k_cache, table, ctx, block_size)
        values = cached_tokens(v_cache, table, ctx, block_size)
        # stored
        torch.testing.assert_close(keys[ctx - qlen :], k[start : start + qlen], rtol=0, atol=0)
        positions = list(range(ctx - qlen, ctx))
        expected = dense_attention(
            q[start : start + qlen], keys, values, positions, sliding_window, sinks
        )
        torch.testing.assert_close(out[start : start + qlen], expected, rtol=0, atol=1e-12)
        start += qlen
    # prefill_attention alone returns only the prefill rows
    assert prefill_attention(q, k, v, k_cache, v_cache, meta, SCALE).shape == (
        n - 1,
        HEADS,
        HEAD_DIM,
    )


def test_metadata_build_cache_locs_and_padding():
    meta = AttentionMetadata.build([[7], [2, 5]], [3, 6], [1, 3], 1, block_size=4, pad_block_id=9)
    # seq 0 decodes position 2 in block 7; seq 1 prefills positions 3, 4, 5 -> block 2 offset 3,
    # block 5 offsets 0, 1
    assert meta.cache_locs.tolist() == [7 * 4 + 2, 2 * 4 + 3, 5 * 4 + 0, 5 * 4 + 1]
    assert meta.block_tables.tolist() == [[7, 9], [2, 5]]
    assert meta.query_start_loc.tolist() == meta.query_start_loc_host == [0, 1, 4]
    assert (meta.num_seqs, meta.num_tokens) == (2, 4)
    with pytest.raises(ValueError, match="cannot hold context_len"):
        AttentionMetadata.build([[1]], [5], [5], 0, block_size=4, pad_block_id=9)
    with pytest.raises(ValueError, match="decode_query_len=1"):  # a decode row of 2 tokens
        AttentionMetadata.build(
            [[1]], [3], [2], 1, block_size=4, pad_block_id=9, decode_query_len=1
        )
    # a verifying row is one decode row of 1 + k tokens: its own row, right-aligned in the layout
    meta = AttentionMetadata.build([[1], [2]], [3, 4], [1, 3], 2, block_size=4, pad_block_id=9)
    assert (meta.num_decodes, meta.num_decode_tokens, meta.decode_query_len) == (2, 4, 3)
    assert meta.decode_slots.tolist() == [2, 3, 4, 5]


def test_store_kv_writes_exactly_the_mapped_slots():
    k_cache, v_cache = torch.zeros(2, 3, 5, KV_HEADS, HEAD_DIM, dtype=DT).unbind(0)
    k, v = torch.randn(2, 2, KV_HEADS, HEAD_DIM, dtype=DT).unbind(0)
    store_kv(k, v, k_cache, v_cache, torch.tensor([7, 0]))  # slot 7 = block 1, offset 2
    assert torch.equal(k_cache[1, 2], k[0]) and torch.equal(v_cache[0, 0], v[1])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 2


# --- KVCache --------------------------------------------------------------------------------------


def test_kv_bytes_per_token_smollm2():
    smollm2 = LlamaConfig(
        hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30
    )
    assert kv_bytes_per_token(smollm2, torch.float32) == 46080  # 2 * 30 * 3 * 64 * 4
    assert kv_bytes_per_token(smollm2, torch.bfloat16) == 23040


def test_kv_cache_shapes_sink_and_repr():
    cache = KVCache(
        small_config(), num_blocks=5, block_size=4, dtype=DT, device="cpu", num_cpu_blocks=3
    )
    assert len(cache.k_caches) == len(cache.v_caches) == 2
    assert cache.k_caches[1].shape == (6, 4, KV_HEADS, HEAD_DIM)  # 5 blocks + the sink
    assert (cache.sink_block_id, cache.sink_loc) == (5, 20)
    assert cache.num_bytes == 2 * 2 * 6 * 4 * KV_HEADS * HEAD_DIM * 8
    text = repr(cache)
    assert "blocks=5 + 1 sink" in text and "block_size=4" in text and "float64" in text
    with pytest.raises(ValueError, match="num_blocks"):
        KVCache(small_config(), num_blocks=0, block_size=4, dtype=DT, device="cpu")


def test_swap_out_then_in_to_other_blocks_round_trips_exactly():
    cache = KVCache(
        small_config(), num_blocks=6, block_size=2, dtype=DT, device="cpu", num_cpu_blocks=4
    )
    for t in (*cache.k_caches, *cache.v_caches):
        t.copy_(torch.randn_like(t))
    before_k, before_v = cache.k.clone(), cache.v.clone()
    cache.swap_out([(1, 3), (4, 0)])
    cache.k.zero_()
    cache.v.zero_()
    cache.swap_in([(0, 2), (3, 5)])  # block 4 comes back as 2, block 1 as 5
    for layer in range(2):
        assert torch.equal(cache.k_caches[layer][2], before_k[layer, 4])
        assert torch.equal(cache.v_caches[layer][5], before_v[layer, 1])
    assert torch.equal(cache.k[:, [0, 1, 3, 4]], torch.zeros_like(cache.k[:, [0, 1, 3, 4]]))
    with pytest.raises(ValueError, match="out of range"):
        cache.swap_out([(6, 0)])  # the sink block is never swapped
    with pytest.raises(ValueError, match="out of range"):
        cache.swap_in([(4, 0)])
