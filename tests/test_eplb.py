"""The expert-parallel load balancer of notebook 20 (reference/eplb.py): the contiguous placement is
minicb's split, replication gives the slots to the hottest experts, packing places every copy once,
and every load is counted exactly (integers and Fractions)."""

import itertools
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minicb.reference.eplb import (
    Placement,
    contiguous_placement,
    imbalance,
    pack,
    rank_loads,
    rebalance,
    replicate,
)


@st.composite
def problems(draw):
    """(load per expert, num_ranks, num_slots): E a multiple of N, slots a multiple of N >= E."""
    num_ranks = draw(st.integers(1, 4))
    num_experts = num_ranks * draw(st.integers(1, 4))
    load = draw(st.lists(st.integers(0, 60), min_size=num_experts, max_size=num_experts))
    num_slots = num_experts + num_ranks * draw(st.integers(0, 3))
    return load, num_ranks, num_slots


def test_the_default_placement_is_the_contiguous_split():
    placement = contiguous_placement(8, 4)
    assert placement.slots == ((0, 1), (2, 3), (4, 5), (6, 7))
    load = [5, 1, 0, 2, 9, 9, 3, 3]
    assert rank_loads(placement, load) == [6, 2, 18, 6]
    assert imbalance(rank_loads(placement, load)) == Fraction(18 * 4, 32)
    assert placement.copies() == [1] * 8
    assert repr(placement) == (
        "Placement(8 experts in 8 slots on 4 ranks, 0 redundant | rank 0: [0, 1]; rank 1: [2, 3]; "
        "rank 2: [4, 5]; rank 3: [6, 7])"
    )


@given(problems())
def test_the_contiguous_placement_sums_each_ranks_run_of_experts(problem):
    load, num_ranks, _ = problem
    per_rank = len(load) // num_ranks
    expected = [sum(load[r * per_rank : (r + 1) * per_rank]) for r in range(num_ranks)]
    assert rank_loads(contiguous_placement(len(load), num_ranks), load) == expected


def test_a_hot_expert_replicated_onto_k_copies_splits_its_load_by_k():
    load = [60, 3, 3, 3, 3, 3, 3, 3]  # expert 0 is hot
    for extra in range(5):  # 60 / 5 = 12 is still above every other expert's 3
        assert replicate(load, 8 + extra) == [1 + extra] + [1] * 7
    for k in (1, 2, 3, 4):  # k ranks, each with a copy of expert 0 and one 3-token expert
        placement = Placement(tuple((0, r + 1) for r in range(k)))
        assert placement.copies() == [k] + [1] * k
        assert rank_loads(placement, load[: k + 1]) == [Fraction(60, k) + 3] * k
        assert imbalance(rank_loads(placement, load[: k + 1])) == 1


def test_rebalancing_two_hot_experts():
    load = [60, 60, 3, 3, 3, 3, 3, 3]
    before = rank_loads(contiguous_placement(8, 4), load)
    assert before == [120, 6, 6, 6] and imbalance(before) == Fraction(120, Fraction(138, 4))
    placement = rebalance(load, 12, 4)  # one redundant slot per rank
    # the four extra slots: expert 0 (60 per copy), 1 (60), 0 (30 > 20), 1: three copies each
    assert placement.copies() == [3, 3, 1, 1, 1, 1, 1, 1]
    # 20-token copies first: 0 -> ranks 0, 1, 2; 1 -> rank 3, then ranks 0 and 1 (no 1 there yet);
    # the 3-token experts to the lightest rank with room: 2, 3, 2, 3, then 0 and 1
    assert placement.slots == ((0, 1, 6), (0, 1, 7), (0, 2, 4), (1, 3, 5))
    assert rank_loads(placement, load) == [43, 43, 26, 26]
    assert imbalance(rank_loads(placement, load)) == Fraction(43 * 4, 138)
    assert repr(placement).startswith("Placement(8 experts in 12 slots on 4 ranks, 4 redundant")


