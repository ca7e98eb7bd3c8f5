"""A speculative verifying row is ONE decode row of 1 + k query tokens (vLLM V1), on every attention
path: its queries attend causally within the row and to the cache, which is read once for all of
them. Checked in float64 against dense attention written out token by token, on batches whose rows
verify 0..k drafts side by side, and by counting the K/V bytes a verifying step gathers."""

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minicb import LLM, SamplingParams
from minicb.core.request import Request
from minicb.core.scheduler import ScheduledRequest, SchedulerOutput
from minicb.model_executor.attention import AttentionMetadata, paged_attention
from minicb.model_executor.kv_quant import FP8, KVQuant
from minicb.model_executor.loader import load_model, save_tiny_model
from minicb.model_executor.paged_flash import (
    chunk_attention_reference,
    page_pairs,
    pairs_attention_reference,
)
from minicb.model_executor.ragged_attention import decode_groups
from minicb.worker.model_runner import host_inputs

HEADS, KV_HEADS, HEAD_DIM, SCALE = 6, 2, 8, 0.3
K = 4  # drafts per verifying row: query lengths 1..5


def mixed_batch(seed: int, block_size: int, num_drafts: list[int], prefill=(7, 5)):
    """Decode rows verifying num_drafts[i] drafts (query_len 1 + num_drafts[i]), then one prefill
    chunk (prefix, chunk). Returns the cache, the step's q/k/v and the metadata's lists."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    query_lens = [1 + d for d in num_drafts] + [prefill[1]]
    context_lens = [rng.randint(q, 40) for q in query_lens[:-1]] + [sum(prefill)]
    blocks = [-(-c // block_size) for c in context_lens]
    free = list(range(sum(blocks)))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in blocks]
    shape = (sum(blocks) + 1, block_size, KV_HEADS, HEAD_DIM)  # + the sink
    k_cache = torch.randn(shape, generator=g, dtype=torch.float64)
    v_cache = torch.randn(shape, generator=g, dtype=torch.float64)
    k_cache[-1], v_cache[-1] = 1e6, -1e6  # padding that leaked into a result would show
    tokens = sum(query_lens)
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=g, dtype=torch.float64)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=g, dtype=torch.float64)
    v = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=g, dtype=torch.float64)
    return k_cache, v_cache, q, k, v, tables, context_lens, query_lens


def dense(q, keys, values, positions, sliding_window=None):
    """Token by token: query at positions[i] sees keys 0..positions[i] (and the window)."""
    group = HEADS // KV_HEADS
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    k_pos, q_pos = torch.arange(keys.shape[0]), torch.tensor(positions)[:, None]
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= k_pos > q_pos - sliding_window
    scores = torch.einsum("qhd,khd->hqk", q, keys) * SCALE
    return torch.einsum(
        "hqk,khd->qhd", scores.masked_fill(~allowed, -torch.inf).softmax(-1), values
    )


def expected(
    q, k_cache, v_cache, tables, context_lens, query_lens, sliding_window=None, quant=None
):
    """Dense attention of every token over its row's cache (read after the step's writes)."""
    outs, start = [], 0
    bs = k_cache.shape[1]
    for table, ctx, qlen in zip(tables, context_lens, query_lens):
        keys = k_cache[table].flatten(0, 1)[:ctx]
        values = v_cache[table].flatten(0, 1)[:ctx]
        if quant is not None:
            keys, values = quant.dequantize(keys, values, torch.float64)
        assert keys.shape[0] == ctx <= len(table) * bs
        positions = list(range(ctx - qlen, ctx))
        outs.append(dense(q[start : start + qlen], keys, values, positions, sliding_window))
        start += qlen
    return torch.cat(outs)


DRAFT_MIXES = {  # every draft count 0..K in one batch, in several orders
    "all_counts": [0, 1, 2, 3, 4],
    "reversed": [4, 3, 2, 1, 0, 4],
    "uniform": [4, 4, 4],
    "one_token": [0, 0],
}


@pytest.mark.parametrize("mix", list(DRAFT_MIXES))
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("path", ["reference", "window", "grouped", "flash_pages", "fp8"])
def test_verify_rows_of_mixed_draft_counts_equal_dense_attention(path, block_size, mix):
    num_drafts = DRAFT_MIXES[mix]
    k_cache, v_cache, q, k, v, tables, ctx, qlens = mixed_batch(len(mix), block_size, num_drafts)
    nd = len(num_drafts)
    sink = k_cache.shape[0] - 1
    meta = AttentionMetadata.build(tables, ctx, qlens, nd, block_size, sink)
    assert (meta.num_decodes, meta.num_decode_tokens) == (nd, sum(qlens[:nd]))
    assert meta.decode_query_len == 1 + max(num_drafts)
    window = 3 if path == "window" else None
    quant = None
    if path == "grouped":
        meta.decode_groups = decode_groups(
            tables[:nd], ctx[:nd], block_size, sink, torch.float64, "cpu", qlens[:nd]
        )
    if path == "flash_pages":
        meta.pages = page_pairs(
            meta.block_tables[:nd],
            meta.context_lens[:nd],
            block_size,
            k_cache.shape[0] * block_size,
            meta.decode_query_len,
            meta.query_start_loc[: nd + 1],
            meta.decode_slots,
        )
    if path == "fp8":  # the cache holds fp8 codes; every read is the rounded value
        quant = KVQuant(FP8, "cpu")
        k_cache = torch.zeros(k_cache.shape, dtype=quant.storage_dtype())
        v_cache = torch.zeros_like(k_cache)
    got = paged_attention(q, k, v, k_cache, v_cache, meta, SCALE, window, quant)
    want = expected(q, k_cache, v_cache, tables, ctx, qlens, window, quant)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------ K/V bytes read
class CacheReads(TorchDispatchMode):
    """Sums the bytes index_select gathers from the K/V cache tensors (any view of them)."""

    def __init__(self, caches):
        super().__init__()
        self.storages = {c.untyped_storage().data_ptr() for c in caches}
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        source = args[0] if args else None
        reads_cache = (
            func is torch.ops.aten.index_select.default
            and source.untyped_storage().data_ptr() in self.storages
        )
        if reads_cache:  # one row of dim 0 per index: a block of block_size tokens
            self.bytes += args[2].numel() * source[0].numel() * source.element_size()
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama", seed=1)
    llm = LLM.from_loaded(
        load_model(path, dtype=torch.float64), dtype="float64", block_size=4, num_blocks=64
    )
    return llm.engine.runner


def verify_step(context: int, num_rows: int, block_size: int) -> SchedulerOutput:
    """num_rows requests of `context` tokens after this step, each verifying K drafts."""
    rows = []
    for i in range(num_rows):
        start = context - 1 - K
        req = Request(f"r{i}", list(range(2, 3 + start)), SamplingParams(max_tokens=8))
        table = list(range(i * 16, i * 16 + -(-context // block_size)))
        drafts = [5] * K
        rows.append(ScheduledRequest(req, start, 1 + K, False, True, table, i, drafts))
    return SchedulerOutput(step=1, scheduled=rows, num_batched_tokens=num_rows * (1 + K))


@pytest.mark.parametrize("grouped", [False, True])
def test_a_verifying_row_reads_its_cache_once(runner, grouped):
    """3 requests of 40 tokens verify 4 drafts each. One row per request gathers each one's 10
    blocks once per layer (1 x context); one row per token, the former design, gathered them
    k + 1 = 5 times. Counted on the reference path (grouped=False) and the grouped CPU path."""
    kv, bs = runner.kv_cache, runner.config.block_size
    layers = len(kv.k_caches)
    context, num_rows = 40, 3
    out = verify_step(context, num_rows, bs)
    h = host_inputs(out, bs)
    assert (h.num_decodes, h.num_decode_tokens, h.query_lens) == (3, 15, [5, 5, 5])
    input_ids, positions, meta, _ = runner.inputs_from_host(h)
    if not grouped:
        meta.decode_groups = None  # attention.decode_attention, the padded reference
    block_bytes = 2 * kv.k_caches[0][0].numel() * kv.k_caches[0].element_size()  # K and V
    once = layers * num_rows * (context // bs) * block_bytes  # 1 x context per request and layer
    with torch.inference_mode(), CacheReads([kv.k, kv.v]) as reads:
        runner.model(input_ids, positions, kv, meta)
    print(f"verify step, {num_rows} rows of {context} tokens verifying {K} drafts: gathered")
    print(f"  {reads.bytes} bytes = {reads.bytes / once:.2f} x context per request and layer")
    assert reads.bytes == once

    # The same step as one one-query row per token (the former host_inputs): (k + 1) x context.
    lens = [c for r in out.scheduled for c in range(r.start + 1, r.start + r.num_tokens + 1)]
    tables = [r.block_table[: -(-c // bs)] for r in out.scheduled for c in lens[: 1 + K]]
    per_token = AttentionMetadata.build(
        tables, lens, [1] * len(lens), len(lens), bs, kv.sink_block_id
    )
    with torch.inference_mode(), CacheReads([kv.k, kv.v]) as reads:
        runner.model(input_ids, positions, kv, per_token)
    print(f"  one row per token: {reads.bytes / once:.2f} x context")
    assert reads.bytes == (1 + K) * once


# ------------------------------------------------------------------------ on a GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_flash_kernels_take_rows_of_several_queries():
    """The CUDA flash kernels (pairs of Q queries, the rows' own tokens causal) against the padded
    reference and the plain-PyTorch kernels, bfloat16, rows verifying 0..k drafts."""
    k_cache, v_cache, q, k, v, tables, ctx, qlens = mixed_batch(0, 16, [0, 1, 2, 3, 4, 4, 2])
    bf = dict(device="cuda", dtype=torch.bfloat16)
    k_cache[-1], v_cache[-1] = 0.0, 0.0
    k_cache, v_cache, q, k, v = (t.to(**bf) for t in (k_cache, v_cache, q, k, v))
    nd, sink = 7, k_cache.shape[0] - 1
    meta = AttentionMetadata.build(tables, ctx, qlens, nd, 16, sink, "cuda")
    want = paged_attention(q, k, v, k_cache, v_cache, meta, SCALE)
    meta.pages = page_pairs(
        meta.block_tables[:nd],
        meta.context_lens[:nd],
        16,
        k_cache.shape[0] * 16,
        meta.decode_query_len,
        meta.query_start_loc[: nd + 1],
        meta.decode_slots,
    )
    assert meta.pages.kernel.__name__ == "pairs_attention_flash"
    got = paged_attention(q, k, v, k_cache, v_cache, meta, SCALE)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    meta.pages.kernel = pairs_attention_reference
    meta.pages.chunk_kernel = chunk_attention_reference
    ref = paged_attention(q, k, v, k_cache, v_cache, meta, SCALE)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
