"""KV cache groups (vLLM V1's hybrid KV cache manager): the groups of real configs, a sliding
window's blocks freed as the request advances, its prefix hits, and the capacity that buys on the
engine."""

import pytest
import torch
from reference import greedy_reference

from minicb import LLM, SamplingParams
from minicb.config import cdiv
from minicb.core.block_manager import BlockManager
from minicb.core.kv_cache_groups import (
    blocks_per_request,
    kv_cache_groups,
    max_live_blocks,
    num_padding_layers,
)
from minicb.core.request import Request
from minicb.model_executor.hf_config import sliding_window_of
from minicb.model_executor.loader import load_model, make_tiny_model, save_tiny_model
from minicb.worker.memory import block_bytes

# Gemma 3 27B (text config: 62 layers, a global layer every sixth from index 5, window 1024) and
# gpt-oss-120b (36 layers alternating, sliding first, window 128): the windows of their layers
GEMMA3_27B = [None if i % 6 == 5 else 1024 for i in range(62)]
GPT_OSS_120B = [128 if i % 2 == 0 else None for i in range(36)]


def test_groups_of_real_configs():
    gemma = kv_cache_groups(GEMMA3_27B)
    # 10 global layers set the group size: 1 full group and cdiv(52, 10) = 6 windowed ones
    assert [len(g.layer_ids) for g in gemma] == [10, 9, 9, 9, 9, 8, 8]
    assert [g.sliding_window for g in gemma] == [None] + [1024] * 6
    assert num_padding_layers(gemma) == 8
    # split by stride (every sixth windowed layer: 0, 7, 14), so pipeline stages stay balanced
    assert gemma[1].layer_ids[:3] == (0, 7, 14)
    oss = kv_cache_groups(GPT_OSS_120B)
    assert [(len(g.layer_ids), g.sliding_window) for g in oss] == [(18, None), (18, 128)]
    # 13 full and 12 windowed: max < 1.5 x min, so the group size is 13 (vLLM's gpt-oss-20b + EAGLE)
    mixed = kv_cache_groups([None] * 13 + [64] * 12)
    assert [len(g.layer_ids) for g in mixed] == [13, 12] and num_padding_layers(mixed) == 1
    assert kv_cache_groups([None] * 4) == kv_cache_groups([None] * 4, True)
    assert [g.sliding_window for g in kv_cache_groups([8] * 4)] == [8]
    assert [g.sliding_window for g in kv_cache_groups(GEMMA3_27B, True)] == [None]
    every = sorted(i for g in gemma for i in g.layer_ids)
    assert every == list(range(62)), "a layer is in no group, or in two"


def test_capacity_per_request_on_real_configs():
    """Blocks per request of 8k tokens in steady decode at block_size 16 (vLLM's default): each
    group is a page of group_size layers, so bytes = blocks x group_size x one layer's page."""
    gemma, t, b = kv_cache_groups(GEMMA3_27B), 8192, 16
    # full: 512 blocks; each window group: cdiv(1024, 16) + 1 = 65
    assert blocks_per_request(gemma, t, b) == 512 + 6 * 65
    one_pool = 62 * cdiv(t, b)  # layer-pages without groups
    with_groups = blocks_per_request(gemma, t, b) * 10  # layer-pages with groups of 10
    assert round(one_pool / with_groups, 2) == 3.52
    assert blocks_per_request(kv_cache_groups(GPT_OSS_120B), t, b) == 512 + (cdiv(128, 16) + 1)


def request(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=100))


@pytest.mark.parametrize("window,block_size", [(1, 1), (5, 2), (8, 4), (3, 4), (16, 4)])
def test_a_window_frees_its_blocks_as_the_request_advances(window, block_size):
    bm = BlockManager(64, block_size, enable_prefix_caching=False, windows=(None, window))
    req = request("a", range(2, 12))
    bm.allocate(req, 10)
    req.num_computed_tokens = 10
    for t in range(10, 60):  # one decode step at a time
        req.token_ids.append(7)
        bm.remove_skipped("a", t)
        bm.allocate(req, t + 1)
        full, window_table = bm.tables["a"]
        live = [b for b in window_table if b != bm.null_block]
        assert len(full) == len(window_table) == cdiv(t + 1, block_size)
        assert len(live) <= max_live_blocks(window, 1, block_size) == cdiv(window, block_size) + 1
        # the blocks it kept cover every position the query at t may see
        first_live = len(window_table) - len(live)
        assert first_live * block_size <= max(0, t - window + 1)
        bm.check_invariants()
    bm.free("a")
    assert bm.num_free_blocks == 64
    bm.check_invariants()


