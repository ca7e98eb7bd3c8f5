"""Parallel sampling (SamplingParams.n): the prompt is computed once, the samples fork after prefill
and share its KV blocks by reference count, and a shared, partly filled block is copied on the first
write. Checked against the same samples run as separate requests (float64, so every token is
exact)."""

import pytest
import torch

from minicb import LLM, SamplingParams
from minicb.model_executor.loader import load_model, save_tiny_model

# 200 tokens: 12 full blocks of 16 and 8 tokens over
PROMPT = [(7 * i) % 120 + 3 for i in range(200)]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model(
        save_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama", seed=3), dtype=torch.float64
    )


def make(loaded, **config):
    config = dict(dict(block_size=16, num_blocks=128, max_model_len=512), **config)
    return LLM.from_loaded(loaded, dtype="float64", **config)


def run_checked(llm, prompts, params):
    """generate(), checking the block manager's books after every step."""
    ids = llm._add_all(prompts, params, None)
    done = {}
    while len(done) < len(ids):
        for out in llm.engine.step():
            if out.finished:
                done[out.request_id] = out
        llm.engine.scheduler.block_manager.check_invariants()
        running = llm.engine.scheduler.running
        # reserved slots count
        assert sum(r.num_seqs for r in running) <= llm.engine.config.max_num_seqs
    assert llm.engine.scheduler.block_manager.num_used_blocks == 0, "blocks leaked"
    return [done[rid] for rid in ids]


def seeded(i, **kw):
    return SamplingParams(
        max_tokens=12, temperature=1.0, top_p=0.9, seed=100 + i, ignore_eos=True, **kw
    )


def test_greedy_samples_are_identical_copies_of_n_1(loaded):
    llm = make(loaded)
    one = llm.generate(
        [PROMPT], SamplingParams(max_tokens=9, temperature=0, ignore_eos=True), use_tqdm=False
    )[0]
    (out,) = run_checked(
        llm, [PROMPT], SamplingParams(n=4, max_tokens=9, temperature=0, ignore_eos=True)
    )
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert [o.token_ids for o in out.outputs] == [one.outputs[0].token_ids] * 4
    assert all(o.finish_reason == "length" for o in out.outputs) and out.finished


def test_prompt_blocks_are_allocated_once_and_the_partial_block_copied_on_write(loaded):
    llm = make(loaded, enable_prefix_caching=False)
    engine, bm = llm.engine, llm.engine.scheduler.block_manager
    engine.add_request(
        PROMPT, SamplingParams(n=8, max_tokens=4, temperature=0, ignore_eos=True), request_id="r"
    )
    engine.step()  # the whole prompt in one step (budget 2048), then the fork
    tables = [bm.block_tables[rid] for rid in ["r"] + [f"{i}_r" for i in range(1, 8)]]
    # all 13 blocks shared, none copied
    assert all(t == tables[0] for t in tables) and len(tables[0]) == 13
    assert all(bm.ref_counts[b] == 8 for b in tables[0])
    assert bm.num_used_blocks == 13
    partial = tables[0][12]
    # each sample writes its first token at position 200: block 12
    out = engine.scheduler.schedule()
    # copy-on-write: the first 7 writers copy, the last writes in place
    assert len(out.blocks_to_copy) == 7
    assert {src for src, _ in out.blocks_to_copy} == {partial}
    tables = [bm.block_tables[rid] for rid in ["r"] + [f"{i}_r" for i in range(1, 8)]]
    # the 12 full prompt blocks: still one copy
    assert all(t[:12] == tables[0][:12] for t in tables)
    assert len({t[12] for t in tables}) == 8  # one partial block per sample
    assert bm.num_used_blocks == 12 + 8  # against 8 x 13 = 104 for eight separate requests
    bm.check_invariants()


def test_a_prompt_that_fills_its_blocks_needs_no_copy(loaded):
    llm = make(loaded, enable_prefix_caching=False)
    engine = llm.engine
    engine.add_request(
        PROMPT[:192], SamplingParams(n=3, max_tokens=4, temperature=0, ignore_eos=True)
    )
    engine.step()
    out = engine.scheduler.schedule()
    assert out.blocks_to_copy == []  # position 192 starts a new block for each sample
    assert engine.scheduler.block_manager.num_used_blocks == 12 + 3


def test_seeded_samples_equal_separate_requests_with_seed_plus_i(loaded):
    llm = make(loaded)
    separate = llm.generate([PROMPT] * 4, [seeded(i) for i in range(4)], use_tqdm=False)
    (together,) = run_checked(llm, [PROMPT], seeded(0, n=4))
    assert [o.token_ids for o in together.outputs] == [s.outputs[0].token_ids for s in separate]
    assert len({tuple(o.token_ids) for o in together.outputs}) > 1  # they are different samples


