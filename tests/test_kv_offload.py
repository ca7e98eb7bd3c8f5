"""The prefix cache's CPU tier (core/kv_offload.py, vLLM's kv_offloading_size): its books, the block
manager's hooks, and the engine on a multi-turn workload whose conversations do not all fit on the
device: more prompt tokens served from a cache, the same tokens out, every block accounted for."""

import random

import pytest
import torch

from minicb import LLM, EngineConfig, SamplingParams
from minicb.core.block_manager import BlockManager
from minicb.core.kv_offload import CpuBlockTier
from minicb.core.request import Request
from minicb.model_executor.loader import load_model, save_tiny_model
from minicb.serve.metrics import engine_stats


def test_the_tier_evicts_least_recently_used_and_never_a_pinned_slot():
    tier = CpuBlockTier(2)
    a, b = tier.store(1, ("a",)), tier.store(2, ("b",))
    assert tier.store(1, ("a",)) is None  # held already: now the most recent
    c = tier.store(3, ("c",))  # evicts hash 2, the least recently used
    assert c == b and tier.lookup(2, ("b",)) is None and tier.lookup(1, ("a",)) == a
    assert tier.lookup(3, ("not c",)) is None  # a hash whose tokens differ is no hit
    tier.pin(a)
    tier.lookup(3, ("c",))  # hash 1 is now the least recent, but pinned: hash 3 goes
    assert tier.store(4, ("d",)) == c
    tier.pin(c)
    assert tier.store(5, ("e",)) is None  # everything pinned: the block is not kept
    tier.take_transfers()
    assert tier.store(5, ("e",)) is not None  # unpinned after the step
    tier.check_invariants()


def test_a_slot_refilled_in_the_same_step_is_copied_into_once():
    """More evictions in one step than the tier has slots: the slot is taken again, and only the
    last block copied into it is (an index_copy_ with a repeated index keeps either)."""
    bm = BlockManager(num_blocks=4, block_size=2, num_offload_blocks=1)
    first = request("a", [1, 2, 3, 4, 5])
    bm.allocate(first, 5)
    first.num_computed_tokens = 5
    bm.cache_full_blocks(first)
    table = list(bm.block_tables["a"])
    bm.free("a")
    bm.allocate(request("b", [9, 8, 7, 6, 5, 4, 3, 2]), 8)  # evicts both cached blocks
    offloads, _ = bm.take_transfers()
    (kept,) = bm.tier.lru  # the hash the one slot holds, and the one copy into it
    assert offloads == [(table[first.block_hashes.index(kept)], 0)]
    bm.check_invariants()


def request(rid, tokens):
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def test_an_evicted_block_goes_to_the_tier_and_comes_back_into_a_fresh_block():
    bm = BlockManager(num_blocks=4, block_size=2, num_offload_blocks=8)
    first = request("a", [1, 2, 3, 4, 5])  # blocks (1, 2), (3, 4) full
    bm.allocate(first, 5)
    first.num_computed_tokens = 5
    bm.cache_full_blocks(first)
    bm.free("a")  # both full blocks stay cached on the device
    other = request("b", [9, 8, 7, 6, 5, 4, 3, 2])
    bm.allocate(other, 8)  # takes all four blocks: the cached ones are evicted to the tier
    offloads, loads = bm.take_transfers()
    assert len(offloads) == 2 and loads == []
    bm.free("b")
    again = request("c", [1, 2, 3, 4, 5, 6])
    assert bm.find_cached_prefix(again) == []  # gone from the device
    slots = bm.find_offloaded(again, 0)
    assert sorted(slots) == sorted(slot for _, slot in offloads)
    bm.allocate(again, 6, [], slots)
    _, loads = bm.take_transfers()
    table = bm.block_tables["c"]
    assert loads == list(zip(slots, table[:2]))  # into its first two blocks, in order
    assert bm.find_cached_prefix(request("d", [1, 2, 3, 4, 9])) == table[:2]  # cached again
    bm.check_invariants()


def test_config_names_the_tier_as_vllm_does():
    with pytest.raises(ValueError, match="kv_offloading_backend 'lmcache' is not supported"):
        EngineConfig(kv_offloading_size=1.0, kv_offloading_backend="lmcache")
    with pytest.raises(ValueError, match="kv_offloading_size must be a positive number"):
        EngineConfig(kv_offloading_size=0)
    EngineConfig(kv_offloading_size=0.5, kv_offloading_backend="native")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("tier"), arch="llama", seed=1)
    return load_model(path, dtype=torch.float64)