def test_replication_goes_to_the_highest_load_per_copy():
    # 12 per copy with 1 copy vs 10 per copy: expert 0 first; then 6 per copy < 10: expert 1
    assert replicate([12, 10, 1, 1], 5) == [2, 1, 1, 1]
    assert replicate([12, 10, 1, 1], 6) == [2, 2, 1, 1]
    assert replicate([12, 10, 1, 1], 7) == [3, 2, 1, 1]  # 6 vs 5: expert 0 again
    assert replicate([4, 4], 3) == [2, 1]  # a tie goes to the lowest id
    assert replicate([0, 0, 0], 3) == [1, 1, 1]


def hottest_copy(load, copies):
    return max(Fraction(x, c) for x, c in zip(load, copies))


@given(problems())
def test_replication_never_worsens_the_hottest_copy_and_is_optimal(problem):
    load, _, num_slots = problem
    previous = None
    for slots in range(len(load), num_slots + 1):
        copies = replicate(load, slots)
        assert sum(copies) == slots and min(copies) >= 1
        hottest = hottest_copy(load, copies)
        assert previous is None or hottest <= previous  # one more slot never hurts
        previous = hottest
    # no way of giving out the extra slots makes the hottest copy lighter (brute force, small cases)
    extra = num_slots - len(load)
    if len(load) <= 6 and extra <= 4:
        best = min(
            hottest_copy(load, [1 + c for c in combo])
            for combo in itertools.product(range(extra + 1), repeat=len(load))
            if sum(combo) == extra
        )
        assert hottest_copy(load, replicate(load, num_slots)) == best


@settings(max_examples=200)
@given(problems())
def test_packing_places_every_copy_once_and_fills_every_rank(problem):
    load, num_ranks, num_slots = problem
    copies = replicate(load, num_slots)
    placement = pack(load, copies, num_ranks)
    assert placement.num_ranks == num_ranks
    assert all(len(rank) == num_slots // num_ranks for rank in placement.slots)
    assert placement.copies() == copies  # every copy exactly once
    per_rank = rank_loads(placement, load)
    assert sum(per_rank) == sum(load)  # every token computed once, wherever its copies are
    assert max(per_rank) >= max(Fraction(sum(load), num_ranks), hottest_copy(load, copies))
    assert imbalance(per_rank) >= 1


def test_packing_puts_the_heaviest_copy_first_on_the_least_loaded_rank():
    load = [9, 7, 6, 2, 1, 1]
    placement = pack(load, [1] * 6, 2)
    # 9 -> rank 0; 7 -> rank 1; 6 -> rank 1 (7 < 9); 2 -> rank 0 (9 < 13); 1 -> rank 0 (11 < 13),
    # rank 0 is then full: the last 1 -> rank 1
    assert placement.slots == ((0, 3, 4), (1, 2, 5))
    assert rank_loads(placement, load) == [12, 14]


def test_a_rank_with_a_copy_of_the_same_expert_is_passed_over():
    load = [8, 1, 1, 1, 1, 1]
    placement = pack(load, [2, 1, 1, 1, 1, 2], 2)  # expert 5's two copies: 1/2 token each
    assert sorted(placement.ranks_of(0)) == [0, 1]
    assert sorted(placement.ranks_of(5)) == [0, 1]


def test_refusals_name_the_numbers():
    with pytest.raises(ValueError, match="3 ranks must divide num_experts=8"):
        contiguous_placement(8, 3)
    with pytest.raises(ValueError, match="num_slots=3 is fewer than the 4 experts"):
        replicate([1, 2, 3, 4], 3)
    with pytest.raises(ValueError, match="4 ranks must divide the 6 slots"):
        pack([1, 2, 3, 4], [2, 2, 1, 1], 4)
    with pytest.raises(ValueError, match="the same number of slots"):
        Placement(((0, 1), (2,)))
    with pytest.raises(ValueError, match="holds 4 experts, the load names 2"):
        rank_loads(contiguous_placement(4, 2), [1, 2])
    assert imbalance([0, 0]) == 1
