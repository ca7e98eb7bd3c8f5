"""The fleet simulator (minicb/reference/fleet.py): 4 replicas of the real scheduler behind the
routing policies, on a multi-turn workload. Counts of steps and tokens: exact, whatever the machine.
"""

import pytest

from minicb.config import EngineConfig
from minicb.engine.router import DEFAULT_BALANCE_THRESHOLD, ROUTING_POLICIES
from minicb.reference.fleet import multi_turn_workload, simulate_fleet
from minicb.sim import SimRequest, simulate

# Each replica: 8 seats, a 256-token step budget and 256 blocks of 16 tokens (4,096 tokens), so a
# replica cannot keep every conversation's history in its cache at once.
CONFIG = EngineConfig(block_size=16, max_num_seqs=8, max_num_batched_tokens=256, num_blocks=256)
# 32 conversations of 4 turns sharing a 32-token system prompt; 64-token messages and answers
# (32 to 96), the next turn 4 steps after an answer. 128 requests, about 400 steps.
WORKLOAD = multi_turn_workload(
    num_conversations=32,
    turns=4,
    system_prompt_len=32,
    user_len=64,
    output_len=64,
    think_steps=4,
    seed=0,
)
SWEEP = (0, 1, 2, 4, 8, 64)


@pytest.fixture(scope="module")
def runs():
    """One run per policy (cache_aware at its default threshold) and per swept threshold."""
    results = {p: simulate_fleet(WORKLOAD, 4, p, CONFIG) for p in ROUTING_POLICIES}
    for t in SWEEP:
        results[t] = simulate_fleet(WORKLOAD, 4, "cache_aware", CONFIG, balance_threshold=t)
    for name, r in results.items():
        print(f"{name!s:>13}: {r!r}, mean load gap {r.mean_load_gap:.2f}")
    return results


def test_cache_aware_doubles_round_robins_hit_rate_with_even_loads(runs):
    cache_aware, round_robin = runs["cache_aware"], runs["round_robin"]
    assert cache_aware.router.balance_threshold == DEFAULT_BALANCE_THRESHOLD
    # the target: at least twice round robin's prefix hit rate, max/mean load under 1.5
    assert cache_aware.prefix_hit_rate >= 2 * round_robin.prefix_hit_rate
    assert cache_aware.request_imbalance < 1.5
    assert cache_aware.token_imbalance < 1.5
    # every request is served once, and the fleet computed fewer prompt tokens
    assert len(cache_aware.requests) == len(round_robin.requests) == 32 * 4
    computed = sum(cache_aware.computed_prompt_tokens_per_replica)
    assert computed < sum(round_robin.computed_prompt_tokens_per_replica) / 2


def test_least_loaded_balances_best(runs):
    # round robin evens the request counts by construction; what least_loaded evens is the queues:
    # the gap between the busiest and the idlest replica's score, step by step
    least = runs["least_loaded"].mean_load_gap
    for name in ("round_robin", "cache_aware", 64):
        assert least <= runs[name].mean_load_gap, name
    assert runs["least_loaded"].ttft_p99 <= runs["round_robin"].ttft_p99


def test_a_lower_balance_threshold_moves_cache_aware_toward_least_loaded(runs):
    balanced = [runs[t].router.num_balanced / runs[t].router.num_routed for t in SWEEP[:-1]]
    hit_rates = [runs[t].prefix_hit_rate for t in SWEEP[:-1]]
    print("thresholds", SWEEP[:-1], "routed by load:", [f"{b:.2f}" for b in balanced])
    print("hit rates:", [f"{h:.3f}" for h in hit_rates])
    # 0 -> 8: fewer decisions by load; more hits from 0 to 4, where they level off (0.754, 0.753)
    assert balanced == sorted(balanced, reverse=True)
    assert hit_rates[:4] == sorted(hit_rates[:4])
    assert abs(hit_rates[4] - hit_rates[3]) < 0.01
    # at 0 almost every decision is least loaded's, and so is the hit rate
    assert balanced[0] > 0.9
    assert abs(runs[0].prefix_hit_rate - runs["least_loaded"].prefix_hit_rate) < 0.1
    # too high, the shared system prompt piles new conversations onto one replica
    assert runs[64].request_imbalance > 1.5
    assert runs[64].ttft_p99 > runs[8].ttft_p99


def test_the_next_turn_holds_what_the_last_one_produced():
    convs = multi_turn_workload(1, 3, 20, 30, 20, think_steps=3, seed=1)
    res = simulate_fleet(convs, 2, "cache_aware", CONFIG)
    first, second, third = res.requests
    assert [r.turn for r in res.requests] == [0, 1, 2]
    assert second.arrival_step == first.finish_step + 3
    assert second.prompt_len == first.prompt_len + first.output_len + len(
        convs[0].turns[1].user_token_ids
    )
    # one replica served them all; each turn finds every full block its predecessor computed (its
    # prompt and all its tokens but the last, which is never fed back)
    assert {r.replica for r in res.requests} == {0}
    for before, after in ((first, second), (second, third)):
        assert after.num_cached_tokens == (before.prompt_len + before.output_len - 1) // 16 * 16


def test_one_replica_fleet_is_simulate():
    convs = multi_turn_workload(6, 3, 24, 40, 24, think_steps=2, seed=3)
    fleet = simulate_fleet(convs, 1, "round_robin", CONFIG)
    # the same requests, arriving when the fleet released them, in the same order
    by_id = {}
    for c, conv in enumerate(convs):
        prompt = list(conv.system_prompt_token_ids)
        for k, turn in enumerate(conv.turns):
            prompt = prompt + list(turn.user_token_ids)
            by_id[f"c{c}t{k}"] = prompt
            prompt = prompt + [1] * turn.output_len  # what the scripted model answers
    requests = [
        SimRequest(
            r.prompt_len,
            r.output_len,
            r.arrival_step,
            prompt_token_ids=by_id[r.request_id],
            request_id=r.request_id,
        )
        for r in fleet.requests
    ]
    sim = simulate(requests, CONFIG)
    assert fleet.num_steps == sim.num_steps
    steps = [(r.first_token_step, r.finish_step) for r in fleet.requests]
    assert steps == [(r.first_token_step, r.finish_step) for r in sim.requests]
    # step by step the same rows, tokens, blocks and prefix-cache state
    assert fleet.traces[0].steps == sim.trace.steps


def test_bad_workloads_name_the_field():
    with pytest.raises(ValueError, match="turns must be at least 1"):
        multi_turn_workload(2, 0, 8, 8, 8, 1)
    with pytest.raises(ValueError, match="length_spread must be in"):
        multi_turn_workload(2, 2, 8, 8, 8, 1, length_spread=1.0)
    with pytest.raises(ValueError, match="round_robin, least_loaded, cache_aware"):
        simulate_fleet(multi_turn_workload(1, 1, 8, 8, 8, 1), 2, "random", CONFIG)


def test_the_fleet_simulator_is_reached_from_minicb_sim():
    import minicb.reference.fleet as fleet
    import minicb.sim as sim

    assert sim.simulate_fleet is fleet.simulate_fleet
    assert sim.multi_turn_workload is fleet.multi_turn_workload
    with pytest.raises(AttributeError, match="no attribute 'simulate_fleets'"):
        sim.simulate_fleets