def chat(loaded, turns=3, conversations=6, **config):
    """Six conversations of three turns, each turn its whole history plus an answer of 6 tokens and
    a new message of 5; the device pool (40 blocks of 4 tokens) holds about a third of them."""
    llm = LLM.from_loaded(
        loaded, dtype="float64", block_size=4, num_blocks=40, max_num_seqs=2, **config
    )
    rng = random.Random(0)
    history = [[rng.randrange(2, 128) for _ in range(24)] for _ in range(conversations)]
    answers, cached, prompt = [], 0, 0
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for _ in range(turns):
        for i, out in enumerate(llm.generate(history, params, use_tqdm=False)):
            answers.append(out.outputs[0].token_ids)
            cached += out.num_cached_tokens
            prompt += len(out.prompt_token_ids)
            history[i] = history[i] + out.outputs[0].token_ids
            history[i] += [rng.randrange(2, 128) for _ in range(5)]
        llm.engine.scheduler.block_manager.check_invariants()
    return llm, answers, cached / prompt


@pytest.mark.parametrize(
    "extra",
    [{}, {"async_scheduling": True}, {"max_num_batched_tokens": 8}],
    ids=["sync", "async", "chunked_8"],
)
def test_a_multi_turn_workload_serves_more_from_cache_with_the_same_tokens(loaded, extra):
    base, expected, share_without = chat(loaded, **extra)
    tiered, answers, share_with = chat(loaded, kv_offloading_size=2**20 / 2**30, **extra)
    assert answers == expected
    assert share_with >= 2 * share_without and share_with > 0.3, (share_without, share_with)
    bm, kv = tiered.engine.scheduler.block_manager, tiered.engine.kv_cache
    assert bm.num_used_blocks == 0 and len(bm.tier.lru) <= bm.tier.num_blocks
    assert bm.tier.num_blocks == 2**20 // kv.block_bytes  # 1 MiB of host memory
    stats = engine_stats(tiered.engine)
    assert stats["kv_offload_bytes_to_device"] == bm.tier.num_loaded * kv.block_bytes > 0
    assert stats["kv_offload_bytes_to_cpu"] == bm.tier.num_stored * kv.block_bytes > 0
    moved = sum(s.blocks_loaded for s in tiered.engine.trace), bm.tier.num_loaded
    assert moved[0] == moved[1]
    print(
        f"\n{extra}: prompt tokens from a cache {share_without:.0%} -> {share_with:.0%}; "
        f"to CPU {stats['kv_offload_bytes_to_cpu']} B, back {stats['kv_offload_bytes_to_device']} B"
    )


def test_tensor_parallel_workers_copy_their_own_shards_to_the_tier(loaded):
    _, expected, _ = chat(loaded, turns=2, num_offload_blocks=64)
    two, answers, share = chat(loaded, turns=2, num_offload_blocks=64, tensor_parallel_size=2)
    try:
        assert answers == expected and share > 0.3
        assert two.engine.scheduler.block_manager.tier.num_loaded > 0
    finally:
        two.engine.shutdown()


def test_the_gpu_benchmark_of_the_tier_runs_its_three_engines_on_a_cpu(loaded):
    """bench/gpu_step.tier_overlap (`python -m minicb.bench.w2 --workload tier` on a GPU), shrunk to
    the tiny model on a CPU, where both tier rows copy the same way: its rows must show the tier
    serving more prompt tokens from a cache, with the same answers and bytes moved."""
    from minicb.bench.gpu_step import tier_overlap

    shape = dict(conversations=6, history=24, turns=3, answer=6, message=5, block_size=4)
    rows = tier_overlap(loaded=loaded, dtype="float64", device="cpu", **shape)
    without, own, step = rows
    assert [r["copies"] for r in rows] == ["no tier", "tier, own stream", "tier, step's stream"]
    assert own["cached_share"] >= 2 * without["cached_share"] and own["cached_share"] > 0.3
    assert all(r["answers_as_without_tier"] == 1.0 for r in rows)
    assert own["bytes_to_cpu"] > 0 and own["bytes_to_device"] > 0 and without["bytes_to_cpu"] == 0
    assert {k: v for k, v in step.items() if k not in ("copies", "seconds")} == {
        k: v for k, v in own.items() if k not in ("copies", "seconds")
    }


def test_tier_copies_go_one_run_of_consecutive_slots_at_a_time():
    from minicb.worker.kv_offload import runs

    assert runs([4, 5, 6, 9, 2, 3]) == [(0, 4, 3), (3, 9, 1), (4, 2, 2)]
    assert runs([]) == [] and runs([7]) == [(0, 7, 1)]