def test_a_prefix_hit_in_a_window_needs_only_the_window():
    bm = BlockManager(64, 4, windows=(None, 6))
    prompt = list(range(2, 30))  # 28 tokens: 6 full blocks can hit (the last token is computed)
    a = request("a", prompt)
    bm.allocate(a, 28)
    a.num_computed_tokens = 28
    bm.cache_full_blocks(a)
    bm.remove_skipped("a", 28)  # the window group keeps the blocks of positions 23.. only
    bm.free("a")  # every block back, hashes kept
    b = request("b", prompt + [40, 41])
    hits = bm.find_cached_prefix(b)
    assert len(hits) == 7  # 29 of 30 tokens: blocks 0..6 (7 x 4 = 28)
    skipped = (28 - 6 + 1) // 4  # the query at 28 sees 23..28: blocks 0..4 are skipped
    assert all(h[1] == bm.null_block for h in hits[:skipped])
    assert all(h[1] != bm.null_block for h in hits[skipped:])
    bm.allocate(b, 30, hits)
    bm.check_invariants()
    # a window group that lost one of the window's blocks shortens the hit for every group
    bm2 = BlockManager(64, 4, windows=(None, 6))
    a = request("a", prompt)
    bm2.allocate(a, 28)
    a.num_computed_tokens = 28
    bm2.cache_full_blocks(a)
    window_block = bm2.tables["a"][1][6]
    bm2.free("a")
    del bm2.cached[(1, a.block_hashes[6])]
    bm2.block_hash[window_block] = bm2.block_key[window_block] = None
    hits = bm2.find_cached_prefix(request("b", prompt + [40, 41]))
    assert len(hits) == 6  # 6 blocks: the window before position 24 (19..24) is blocks 4, 5


ARCHS = ["mistral_window", "qwen2_hybrid", "qwen2_local_global"]
PROMPTS = [[(7 * i + 3 * j) % 120 + 2 for j in range(n)] for i, n in enumerate((45, 3, 30, 60))]
MAX_TOKENS = [20, 40, 9, 12]


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param, seed=2)
    hf = make_tiny_model(request.param, seed=2, dtype=torch.float64)
    return load_model(path, dtype=torch.float64), greedy_reference(hf, PROMPTS, MAX_TOKENS)


def generate(loaded, **config):
    llm = LLM.from_loaded(loaded, dtype="float64", **config)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    bm = llm.engine.scheduler.block_manager
    assert bm.num_used_blocks == 0, "blocks leaked"
    bm.check_invariants()
    return [o.outputs[0].token_ids for o in outs], llm.engine


def test_groups_hold_less_memory_with_the_same_tokens(model):
    """Whole prompts, chunks, a small budget: the same tokens as transformers with groups and with
    the hybrid manager disabled, and the groups' peak in bytes is smaller."""
    loaded, refs = model
    peaks = {}
    for disable in (False, True):
        tokens, engine = generate(
            loaded,
            block_size=4,
            num_blocks=400,
            max_num_batched_tokens=16,
            disable_hybrid_kv_cache_manager=disable,
        )
        assert tokens == refs
        used = max(engine.config.num_blocks - s.num_free_blocks for s in engine.trace)
        peaks[disable] = used * block_bytes(engine.config, loaded.hf_config)
        groups = engine.config.kv_cache_groups
        assert len(groups) == (1 if disable else len(kv_cache_groups(windows(loaded))))
    assert peaks[False] < peaks[True], peaks


def windows(loaded):
    hf = loaded.hf_config
    return [sliding_window_of(hf, i) for i in range(hf.num_hidden_layers)]


def test_a_window_group_never_holds_more_than_its_bound_on_the_engine(model):
    """After every step, each row's window group holds at most cdiv(W - 1 + q, B) + 1 blocks (q: the
    row's tokens this step; cdiv(W, B) + 1 for a decode), and the tokens stay transformers'."""
    loaded, refs = model
    llm = LLM.from_loaded(
        loaded, dtype="float64", block_size=4, num_blocks=400, max_num_batched_tokens=16
    )
    engine, bm, window = llm.engine, llm.engine.scheduler.block_manager, 8
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    for i, (p, sp) in enumerate(zip(PROMPTS, params)):
        engine.add_request(p, sp, request_id=str(i))
    tokens, checked = {}, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                tokens[int(o.request_id)] = o.outputs[0].token_ids
        for row in engine.trace[-1].rows:
            for w, table in zip(bm.windows, bm.tables.get(row.request_id, ())):
                if w is not None:
                    live = sum(b != bm.null_block for b in table)
                    assert live <= max_live_blocks(window, row.num_tokens, 4), (row, table)
                    checked += 1
        bm.check_invariants()
    assert checked > 50
    assert [tokens[i] for i in range(len(PROMPTS))] == refs


def test_a_prefix_hit_on_a_hybrid_model_is_exact(model):
    """The same long prompt twice, one after the other: the second finds the first's blocks (each
    group's, a window's only near the hit's end) and gives transformers' tokens."""
    loaded, refs = model
    llm = LLM.from_loaded(loaded, dtype="float64", block_size=4, num_blocks=400)
    params = SamplingParams(max_tokens=MAX_TOKENS[3], temperature=0.0, ignore_eos=True)
    first = llm.generate([PROMPTS[3]], params, use_tqdm=False)[0]
    again = llm.generate([PROMPTS[3]], params, use_tqdm=False)[0]
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == refs[3]
    assert again.num_cached_tokens == 56  # 14 of the 60 tokens' 15 blocks (the last is computed)
    llm.engine.scheduler.block_manager.check_invariants()


