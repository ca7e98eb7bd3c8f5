"""The routing policies' choices on hand-made loads (minicb/engine/router.py)."""

import pytest

from minicb.core.block_manager import BlockManager
from minicb.core.request import Request
from minicb.engine.router import (
    ROUTING_POLICIES,
    CacheAwareRouter,
    ReplicaLoad,
    make_router,
)
from minicb.sampling_params import SamplingParams

IDLE = ReplicaLoad(num_running=0, num_waiting=0)
BS = 4  # block size of the cache-aware tests: a 12-token prompt is 3 blocks


def loads(*pairs):
    """loads((running, waiting), ...)"""
    return [ReplicaLoad(r, w) for r, w in pairs]


def test_score_weighs_a_waiting_request_as_four_running_ones():
    # vLLM V1's DP load balancer: waiting * 4 + running
    assert ReplicaLoad(num_running=3, num_waiting=2).score == 11
    assert ReplicaLoad(num_running=4, num_waiting=0).score == ReplicaLoad(0, 1).score


def test_round_robin_takes_turns_whatever_the_loads():
    router = make_router("round_robin", 3)
    busy = loads((9, 9), (0, 0), (0, 0))
    assert [router.route([1, 2], busy) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_least_loaded_takes_the_lowest_score_ties_to_the_lowest_index():
    router = make_router("least_loaded", 4)
    # scores 8, 5, 5, 6: replica 1 and 2 tie, 1 wins
    assert router.route([1], loads((0, 2), (1, 1), (5, 0), (6, 0))) == 1
    # one waiting request outweighs three running ones
    assert router.route([1], loads((3, 0), (0, 1), (4, 0), (5, 0))) == 0
    assert router.route([1], [IDLE] * 4) == 0


def test_cache_aware_sends_a_prefix_where_it_was_routed_before():
    router = make_router("cache_aware", 3, block_size=BS, balance_threshold=8)
    history = list(range(12))  # 3 full blocks
    assert router.route(history, [IDLE] * 3) == 0  # no hit anywhere: the least loaded
    assert router.route([50 + t for t in range(12)], loads((1, 0), (0, 0), (0, 0))) == 1
    # the next turn extends the history: 3 leading blocks expected on replica 0, although busier
    next_turn = history + [7, 7, 7, 7, 8]
    assert router.expected_hits(next_turn) == [3, 0, 0]
    assert router.route(next_turn, loads((3, 1), (1, 0), (0, 0))) == 0
    # a partial block is never counted: 3 tokens are not a block
    assert router.expected_hits(history[:3]) == [0, 0, 0]


def test_cache_aware_longest_hit_wins_and_ties_go_to_the_least_loaded():
    router = make_router("cache_aware", 3, block_size=BS, balance_threshold=2)
    system = [9] * 8  # 2 blocks every conversation shares
    assert router.route(system + [1] * 8, [IDLE] * 3) == 0
    # replica 0 expects 2 blocks, but its load gap (5) passes the threshold: the least loaded
    assert router.route(system + [2] * 8, loads((1, 1), (0, 0), (0, 0))) == 1
    assert router.expected_hits(system + [2] * 8) == [2, 4, 0]
    # the longest hit wins over a lighter load within the threshold
    assert router.route(system + [2] * 8 + [3], loads((0, 0), (2, 0), (0, 0))) == 1
    # a new conversation hits the system prompt on 0 and 1 equally: the less loaded of them
    assert router.route(system + [4] * 4, loads((2, 0), (1, 0), (0, 0))) == 1


def test_the_balance_threshold_flips_cache_aware_to_least_loaded():
    prompt = list(range(16))
    for threshold, expected in ((8, 0), (7, 1)):
        router = make_router("cache_aware", 2, block_size=BS, balance_threshold=threshold)
        router.route(prompt, [IDLE, IDLE])  # remembered on replica 0
        # load gap: score 8 (2 waiting) against 0; the gap must pass the threshold to flip
        assert router.route(prompt, loads((0, 2), (0, 0))) == expected
        assert router.num_balanced == expected  # decisions by load because of the gap
    # when it flips, the prompt is remembered where it went
    assert router.expected_hits(prompt) == [4, 4]


def test_forget_routes_over_the_live_replicas_and_fails_when_none_is_left():
    for policy in ROUTING_POLICIES:
        router = make_router(policy, 3, block_size=BS)
        router.forget(0)
        chosen = [router.route(list(range(8)), [IDLE] * 3) for _ in range(4)]
        assert 0 not in chosen, policy
        router.forget(1)
        router.forget(2)
        with pytest.raises(RuntimeError, match="all 3 replicas are dead"):
            router.route([1], [IDLE] * 3)
    router = make_router("round_robin", 3)
    router.forget(1)
    assert [router.route([1], [IDLE] * 3) for _ in range(4)] == [0, 2, 0, 2]
    with pytest.raises(ValueError, match="replica 3 is out of range"):
        router.forget(3)


def test_a_forgotten_replica_loses_what_the_cache_aware_router_remembered():
    router = make_router("cache_aware", 2, block_size=BS)
    prompt = list(range(8))
    router.route(prompt, [IDLE, IDLE])
    router.forget(0)
    assert router.expected_hits(prompt) == [0, 0]
    assert router.route(prompt, [IDLE, IDLE]) == 1


def test_the_lru_bound_drops_the_least_recently_routed_chains_from_their_tail():
    router = CacheAwareRouter(1, block_size=BS, capacity_blocks=5)
    a, b = [1] * 12, [2] * 12  # 3 blocks each
    router.route(a, [IDLE])
    router.route(b, [IDLE])
    assert len(router.remembered[0]) == 5
    # a's deepest block went first: its first two blocks are still found
    assert router.expected_hits(a) == [2]
    assert router.expected_hits(b) == [3]
    router.route(a, [IDLE])  # a is recent again; b loses its tail
    assert router.expected_hits(a) == [3]
    assert router.expected_hits(b) == [2]


def test_the_router_hashes_blocks_as_the_prefix_cache_does():
    prompt = list(range(40))
    router = CacheAwareRouter(1, block_size=BS)
    bm = BlockManager(num_blocks=32, block_size=BS)
    req = Request("r", prompt, SamplingParams(max_tokens=1))
    assert router.block_hashes(prompt) == bm._hashes(req, len(prompt) // BS)


def test_bad_arguments_name_the_field_and_the_choices():
    with pytest.raises(ValueError, match="round_robin, least_loaded, cache_aware"):
        make_router("random", 2)
    with pytest.raises(ValueError, match="num_replicas must be at least 1"):
        make_router("round_robin", 0)
    with pytest.raises(ValueError, match="got 1 loads for 2 replicas"):
        make_router("least_loaded", 2).route([1], [IDLE])
    with pytest.raises(ValueError, match="balance_threshold must be >= 0"):
        make_router("cache_aware", 2, balance_threshold=-1)


def test_the_router_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, minicb.engine.router; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
