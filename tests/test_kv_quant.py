"""The KV cache in another dtype than the model's (kv_cache_dtype, kv_quant.py): fp8 rounding and
scales, the paged attention paths reading it back, the capacity it buys, and generation through
every scheduler path (chunked prefill, preemption by recompute and by swap, CUDA-graph
emulation)."""

import pytest
import torch

from minicb import LLM, Engine, EngineConfig, SamplingParams
from minicb.model_executor.attention import (
    AttentionMetadata,
    decode_attention,
    paged_attention,
    store_kv,
)
from minicb.model_executor.kv_quant import (
    FP8,
    KVQuant,
    cache_dtype_of,
    from_fp8,
    round_trip,
    to_fp8,
)
from minicb.model_executor.loader import load_model, save_tiny_model
from minicb.model_executor.ragged_attention import decode_groups, grouped_decode_attention
from minicb.model_executor.tiny_models import tiny_config
from minicb.worker.kv_cache import KVCache

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model(
        save_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama", seed=5), dtype=torch.float64
    )


def test_fp8_rounding_keeps_three_mantissa_bits_and_clips_at_448_times_scale():
    x = torch.tensor(
        [0.0, 1.0, -1.5, 3.0, 0.3, 17.0, 440.0, 448.0, 500.0, -1e6], dtype=torch.float64
    )
    back = round_trip(x)
    assert back[:4].tolist() == [0.0, 1.0, -1.5, 3.0]  # fp8 numbers come back exactly
    assert back[-2:].tolist() == [448.0, -448.0]  # clipped, not NaN
    normal = x[1:8]
    # half a step of 3 mantissa bits
    assert ((back[1:8] - normal).abs() / normal.abs()).max() <= 2**-4
    scaled = round_trip(x, scale=4.0)  # the scale moves the range: +-448 x 4
    # 500 / 4 = 125 is stored as 128
    assert scaled[-1].item() == -1792.0 and scaled[8].item() == 512.0
    stored = to_fp8(x, torch.tensor(1.0))
    assert (
        stored.dtype == torch.uint8
        and from_fp8(stored, torch.tensor(2.0), torch.float32)[1].item() == 2.0
    )


def test_cache_dtype_names_and_clear_errors():
    assert cache_dtype_of("auto", torch.float32) == torch.float32
    assert cache_dtype_of("fp8", torch.bfloat16) == FP8 == cache_dtype_of("fp8_e4m3", torch.float32)
    assert cache_dtype_of("bfloat16", torch.float32) == torch.bfloat16
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'int4'.*'fp8'"):
        cache_dtype_of("int4", torch.float32)
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'fp4'"):
        EngineConfig(kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="calculate_kv_scales needs an fp8 KV cache.*'auto'"):
        EngineConfig(calculate_kv_scales=True)
    EngineConfig(kv_cache_dtype="fp8", calculate_kv_scales=True)  # fine


def test_same_bytes_buy_twice_the_blocks_of_bfloat16_and_four_times_float32(loaded):
    budget = 2**20
    blocks = {
        kind: Engine(
            EngineConfig(
                dtype="float32", kv_cache_dtype=kind, kv_cache_memory_bytes=budget, block_size=4
            ),
            loaded,
        ).config.num_blocks
        for kind in ("auto", "bfloat16", "fp8")
    }
    assert blocks["fp8"] >= 1.9 * blocks["bfloat16"]
    assert blocks["fp8"] >= 3.9 * blocks["auto"]
    engine = Engine(
        EngineConfig(
            dtype="float32", kv_cache_dtype="fp8", kv_cache_memory_bytes=budget, block_size=4
        ),
        loaded,
    )
    # + the sink
    assert engine.kv_cache.num_bytes <= budget + engine.kv_cache.num_bytes // (blocks["fp8"] + 1)
    assert engine.kv_cache.k.dtype == torch.uint8 and "float8_e4m3fn" in repr(engine.kv_cache)