def finishing_together(loaded, num_requests: int, max_tokens: int, **config) -> tuple[int, object]:
    """How many of `num_requests` identical requests, all arriving at once, the engine carries to
    their last token together (the rest were preempted on the way and come back later)."""
    llm = LLM.from_loaded(loaded, dtype="float64", max_num_seqs=num_requests, **config)
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(num_requests):
        engine.add_request([5, 6, 7, 8], params, request_id=str(i))
    while engine.has_unfinished_requests():
        done = [o for o in engine.step() if o.finished]
        if done:
            return len(done), engine
    raise AssertionError("nothing finished")


def test_capacity_at_a_fixed_byte_budget_is_what_the_groups_formula_says(tmp_path):
    """Gemma 3's pattern (5 windowed layers of 8 tokens, 1 full) at one KV byte budget: the engine
    carries as many 99-token requests at once as per-group allocation allows, against the single
    pool's figure with the hybrid manager disabled (the same bytes, every block kept)."""
    path = save_tiny_model(tmp_path / "m", arch="qwen2_local_global", seed=2)
    loaded = load_model(path, dtype=torch.float64)
    max_tokens, block_size = 96, 4
    cached = 4 + max_tokens - 1  # the last token is never fed back
    budget = 12 * cdiv(cached, block_size) * 6 * block_size * 2 * 2 * 16 * 8  # 12 single-pool ones
    measured, formula = {}, {}
    for disable in (True, False):
        config = dict(
            block_size=block_size,
            kv_cache_memory_bytes=budget,
            max_num_batched_tokens=512,
            disable_hybrid_kv_cache_manager=disable,
        )
        measured[disable], engine = finishing_together(loaded, 64, max_tokens, **config)
        per_request = blocks_per_request(engine.config.kv_cache_groups, cached, block_size)
        formula[disable] = engine.config.num_blocks // per_request
        print(
            f"{'one pool' if disable else 'groups  '}: {engine.config.num_blocks} blocks of "
            f"{block_bytes(engine.config, loaded.hf_config)} B, {per_request} per request -> "
            f"formula {formula[disable]}, engine {measured[disable]}"
        )
    assert measured == formula
    assert formula[True] == 12 and formula[False] > 3 * formula[True]


def test_the_cpu_tier_keeps_one_group_and_the_block_manager_says_so(model):
    """vLLM turns its hybrid manager off for a KV connector that does not support it; minicb's CPU
    tier keeps one table's blocks, so a windowed model with a tier runs with one group."""
    loaded, refs = model
    tokens, engine = generate(loaded, block_size=4, num_blocks=400, num_offload_blocks=8)
    assert tokens == refs and len(engine.config.kv_cache_groups) == 1
    assert (
        engine.config.kv_cache_groups[0].sliding_window is None
    )  # every block kept, window masked
    for windows in ((None, 8), (8,)):
        with pytest.raises(ValueError, match="one full-attention KV cache group"):
            BlockManager(16, 4, num_offload_blocks=4, windows=windows)


def test_two_tensor_parallel_processes_keep_the_groups(model):
    """Every rank caches its heads in the same groups: the tables travel with the step."""
    loaded, refs = model
    if loaded.hf_config.model_type != "qwen2" or loaded.hf_config.num_hidden_layers != 2:
        pytest.skip("one hybrid model is enough (a second process per run)")
    llm = LLM.from_loaded(
        loaded,
        dtype="float64",
        block_size=4,
        num_blocks=60,
        max_num_batched_tokens=8,
        tensor_parallel_size=2,
    )
    try:
        assert len(llm.engine.config.kv_cache_groups) == 2
        params = [
            SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS
        ]
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == refs
    finally:
        llm.engine.shutdown()


def test_forked_samples_share_and_copy_every_group(model):
    """n samples of one prompt fork its tables in every group and copy a shared last block on
    write: with a seed, the same samples as with one table for every layer."""
    loaded, _ = model
    params = SamplingParams(n=3, max_tokens=14, temperature=1.0, seed=5, ignore_eos=True)
    samples = {}
    for disable in (False, True):
        llm = LLM.from_loaded(
            loaded,
            dtype="float64",
            block_size=4,
            num_blocks=200,
            disable_hybrid_kv_cache_manager=disable,
        )
        outs = llm.generate([PROMPTS[0], PROMPTS[2]], params, use_tqdm=False)
        samples[disable] = [[c.token_ids for c in o.outputs] for o in outs]
        assert llm.engine.scheduler.block_manager.num_used_blocks == 0
    assert samples[False] == samples[True]
    assert len({tuple(t) for t in samples[False][0]}) > 1  # the samples differ: forks really ran
