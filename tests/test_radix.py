"""The radix tree of notebook 13 against brute force: what it stores, matches and evicts."""

import random

import pytest

from minicb.reference.radix import RadixTree, common_prefix_len


def random_sequences(rng, count, alphabet=3, max_len=12):
    # A small alphabet makes shared prefixes, splits in the middle of edges and duplicates common.
    return [
        tuple(rng.randrange(alphabet) for _ in range(rng.randint(1, max_len))) for _ in range(count)
    ]


def prefixes(seqs):
    """Every non-empty prefix of every sequence: exactly what a token-level radix tree stores."""
    return {s[:i] for s in seqs for i in range(1, len(s) + 1)}


def longest_stored_prefix(stored, query):
    return max((i for i in range(len(query) + 1) if i == 0 or query[:i] in stored), default=0)


@pytest.mark.parametrize("seed", range(25))
def test_insert_and_match_equal_brute_force(seed):
    rng = random.Random(seed)
    tree, inserted = RadixTree(), []
    for seq in random_sequences(rng, 30):
        already = tree.insert(seq)
        assert already == max((common_prefix_len(s, seq) for s in inserted), default=0)
        inserted.append(seq)
        tree.check_invariants()
        # Each token of each distinct prefix is stored once, however many sequences share it.
        assert tree.num_tokens == len(prefixes(inserted))
    for query in random_sequences(rng, 40, max_len=15):
        assert tree.match_prefix(query) == max(common_prefix_len(s, query) for s in inserted)
    # The leaves spell out exactly the inserted sequences that are not a prefix of another one.
    maximal = {s for s in inserted if not any(t != s and t[: len(s)] == s for t in inserted)}
    assert set(tree.sequences()) == maximal


def test_split_keeps_both_branches():
    tree = RadixTree()
    tree.insert([1, 2, 3, 4])
    assert tree.insert([1, 2, 9]) == 2
    assert [n.key for n in tree.nodes()] == [(1, 2), (3, 4), (9,)]
    assert tree.match_prefix([1, 2, 3, 7]) == 3 and tree.match_prefix([1, 2, 9, 9]) == 3
    assert tree.insert([1, 2]) == 2 and tree.num_tokens == 5  # already stored: nothing added


@pytest.mark.parametrize("seed", range(15))
def test_eviction_removes_lru_leaves_and_spares_locked_paths(seed):
    rng = random.Random(100 + seed)
    tree = RadixTree()
    seqs = random_sequences(rng, 20, alphabet=4)
    for s in seqs:
        tree.insert(s)
    for s in rng.sample(seqs, 8):  # touch some, so recency differs from insertion order
        tree.match_prefix(s)
    locked = rng.sample(seqs, 3)
    for s in locked:
        tree.lock(s)
    before = prefixes(tree.sequences())
    leaves = [n for n in tree.nodes() if n.is_leaf and n.ref_count == 0]
    first = min((n.last_access for n in leaves), default=None)
    oldest = {n.key for n in leaves if n.last_access == first}  # ties are broken by tree order
    want = rng.randint(1, tree.num_tokens)
    removed = tree.evict(want)
    tree.check_invariants()
    after = prefixes(tree.sequences())
    if removed:
        assert removed[0] in oldest  # the least recently used unlocked leaf goes first
    assert sum(map(len, removed)) == len(before) - len(after) == len(before) - tree.num_tokens
    assert after <= before  # eviction only removes, and what stays is still prefix-closed
    assert all(s[:i] in after for s in after for i in range(1, len(s)))
    for s in locked:  # a locked sequence is still matched in full
        assert tree.match_prefix(s) == len(s)
    # It stops once enough is freed, unless only locked tokens are left.
    assert sum(map(len, removed)) >= want or all(n.ref_count > 0 for n in tree.nodes() if n.is_leaf)


def test_shared_prefix_outlives_its_branches():
    tree = RadixTree()
    system = list(range(100, 110))
    for user in ([1, 2], [3, 4], [5, 6]):
        tree.insert(system + user)
    removed = tree.evict(4)  # two branches, oldest first; the system prompt is an inner node
    assert removed == [(1, 2), (3, 4)] and tree.match_prefix(system) == len(system)
    assert tree.evict(100) == [(5, 6), tuple(system)] and tree.num_tokens == 0


def test_unlock_without_lock_and_lock_of_unknown_tokens_are_refused():
    tree = RadixTree()
    tree.insert([1, 2, 3])
    with pytest.raises(ValueError):
        tree.unlock([1, 2, 3])
    with pytest.raises(ValueError):
        tree.lock([1, 2, 3, 4])


def test_cost_counters_count_a_walk():
    tree = RadixTree()
    tree.insert(list(range(50)))
    tree.tokens_compared = tree.nodes_visited = 0
    assert tree.match_prefix(list(range(40)) + [-1]) == 40
    # 40 equal tokens, then the mismatch
    assert (tree.nodes_visited, tree.tokens_compared) == (1, 41)
