"""The gather-free paged decode (paged_flash.py) on CPU: its (row, block) pairs, its combine, and
the engine running it end to end, exact against the padded reference and transformers in float64.
The CUDA kernel itself is compared with the reference kernel in tests/test_gpu.py."""

import pytest
import torch
from test_cuda_graph import GRAPH_CONFIGS, arch_model, check_graph_buckets, generate  # noqa: F401
from test_ragged_attention import ragged_batch

from minicb.config import EngineConfig
from minicb.model_executor.attention import decode_attention
from minicb.model_executor.hf_config import sliding_window_of
from minicb.model_executor.paged_flash import (
    choose_attention_backend,
    combine_pairs,
    flash_pages_attention,
    page_pairs,
    pairs_attention_reference,
)
from minicb.model_executor.tiny_models import tiny_config


def test_pairs_of_a_small_batch():
    # row 0: 5 tokens in blocks 7, 2 (block_size 4); row 1: 4 tokens in block 3, its second column
    # padding (sink 9)
    tables, lens = torch.tensor([[7, 2], [3, 9]]), torch.tensor([5, 4])
    pairs = page_pairs(tables, lens, block_size=4, num_locations=40)
    # block id x block_size, then the cache's rows
    assert pairs.cu_seq_k.tolist() == [28, 8, 12, 36, 40]
    assert pairs.used.tolist() == [4, 1, 4, 0]  # a column past the context holds 0 tokens
    assert pairs.cu_seq_q.tolist() == [0, 1, 2, 3, 4] and (pairs.rows, pairs.width) == (2, 2)
    assert pairs.cu_seq_k.dtype == pairs.used.dtype == torch.int32  # what the flash kernel takes


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "block_size, kv_heads, group", [(4, 2, 2), (16, 3, 3), (1, 1, 4), (8, 2, 1)]
)
def test_pages_equal_the_padded_reference(seed, block_size, kv_heads, group):
    batch = [1, 3, 17, 40][seed % 4]
    q, k_cache, v_cache, tables, lens, sink = ragged_batch(
        seed, batch, block_size, kv_heads, group, max_blocks=10
    )
    width = max(map(len, tables)) + seed % 3  # extra sink columns, as a graph's width bucket adds
    padded = torch.tensor([t + [sink] * (width - len(t)) for t in tables])
    expected = decode_attention(q, k_cache, v_cache, padded, torch.tensor(lens), 0.3)
    pairs = page_pairs(padded, torch.tensor(lens), block_size, k_cache.shape[0] * block_size)
    got = flash_pages_attention(q, k_cache, v_cache, pairs, 0.3)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_empty_pairs_never_count():
    """The flash kernel writes lse = +inf for a pair with no keys (its early exit). A combine that
    trusted it would give such a pair all the weight; the sink is filled with 1e6 so a leak would
    show."""
    q, k_cache, v_cache, tables, lens, sink = ragged_batch(0, 4, 4, 2, 2, max_blocks=3)
    padded = torch.tensor([t + [sink] * (6 - len(t)) for t in tables])
    pairs = page_pairs(padded, torch.tensor(lens), 4, k_cache.shape[0] * 4)
    out, lse = pairs_attention_reference(
        q[:, None].expand(4, 6, 4, 8).reshape(-1, 4, 8),
        k_cache.view(-1, 2, 8),
        v_cache.view(-1, 2, 8),
        pairs,
        4,
        0.3,
    )
    empty = (pairs.used == 0).nonzero().flatten()
    assert len(empty) >= 12 and torch.isinf(lse[:, empty]).all() and (lse[:, empty] > 0).all()
    assert (out[empty] == 0).all()
    expected = decode_attention(q, k_cache, v_cache, padded, torch.tensor(lens), 0.3)
    torch.testing.assert_close(combine_pairs(out, lse, pairs), expected, rtol=1e-12, atol=1e-12)


def test_backend_choice():
    llama = tiny_config("llama")
    cpu = EngineConfig(dtype="float64")
    # auto: flash pages on CUDA only
    assert choose_attention_backend(cpu, llama, quantized=False) == "gather"
    assert (
        choose_attention_backend(cpu.replace(attention_backend="flash_pages"), llama, False)
        == "flash_pages"
    )
    with pytest.raises(ValueError, match="quantized"):
        choose_attention_backend(
            cpu.replace(attention_backend="flash_pages"), llama, quantized=True
        )
    windowed = tiny_config("mistral", sliding_window=8)
    with pytest.raises(ValueError, match="sliding window"):
        choose_attention_backend(cpu.replace(attention_backend="flash_pages"), windowed, False)
    # gpt-oss is windowed too, but its sinks alone would turn flash pages away: the combine of the
    # pages' partials has no term for a sink
    sinks = tiny_config("gpt_oss", sliding_window=None)
    with pytest.raises(ValueError, match="attention sinks"):
        choose_attention_backend(cpu.replace(attention_backend="flash_pages"), sinks, False)


@pytest.mark.parametrize("name", ["bs16_cols16", "bs4_cols8_chunked", "bs1_cols40"])
def test_engine_with_flash_pages_matches_transformers(arch_model, name):  # noqa: F811
    """The whole engine, eager and through (emulated) graphs, decoding with pages in float64: the
    same tokens as transformers' generate. The pairs are built once a step eagerly, and inside the
    graph on replay. A windowed model is turned away (the pairs hold no window) and 'auto' runs
    the gather, with the same tokens."""
    loaded, refs = arch_model
    hf = loaded.hf_config
    if any(sliding_window_of(hf, i) for i in range(hf.num_hidden_layers)):
        with pytest.raises(ValueError, match="sliding window"):
            generate(
                loaded, use_cuda_graph=False, attention_backend="flash_pages", **GRAPH_CONFIGS[name]
            )
        tokens, engine = generate(loaded, use_cuda_graph=False, **GRAPH_CONFIGS[name])
        assert engine.runner.attention_backend == "gather" and tokens == refs
        return
    for graphs in (False, True):
        tokens, engine = generate(
            loaded, use_cuda_graph=graphs, attention_backend="flash_pages", **GRAPH_CONFIGS[name]
        )
        assert engine.runner.attention_backend == "flash_pages"
        assert tokens == refs
        if graphs:
            assert engine.runner.graph_runner.pages
            check_graph_buckets(engine, every_bucket=name != "bs4_cols8_chunked")