def test_sample_i_does_not_depend_on_the_rest_of_the_batch(loaded):
    llm = make(loaded)
    (alone,) = run_checked(llm, [PROMPT], seeded(0, n=3))
    outs = run_checked(
        llm, [PROMPT[:50], PROMPT, [9, 8, 7]], [seeded(7), seeded(0, n=3), seeded(8, n=2)]
    )
    assert [o.token_ids for o in outs[1].outputs] == [o.token_ids for o in alone.outputs]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_samples_stay_exact(loaded, mode):
    # 200-token prompts, 4 samples each, in 30 blocks: samples are preempted and come back, alone.
    ample = make(loaded)
    want = run_checked(ample, [PROMPT, PROMPT[::-1]], [seeded(0, n=4), seeded(5, n=4)])
    tight = make(loaded, num_blocks=30, preemption_mode=mode, max_num_seqs=8)
    got = run_checked(tight, [PROMPT, PROMPT[::-1]], [seeded(0, n=4), seeded(5, n=4)])
    assert [[o.token_ids for o in r.outputs] for r in got] == [
        [o.token_ids for o in r.outputs] for r in want
    ]
    preempted = [rid for rec in tight.engine.trace for rid in rec.preempted + rec.swapped_out]
    assert any("_" in rid for rid in preempted), (
        "no forked sample was preempted: the test lost its point"
    )


def test_reserved_slots_keep_the_batch_within_max_num_seqs(loaded):
    llm = make(loaded, max_num_seqs=5)
    outs = run_checked(
        llm, [[5, 6, 7], PROMPT[:30], [8, 9]], [seeded(1), seeded(0, n=4), seeded(2)]
    )
    assert [len(o.outputs) for o in outs] == [1, 4, 1]


def test_n_larger_than_max_num_seqs_is_refused(loaded):
    llm = make(loaded, max_num_seqs=4)
    with pytest.raises(ValueError, match="n=5 samples need 5 slots, but max_num_seqs is 4"):
        llm.engine.add_request([5, 6], SamplingParams(n=5))
    assert not llm.engine.has_unfinished_requests()


def test_stream_carries_every_sample(loaded):
    llm = make(loaded)
    got: dict[int, list[int]] = {}
    last = None
    for last in llm.stream([PROMPT[:40]], seeded(0, n=3)):
        assert [o.index for o in last.outputs] == [0, 1, 2]
        for o in last.outputs:
            got.setdefault(o.index, []).extend(o.new_token_ids)
            assert got[o.index] == o.token_ids
    assert last.finished and all(len(t) == 12 for t in got.values())


def test_abort_frees_every_sample(loaded):
    llm = make(loaded)
    engine = llm.engine
    engine.add_request(PROMPT, seeded(0, n=4), request_id="r")
    for _ in range(3):
        engine.step()
    assert len(engine.scheduler.running) == 4
    out = engine.abort_request("r")
    assert [o.finish_reason for o in out.outputs] == ["abort"] * 4
    assert (
        engine.scheduler.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()
    )
    assert engine.abort_request("r") is not None  # its books close with the next step's output
    assert [o.finished for o in engine.step()] == [True]
    assert engine.abort_request("r") is None


def test_aborted_before_the_fork_finishes_every_sample(loaded):
    # the prompt needs 4 steps: abort during its prefill
    llm = make(loaded, max_num_batched_tokens=64)
    engine = llm.engine
    engine.add_request(PROMPT, seeded(0, n=3), request_id="r")
    engine.step()
    out = engine.abort_request("r")
    assert [o.finish_reason for o in out.outputs] == ["abort"] * 3 and out.finished


def test_a_sample_whose_first_draw_fails_stops_alone(loaded):
    llm = make(loaded)
    sampler = llm.engine.runner.sampler

    class Picky:  # the real sampler, except for rows seeded 102 (sample 2 of a request seeded 100)
        def __getattr__(self, name):
            return getattr(sampler, name)

        def __call__(self, logits, params, generators):
            if any(p.seed == 102 for p in params):
                raise RuntimeError("cannot sample seed 102")
            return sampler(logits, params, generators)

    llm.engine.runner.sampler = Picky()
    (out,) = run_checked(llm, [PROMPT], seeded(0, n=4))
    llm.engine.runner.sampler = sampler
    want = llm.generate([PROMPT] * 4, [seeded(i) for i in range(4)], use_tqdm=False)
    assert [o.finish_reason for o in out.outputs] == ["length", "length", "error", "length"]
    assert out.outputs[2].token_ids == [] and "cannot sample seed 102" in out.error
    for i in (0, 1, 3):
        assert out.outputs[i].token_ids == want[i].outputs[0].token_ids


def test_the_simulator_forks_samples_like_the_engine():
    from minicb import EngineConfig
    from minicb.sim import SimRequest, simulate

    config = EngineConfig(
        block_size=16, num_blocks=128, enable_prefix_caching=False, max_num_batched_tokens=2048
    )
    forked = simulate([SimRequest(200, 5, n=8)], config)
    separate = simulate([SimRequest(200, 5) for _ in range(8)], config)
    used = lambda res, step: 128 - res.trace.steps[step - 1].num_free_blocks
    assert (used(forked, 1), used(forked, 2)) == (13, 20) and used(separate, 2) == 104
    assert forked.num_steps == separate.num_steps == 5
