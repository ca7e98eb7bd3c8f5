"""Capacity planning (minicb.reference.capacity): Poisson arrivals, Little's law on simulated runs,
the sustainable rate predicted before running against the knee of a rate sweep, and goodput that
counts only requests meeting both latency targets. Pure Python and fast: every run is the real
scheduler with the scripted model."""

import math
import statistics

import pytest

from minicb import EngineConfig
from minicb.reference.capacity import (
    SLO,
    StepCost,
    Workload,
    knee,
    measure,
    poisson_arrivals,
    predict_blocks,
    predict_capacity,
    predict_in_flight,
    run_timed,
    sweep,
)

WORKLOAD = Workload(prompt_len=(32, 96), output_len=(8, 24))
COST = StepCost(a=0.015, b=5e-5)
SLOTS_BOUND = EngineConfig(max_num_seqs=8, num_blocks=512, max_num_batched_tokens=256)
BLOCKS_BOUND = EngineConfig(max_num_seqs=32, num_blocks=48, max_num_batched_tokens=256)
TARGETS = SLO(ttft=0.5, tpot=0.03)


def test_poisson_arrivals_have_the_asked_mean_rate_and_exponential_gaps():
    times = poisson_arrivals(5.0, 20_000, seed=3)
    gaps = [b - a for a, b in zip([0.0] + times, times)]
    assert len(times) / times[-1] == pytest.approx(5.0, rel=0.02)
    # exponential: CV 1
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, rel=0.03)
    assert times == poisson_arrivals(5.0, 20_000, seed=3) and times != poisson_arrivals(
        5.0, 20_000, seed=4
    )
    with pytest.raises(ValueError, match="rate must be positive"):
        poisson_arrivals(0, 10)


def test_bad_inputs_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="a > 0"):
        StepCost(a=0.0)
    with pytest.raises(ValueError, match="output_len"):
        Workload(output_len=(10, 5))


def test_block_steps_closed_form_matches_counting():
    w = Workload(prompt_len=(5, 40), output_len=(1, 30))
    for bs in (1, 4, 16):
        counted = w.expect(lambda p, d: sum(math.ceil((p + j) / bs) for j in range(d)))
        assert w.mean_block_steps(bs) == pytest.approx(counted)


def test_littles_law_holds_on_a_simulated_run():
    rate = 0.6 * predict_capacity(WORKLOAD, SLOTS_BOUND, COST).rate
    run = run_timed(WORKLOAD.sample(rate, 1500, seed=1), SLOTS_BOUND, COST)
    t0, t1 = run.window
    arrived = [r for r in run.requests if t0 <= r.arrival <= t1]
    lam = len(arrived) / (t1 - t0)  # the rate the window really saw
    mean_latency = statistics.mean(r.latency for r in arrived)
    assert run.in_flight() == pytest.approx(lam * mean_latency, rel=0.05)  # L = lambda * W


@pytest.mark.parametrize("config, binding", [(SLOTS_BOUND, "slots"), (BLOCKS_BOUND, "KV blocks")])
def test_predicted_rate_is_within_20_percent_of_the_knee(config, binding):
    cap = predict_capacity(WORKLOAD, config, COST, TARGETS)  # computed before anything runs
    assert cap.binding == binding
    # a fixed grid, 12-56 requests/s, chosen without the prediction
    rates = [4.0 * i for i in range(3, 15)]
    points = sweep(rates, WORKLOAD, config, COST, TARGETS, num_requests=500)
    found = knee(points)
    assert abs(found.rate - cap.rate) <= 0.2 * cap.rate, (cap, found)
    # Past the knee throughput stays at the capacity while goodput collapses: a queue that only
    # grows.
    assert max(p.throughput for p in points) == pytest.approx(cap.rate, rel=0.1)
    assert points[-1].goodput < 0.1 * points[-1].throughput


def test_predicted_in_flight_below_the_knee_is_within_10_percent():
    rate = 0.6 * predict_capacity(WORKLOAD, BLOCKS_BOUND, COST, TARGETS).rate
    # window: no warm-up, no drain
    run = run_timed(WORKLOAD.sample(rate, 1500, seed=2), BLOCKS_BOUND, COST)
    assert run.in_flight() == pytest.approx(predict_in_flight(rate, WORKLOAD, COST), rel=0.10)
    assert run.blocks_in_use() == pytest.approx(predict_blocks(rate, WORKLOAD, COST, 16), rel=0.10)


def test_goodput_counts_only_requests_that_meet_both_targets():
    # near the knee: some requests queue
    rate = 0.9 * predict_capacity(WORKLOAD, SLOTS_BOUND, COST).rate
    run = run_timed(WORKLOAD.sample(rate, 800, seed=5), SLOTS_BOUND, COST)
    t0, t1 = run.window
    done = [r for r in run.requests if t0 <= r.finish <= t1]
    ttft_target = statistics.median(r.ttft for r in done)  # about half the requests miss it
    tpot_target = statistics.median(r.tpot for r in done)
    slo = SLO(ttft=ttft_target, tpot=tpot_target)
    both = [r for r in done if r.ttft <= ttft_target and r.tpot <= tpot_target]
    one = [r for r in done if r.ttft <= ttft_target or r.tpot <= tpot_target]
    assert 0 < len(both) < len(one)  # some requests meet one target only: they must not count
    point = measure(run, rate, slo)
    assert point.goodput == pytest.approx(len(both) / (t1 - t0))
    assert point.throughput == pytest.approx(len(done) / (t1 - t0))
    assert measure(run, rate, SLO(ttft=math.inf, tpot=0.0)).goodput == 0  # everyone misses TPOT
    assert measure(run, rate, SLO(ttft=0.0, tpot=math.inf)).goodput == 0  # everyone misses TTFT
    assert measure(run, rate, SLO(math.inf, math.inf)).goodput == point.throughput