def random_paged(cfg, quant, num_blocks=24, block_size=4, seed=0):
    """A KV cache filled with random K/V through `quant`, and the full-precision values it was
    given."""
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(
        cfg,
        num_blocks,
        block_size,
        torch.float64,
        "cpu",
        cache_dtype=quant.cache_dtype if quant else None,
    )
    kv_heads, head_dim = cache.num_kv_heads, cache.head_dim
    locs = torch.arange(num_blocks * block_size)
    k = torch.randn(len(locs), kv_heads, head_dim, generator=g, dtype=torch.float64) * 3
    v = torch.randn(len(locs), kv_heads, head_dim, generator=g, dtype=torch.float64)
    store_kv(k, v, cache.k_caches[0], cache.v_caches[0], locs, quant)
    return cache, k, v


@pytest.mark.parametrize("scale", [1.0, 0.01])
def test_every_attention_path_reads_fp8_back_as_the_rounded_values(scale):
    cfg = tiny_config("llama", num_attention_heads=4, num_key_value_heads=2, hidden_size=32)
    quant = KVQuant(FP8, "cpu")
    quant.k_scale.fill_(scale), quant.v_scale.fill_(scale)
    cache, k, v = random_paged(cfg, quant)
    ref, _, _ = random_paged(cfg, None)  # the same K/V in float64, rounded through fp8 by hand
    ref.k_caches[0].view(-1, *k.shape[1:])[: len(k)].copy_(round_trip(k, scale))
    ref.v_caches[0].view(-1, *v.shape[1:])[: len(v)].copy_(round_trip(v, scale))
    g = torch.Generator().manual_seed(1)
    tables = [[3, 7, 1], [0], [9, 2, 5, 11, 4, 6], [8, 10]]
    lens = [10, 3, 22, 8]
    q = torch.randn(len(tables), 4, cache.head_dim, generator=g, dtype=torch.float64)
    meta = AttentionMetadata.build(tables, lens, [1] * 4, 4, 4, cache.sink_block_id)
    args = (meta.block_tables, meta.context_lens, 0.3)
    want = decode_attention(q, ref.k_caches[0], ref.v_caches[0], *args)
    got = decode_attention(q, cache.k_caches[0], cache.v_caches[0], *args, quant=quant)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    groups = decode_groups(tables, lens, 4, cache.sink_block_id, torch.float64, "cpu")
    got = grouped_decode_attention(q, cache.k_caches[0], cache.v_caches[0], groups, 0.3, quant)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # A whole prompt with nothing cached before still reads its K/V back from the fp8 cache.
    new_k, new_v = k[:6] * 1.01, v[:6] * 1.01
    q6 = torch.randn(6, 4, cache.head_dim, generator=g, dtype=torch.float64)
    meta = AttentionMetadata.build([[12, 13]], [6], [6], 0, 4, cache.sink_block_id)
    got = paged_attention(
        q6, new_k, new_v, cache.k_caches[0], cache.v_caches[0], meta, 0.3, quant=quant
    )
    want = paged_attention(
        q6,
        round_trip(new_k, scale),
        round_trip(new_v, scale),
        ref.k_caches[0],
        ref.v_caches[0],
        meta,
        0.3,
    )
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def run(loaded, prompts, **config):
    llm = LLM.from_loaded(loaded, dtype="float64", block_size=4, max_model_len=64, **config)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # nothing leaked
    return [o.outputs[0].token_ids for o in outs], llm.engine


PROMPTS = [
    [5, 9, 2, 7, 1, 3, 8, 4, 6, 10, 11, 12, 13, 3, 5],
    [7] * 21,
    [9, 8, 1],
    [2, 4, 6, 8, 10, 12, 14, 16, 18],
]


def test_fp8_generation_through_chunked_prefill_and_preemption_is_the_fp8_engine_unchunked(loaded):
    base, engine = run(
        loaded,
        PROMPTS,
        kv_cache_dtype="fp8",
        num_blocks=64,
        enable_chunked_prefill=False,
        max_num_batched_tokens=64,
    )
    assert engine.kv_cache.quant[0].is_fp8
    chunked, _ = run(loaded, PROMPTS, kv_cache_dtype="fp8", num_blocks=64, max_num_batched_tokens=8)
    assert chunked == base
    for mode in ("recompute", "swap"):
        tight, engine = run(
            loaded,
            PROMPTS,
            kv_cache_dtype="fp8",
            num_blocks=12,
            preemption_mode=mode,
            max_num_batched_tokens=8,
        )
        assert tight == base, mode
        assert any(r.preempted or r.swapped_out for r in engine.trace), (
            f"{mode}: the test must preempt"
        )


