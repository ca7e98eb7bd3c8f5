"""The gather-free paged decode (paged_flash.py) on CPU: its (row, block) pairs, its combine, and
the engine running it end to end, exact against the padded reference and transformers in float64.
The CUDA kernel itself is compared with the reference kernel in tests/test_gpu.py."""

import pytest
import torch
from test_cuda_graph import GRAPH_CONFIGS, arch_model, check_graph_buckets, generate  # noqa: F401
from test_ragged_attention import ragged_batch

from minicb.config import EngineConfig
from minicb.model_executor.attention import decode_attention
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


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("window", [1, 3, 5, 16])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
def test_pages_cut_to_a_window_and_with_sinks_equal_the_padded_reference(seed, window, with_sinks):
    """A windowed group's table points its blocks wholly before the window at the null block (the
    sink, filled with 1e6 by ragged_batch); each pair keeps only its tokens in the window, and a
    sink takes its share of the mass: the padded reference's answer, to float64 rounding."""
    q, k_cache, v_cache, tables, lens, sink = ragged_batch(seed, 9, 4, 2, 2, max_blocks=6)
    tables = [
        [sink if (j + 1) * 4 <= n - window else b for j, b in enumerate(t)]
        for t, n in zip(tables, lens)
    ]
    width = max(map(len, tables)) + 1
    padded = torch.tensor([t + [sink] * (width - len(t)) for t in tables])
    sinks = torch.randn(4, dtype=torch.float64) if with_sinks else None
    lens = torch.tensor(lens)
    expected = decode_attention(q, k_cache, v_cache, padded, lens, 0.3, window, None, sinks)
    pairs = page_pairs(padded, lens, 4, k_cache.shape[0] * 4, sliding_window=window)
    assert pairs.window == window and (pairs.used <= min(window, 4)).all()
    got = flash_pages_attention(q, k_cache, v_cache, pairs, 0.3, sinks=sinks)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    # without the cut, the null blocks' 1e6 would count
    uncut = page_pairs(padded, lens, 4, k_cache.shape[0] * 4)
    assert not torch.allclose(flash_pages_attention(q, k_cache, v_cache, uncut, 0.3), expected)


def test_a_window_with_rows_of_several_queries_reads_through_the_gather():
    from minicb.model_executor.attention import AttentionMetadata
    from minicb.model_executor.paged_flash import decode_pages

    meta = AttentionMetadata.build([[0, 1], [2]], [6, 3], [3, 1], 2, 4, 3)  # a row verifying 2
    assert decode_pages(meta, 4, 16, window=None).queries == 3
    assert decode_pages(meta, 4, 16, window=4) is None
    with pytest.raises(ValueError, match="rows of one query"):
        page_pairs(meta.block_tables, meta.context_lens, 4, 16, 3, meta.query_start_loc, None, 4)


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
    # sliding windows and attention sinks (gpt-oss) read the pages too, since 2026-11-28
    for hf in (tiny_config("mistral", sliding_window=8), tiny_config("gpt_oss")):
        pages = cpu.replace(attention_backend="flash_pages")
        assert choose_attention_backend(pages, hf, False) == "flash_pages"


@pytest.mark.parametrize("name", ["bs16_cols16", "bs4_cols8_chunked", "bs1_cols40"])
def test_engine_with_flash_pages_matches_transformers(arch_model, name, monkeypatch):  # noqa: F811
    """The whole engine, eager and through (emulated) graphs, decoding with pages in float64: the
    same tokens as transformers' generate. The pairs are built once a step eagerly, and inside the
    graph on replay, for each KV cache group, cut to its window (Mistral's, Gemma 3's local layers,
    gpt-oss's with its sinks): every window of the model reads pages."""
    import minicb.model_executor.attention as attention
    from minicb.model_executor.hf_config import mla_spec_of, sliding_window_of

    loaded, refs = arch_model
    hf = loaded.hf_config
    read, kernel = set(), attention.flash_pages_attention

    def counted(q, k_cache, v_cache, pages, *args, **kwargs):
        read.add(pages.window)
        return kernel(q, k_cache, v_cache, pages, *args, **kwargs)

    monkeypatch.setattr(attention, "flash_pages_attention", counted)
    for graphs in (False, True):
        tokens, engine = generate(
            loaded, use_cuda_graph=graphs, attention_backend="flash_pages", **GRAPH_CONFIGS[name]
        )
        assert engine.runner.attention_backend == "flash_pages"
        assert tokens == refs
        if graphs:
            assert engine.runner.graph_runner.pages
            check_graph_buckets(engine, every_bucket=name != "bs4_cols8_chunked")
        # (multi-head latent attention decodes its own way, mla.py)
        windows = {sliding_window_of(hf, i) for i in range(hf.num_hidden_layers)}
        assert read == (set() if mla_spec_of(hf) else windows)
        read.clear()


def test_windowed_models_verify_drafts_with_pages_and_the_gather(arch_model):  # noqa: F811
    """Speculative decoding on a windowed model with flash pages, eager and through (emulated)
    graphs of verify rows: the full-attention groups read pages, the windowed groups' rows of
    several queries the gather, plain decode steps pages everywhere; transformers' tokens. The
    drafts come from test_spec_decode's oracle (right, wrong first, wrong second), so that every
    model verifies some."""
    from test_cuda_graph import MAX_TOKENS, PROMPTS
    from test_spec_decode import Oracle

    from minicb import LLM, SamplingParams
    from minicb.core.kv_cache_groups import kv_cache_groups
    from minicb.model_executor.hf_config import sliding_window_of

    loaded, refs = arch_model
    hf = loaded.hf_config
    windows = [sliding_window_of(hf, i) for i in range(hf.num_hidden_layers)]
    if windows == [None] * len(windows):
        pytest.skip("no sliding window in this model")
    truth = {tuple(p): list(t) for p, t in zip(PROMPTS, refs)}
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    for graphs in (False, True):
        llm = LLM.from_loaded(
            loaded,
            dtype="float64",
            max_num_seqs=16,
            block_size=16,
            num_blocks=64 * len(kv_cache_groups(windows)),
            use_cuda_graph=graphs,
            attention_backend="flash_pages",
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )
        llm.engine.proposer = Oracle(truth, 2, lambda call: [None, 0, 1][call % 3])
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        stats = llm.engine.runner.spec_stats
        assert tokens == refs and stats.num_accepted_tokens > 0
        assert stats.num_draft_tokens > stats.num_accepted_tokens  # some were wrong
        if graphs:
            assert llm.engine.runner.graph_runner.verify_graphs
