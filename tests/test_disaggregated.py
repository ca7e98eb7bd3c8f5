"""Disaggregated prefill/decode in the simulator (disaggregated.py): two real schedulers, a KV
transfer between them, and the colocated baseline on the same devices."""

import pytest

from minicb.config import EngineConfig
from minicb.reference.capacity import Arrival, StepCost, Workload, run_timed
from minicb.reference.disaggregated import (
    KVTransfer,
    _request,
    run_disaggregated,
    run_pool,
    run_replicas,
)

COST = StepCost(a=0.01, b=1e-4)
PRE = EngineConfig(max_num_seqs=16, max_num_batched_tokens=1024, block_size=16, num_blocks=512)
DEC = EngineConfig(max_num_seqs=32, max_num_batched_tokens=4096, block_size=16, num_blocks=512)


def test_one_request_by_hand():
    # Prefill of 200 tokens: one step of 0.01 + 200 x 1e-4 = 0.03 s, ending with the first token.
    # The transfer: 0.005 + 200 x 1e-5 = 0.007 s. Then 3 decode steps of 0.01 + 1e-4 (one token
    # each).
    run = run_disaggregated(
        [Arrival(0.0, 200, 4)], PRE, DEC, COST, KVTransfer(0.005, 1e-5), warmup=0.0
    )
    (r,) = run.requests
    assert r.first_token == pytest.approx(0.03)
    assert r.finish == pytest.approx(0.03 + 0.007 + 3 * 0.0101)
    assert r.tpot == pytest.approx((0.007 + 3 * 0.0101) / 3)
    # 201 tokens in, 203 cached at the end: 13 blocks
    assert len(run.step_ends) == 3 and max(run.step_blocks) == 13


def test_a_one_token_request_never_reaches_the_decode_pool():
    run = run_disaggregated([Arrival(0.0, 50, 1), Arrival(0.0, 30, 2)], PRE, DEC, COST, warmup=0.0)
    assert run.requests[0].finish == run.requests[0].first_token and run.requests[0].tpot is None
    assert len(run.step_ends) == 1  # only the second request decodes: one step


def test_decodes_do_not_wait_for_prompts_in_the_decode_pool_but_do_when_colocated():
    # One long-running request, then a burst of long prompts while it decodes.
    arrivals = [Arrival(0.0, 64, 200)] + [Arrival(0.2 + 0.01 * i, 1500, 2) for i in range(10)]
    colo = run_replicas(
        arrivals, PRE.replace(max_num_batched_tokens=512), COST, replicas=1, warmup=0.0
    )
    disagg = run_disaggregated(arrivals, PRE, DEC, COST, warmup=0.0)
    alone = 0.01 + 1e-4  # a decode step with one token
    # the burst's KV lands, a token of compute per request
    assert disagg.requests[0].tpot < 1.5 * alone
    # chunks of 512 tokens stretch its steps
    assert colo.requests[0].tpot > 1.5 * disagg.requests[0].tpot


def test_transfer_cost_moves_only_what_follows_the_first_token():
    arrivals = Workload((100, 400), (5, 20)).sample(5.0, 40, seed=2)
    free = run_disaggregated(arrivals, PRE, DEC, COST, KVTransfer())
    slow = run_disaggregated(arrivals, PRE, DEC, COST, KVTransfer(latency=0.05))
    assert [r.first_token for r in free.requests] == [r.first_token for r in slow.requests]
    assert all(s.finish >= f.finish + 0.05 - 1e-9 for f, s in zip(free.requests, slow.requests))


def test_every_request_finishes_and_no_block_leaks():
    arrivals = Workload((64, 800), (2, 60)).sample(20.0, 120, seed=1)
    tight = DEC.replace(num_blocks=120, max_num_seqs=16)  # the decode pool must preempt
    run = run_disaggregated(arrivals, PRE, tight, COST)
    assert len(run.requests) == 120 and all(
        r.finish >= r.first_token >= r.arrival for r in run.requests
    )
    assert sum(r.num_preemptions for r in run.requests) > 0
    assert max(run.step_blocks) <= 120


def test_a_preempted_request_pays_for_the_kv_it_lost():
    """Landed KV costs the decode pool no compute, until a preemption by recompute drops it: then
    its prompt is computed again, like any prefill. No block is held once every request has
    finished."""

    def entries():  # fresh requests for each run: a run changes its requests
        return [
            (0.0, _request(i, list(range(1000 * (i + 1), 1000 * (i + 1) + 200)) + [1], 60, i))
            for i in (0, 1)
        ]

    loaded = {"0": 200, "1": 200}
    ample = run_pool(entries(), DEC.replace(num_blocks=200), COST, loaded)
    tight = run_pool(
        entries(),
        DEC.replace(num_blocks=30, max_num_seqs=4, enable_prefix_caching=False),
        COST,
        loaded,
    )
    # one token a step each
    assert ample.preemptions == {"0": 0, "1": 0} and ample.tokens_computed == 2 * 60
    # its prompt again
    assert tight.preemptions == {"0": 0, "1": 1} and tight.tokens_computed >= 2 * 60 + 200
    assert ample.blocks_held_at_end == tight.blocks_held_at_end == 0
    # prefix caching on:
    cached = run_pool(entries(), DEC.replace(num_blocks=30, max_num_seqs=4), COST, loaded)
    # only what the cache lost is computed again
    assert 2 * 60 < cached.tokens_computed < tight.tokens_computed


def test_pool_refuses_what_can_never_run_and_links_must_be_positive():
    with pytest.raises(ValueError, match="KV blocks"):
        run_pool([(0.0, _request(0, list(range(900)), 1, 0))], PRE.replace(num_blocks=8), COST, {})
    with pytest.raises(ValueError, match="bandwidth must be positive"):
        KVTransfer.over_link(1024, 0)
    with pytest.raises(ValueError, match="negative"):
        KVTransfer(latency=-1)
    assert KVTransfer.over_link(45 * 1024, 10).seconds(1000) == pytest.approx(
        1000 * 45 * 1024 / 1e10
    )
    with pytest.raises(ValueError, match="replicas"):
        run_replicas([Arrival(0.0, 4, 2)], PRE, COST, replicas=0)
    for run in (
        lambda: run_disaggregated([], PRE, DEC, COST),
        lambda: run_replicas([], PRE, COST),
        lambda: run_timed([], PRE, COST),
    ):
        with pytest.raises(ValueError, match="no arrivals"):
            run()