def test_bfloat16_cache_under_a_float64_model_runs_and_rounds(loaded):
    outs, engine = run(loaded, PROMPTS, kv_cache_dtype="bfloat16", num_blocks=64)
    assert engine.kv_cache.k.dtype == torch.bfloat16 and all(len(o) == 12 for o in outs)


def stored_max_code(engine, layer=0):
    """The largest |fp8 value| stored in one layer's K cache (before multiplying by the scale)."""
    return engine.kv_cache.k_caches[layer].view(FP8).float().abs().max().item()


def test_calculated_scales_map_the_first_forwards_amax_to_200(loaded):
    llm = LLM.from_loaded(
        loaded,
        dtype="float64",
        block_size=4,
        num_blocks=64,
        kv_cache_dtype="fp8",
        calculate_kv_scales=True,
    )
    quant = llm.engine.kv_cache.quant
    assert all(q.calibrate and q.k_scale.item() == 1.0 for q in quant)
    llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)
    assert not any(q.calibrate for q in quant)
    assert all(q.k_scale.item() != 1.0 and q.v_scale.item() != 1.0 for q in quant)
    # 200 rounded to fp8 is 192 or 208; later tokens may be larger
    assert 190 <= stored_max_code(llm.engine) <= 448
    first = [q.k_scale.item() for q in quant]
    llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)
    assert [q.k_scale.item() for q in quant] == first  # set once, as vLLM does


def test_fp8_decode_in_the_cuda_graph_emulation_matches_eager_and_capture_does_not_calibrate(
    loaded,
):
    eager, _ = run(
        loaded,
        PROMPTS,
        kv_cache_dtype="fp8",
        num_blocks=64,
        calculate_kv_scales=True,
        use_cuda_graph=False,
    )
    llm = LLM.from_loaded(
        loaded,
        dtype="float64",
        block_size=4,
        max_model_len=64,
        kv_cache_dtype="fp8",
        num_blocks=64,
        calculate_kv_scales=True,
        use_cuda_graph=True,
    )
    quant = llm.engine.kv_cache.quant
    # Capture ran decode steps on padding: had they calibrated, the scales would come from the
    # sink's zeros.
    assert all(q.calibrate and q.k_scale.item() == 1.0 for q in quant)
    graphs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert graphs == eager
    assert any(r.graph_bucket is not None for r in llm.engine.trace), (
        "no decode step ran in a graph"
    )
    assert not any(q.calibrate for q in quant) and all(q.k_scale.item() != 1.0 for q in quant)


def test_accuracy_report_arithmetic_and_figures():
    from minicb.bench.kv_fp8 import Fp8Report, VariantResult, first_difference
    from minicb.viz.kv_fp8 import fp8_accuracy, fp8_grid, scale_sweep

    assert (
        first_difference([1, 2, 3], [1, 2, 3]) is None
        and first_difference([1, 5, 3], [1, 2, 3]) == 1
    )
    ref = VariantResult(
        "float32 (reference)",
        [[1, 2, 3], [4, 5]],
        [[7, 7, 7], [8, 8]],
        [torch.ones(4, 2), torch.ones(4, 2)],
    )
    fp8 = VariantResult(
        "fp8, scale 1.0",
        [[1, 9, 3], [4, 5]],
        [[7, 0, 7], [8, 8]],
        [torch.ones(4, 2) * 1.01, torch.ones(4, 2) * 0.9],
    )
    report = Fp8Report([[0], [0]], {ref.name: ref, fp8.name: fp8})
    assert report.top1_agreement("fp8, scale 1.0") == 4 / 5
    assert report.first_divergence("fp8, scale 1.0") == [1, None]
    assert [round(e, 6) for e in report.attention_errors("fp8, scale 1.0")] == [0.01, 0.1]
    assert "80.0%" in report.table() and "[1, -]" in report.table()
    for fig in (
        fp8_grid([2.0**-9, 0.5, 1.0, 448.0]),
        scale_sweep([1.0, 2.0], {"K": [0.1, 0.2]}, {"1.0": 1.0}),
        fp8_accuracy({"fp8": [0.1, 0.2]}, {"fp8": 0.9}, {"fp8": [3, None]}, 48),
    ):
        assert fig.axes
