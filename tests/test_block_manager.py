"""BlockManager: block tables, reference counts, the LRU free queue, prefix caching, swap books.

Every number below is worked out by hand from the rules in block_manager.py: blocks are handed
out from the front of the free queue (initially 0, 1, 2, ...), freed blocks go to its back (a
request's tail block first), and a full computed block is named by a hash chained over its prefix.
"""

import pytest

from minicb.core.block_manager import BlockManager
from minicb.core.request import Request
from minicb.sampling_params import SamplingParams


def make_req(rid, tokens, max_tokens=8):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens))


def computed(bm, req, n):
    """Pretend the model ran over the first n tokens: what Scheduler.update does."""
    req.num_computed_tokens = n
    bm.cache_full_blocks(req)


# ---------------------------------------------------------------------------------- allocate / free


def test_allocate_grows_one_block_only_when_the_last_is_full():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_req("a", range(5))
    assert bm.num_blocks_needed("a", 5) == 2 and bm.can_allocate("a", 5)
    bm.allocate(a, 5)  # 5 tokens -> ceil(5 / 4) = 2 blocks, taken from the front of the queue
    assert bm.block_tables["a"] == [0, 1]
    for n in (6, 7, 8):  # the second block still has room: nothing new
        assert bm.num_blocks_needed("a", n) == 0
        bm.allocate(a, n)
        assert bm.block_tables["a"] == [0, 1]
    bm.allocate(a, 9)  # token 9 opens block 3
    assert bm.block_tables["a"] == [0, 1, 2]
    assert bm.ref_counts[:4] == [1, 1, 1, 0]


def test_covers_is_the_decode_fast_path_and_never_skips_a_block_or_a_copy():
    """The scheduler skips can_allocate and allocate when covers() says the table already holds
    the step's tokens: it must say no when a block is missing or a shared block needs its copy."""
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_req("a", range(6))
    assert not bm.covers("a", 6, 0) and not bm.covers("a", 0, 0)  # no table yet: allocate makes it
    bm.allocate(a, 6)
    assert bm.covers("a", 8, 6) and not bm.covers("a", 9, 8)  # block 2 ends at token 8
    computed(bm, a, 6)
    bm.fork("a", "b")  # b shares the partial block: its next write must copy it first
    assert not bm.covers("b", 7, 6) and not bm.covers("a", 7, 6)
    free = bm.num_free_blocks
    bm.allocate(a, 7)  # a's copy is made by allocate, which covers() must not have skipped
    assert bm.take_copies() and bm.num_free_blocks == free - 1 and bm.covers("a", 7, 6)
    assert (bm.num_used_blocks, bm.num_free_blocks) == (3, 5)
    bm.check_invariants()


def test_allocate_refuses_when_blocks_run_out():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = make_req("a", range(12))
    assert bm.can_allocate("a", 12) and not bm.can_allocate("a", 13)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate(a, 13)
    assert bm.num_free_blocks == 3 and "a" not in bm.block_tables  # nothing half-done
    bm.allocate(a, 12)
    with pytest.raises(ValueError, match="new block table"):
        bm.allocate(a, 12, computed_blocks=[0])  # prefix hits only go into a new table


def test_free_returns_every_block_and_unknown_ids_are_ignored():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = make_req("a", range(3)), make_req("b", range(10, 13))
    bm.allocate(a, 3)
    bm.allocate(b, 3)
    bm.free("a")
    assert bm.ref_counts == [0, 0, 1, 1] and bm.num_free_blocks == 2 and "a" not in bm.block_tables
    bm.free("a")  # twice: no effect
    bm.free("nobody")
    assert bm.num_free_blocks == 2
    bm.check_invariants()


def test_free_queue_is_lru_with_tail_blocks_first():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make_req("a", range(12)), make_req("b", range(100, 108))
    bm.allocate(a, 12)  # [0, 1, 2]
    bm.allocate(b, 8)  # [3, 4]
    assert list(bm.free_queue) == [5, 6, 7]
    bm.free("a")  # released tail first: 2, 1, 0 join the back, behind the never-used blocks
    assert list(bm.free_queue) == [5, 6, 7, 2, 1, 0]
    bm.free("b")
    assert list(bm.free_queue) == [5, 6, 7, 2, 1, 0, 4, 3]
    c = make_req("c", range(200, 216))
    bm.allocate(c, 16)  # 4 blocks from the front: the least recently freed
    assert bm.block_tables["c"] == [5, 6, 7, 2]
    bm.check_invariants()


# ---------------------------------------------------------------------------------- prefix cache


def test_prefix_blocks_are_shared_with_ref_counts_and_kept_after_free():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_req("a", range(10))  # blocks: [0 1 2 3] [4 5 6 7] [8 9 . .]
    bm.allocate(a, 10)
    computed(bm, a, 10)
    assert len(bm.cached) == 2  # two full blocks are named; the partial third is not
    assert (
        bm.block_hash[0] is not None and bm.block_hash[1] is not None and bm.block_hash[2] is None
    )

    b = make_req("b", list(range(8)) + [50, 51, 52])  # same first 8 tokens, then its own
    hits = bm.find_cached_prefix(b)
    assert hits == [0, 1]
    assert bm.num_blocks_needed("b", 11, hits) == 1  # 3 blocks, 2 shared: one new
    bm.allocate(b, 11, hits)
    assert bm.block_tables["b"] == [0, 1, 3]
    assert bm.ref_counts[:4] == [2, 2, 1, 1]
    bm.check_invariants()

    bm.free("a")  # only a's own tail block becomes free; the shared ones stay with b
    assert bm.ref_counts[:4] == [1, 1, 0, 1] and 2 in bm.free_queue and 0 not in bm.free_queue
    bm.free("b")  # now the prefix blocks are free but still cached, at the back of the queue
    assert list(bm.free_queue)[-3:] == [3, 1, 0]
    assert bm.num_cached_free_blocks == 2 and len(bm.cached) == 2

    c = make_req("c", list(range(8)) + [99])
    hits = bm.find_cached_prefix(c)
    assert hits == [0, 1]
    assert bm.num_blocks_needed("c", 9, hits) == 3  # 1 new + 2 revived from the free queue
    bm.allocate(c, 9, hits)
    assert bm.block_tables["c"][:2] == [0, 1] and 0 not in bm.free_queue and 1 not in bm.free_queue
    bm.check_invariants()


def test_last_token_is_never_taken_from_the_cache():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_req("a", range(8))
    bm.allocate(a, 8)
    computed(bm, a, 8)
    same = make_req("same", range(8))  # fully cached, but its last token's logits are needed
    assert bm.find_cached_prefix(same) == [0]  # (8 - 1) // 4 = 1 block: block 2 is recomputed
    longer = make_req("longer", range(9))
    assert bm.find_cached_prefix(longer) == [0, 1]  # (9 - 1) // 4 = 2 blocks, 1 token to compute


def test_hash_chain_names_the_whole_prefix():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.allocate(a, 9)
    computed(bm, a, 9)
    other_start = make_req("x", [0, 2, 3, 4, 5, 6, 7, 8, 9])  # same second block, other first
    assert bm.find_cached_prefix(other_start) == []
    other_second = make_req("y", [1, 2, 3, 4, 5, 6, 7, 0, 9])
    assert bm.find_cached_prefix(other_second) == [0]


def test_cached_block_is_evicted_when_handed_out_again():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = make_req("a", range(9))
    bm.allocate(a, 9)
    computed(bm, a, 9)
    bm.free("a")
    assert bm.num_cached_free_blocks == 2 and list(bm.free_queue) == [2, 1, 0]
    big = make_req("big", range(100, 108))
    bm.allocate(big, 8)  # takes 2 (uncached tail) and 1 (the second prefix block: evicted)
    assert bm.block_tables["big"] == [2, 1]
    assert len(bm.cached) == 1 and bm.block_hash[1] is None and bm.num_cached_free_blocks == 1
    again = make_req("again", range(9))
    assert bm.find_cached_prefix(again) == [0]  # the first block survives, the second is gone
    bm.free("big")
    bm.allocate(make_req("all", range(200, 212)), 12)  # every block: the last prefix is evicted
    assert bm.cached == {} and bm.find_cached_prefix(again) == []
    bm.check_invariants()


def test_a_prefix_computed_twice_keeps_the_first_copy():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make_req("a", range(5)), make_req("b", range(5))  # admitted together: no hits yet
    bm.allocate(a, 5)
    bm.allocate(b, 5)
    computed(bm, a, 5)
    computed(bm, b, 5)
    assert list(bm.cached.values()) == [0] and bm.block_hash[2] is None
    bm.check_invariants()


def test_prefix_caching_disabled():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_req("a", range(9))
    bm.allocate(a, 9)
    computed(bm, a, 9)
    assert bm.cached == {} and bm.find_cached_prefix(make_req("b", range(9))) == []


# ---------------------------------------------------------------------------------- fragmentation


@pytest.mark.parametrize(
    "tokens,blocks,waste", [(500, 32, 12), (50, 4, 14), (16, 1, 0), (1, 1, 15)]
)
def test_internal_fragmentation_is_less_than_one_block(tokens, blocks, waste):
    """The reading's example: reserving 8K token slots per request wastes 7,500 slots for a
    500-token request and 7,950 for a 50-token one. Paged with 16-token blocks, a request wastes
    only the unused tail of its last block: 512 - 500 = 12 and 64 - 50 = 14 slots."""
    bm = BlockManager(num_blocks=64, block_size=16)
    bm.allocate(make_req("r", range(tokens)), tokens)
    allocated = len(bm.block_tables["r"]) * bm.block_size
    assert len(bm.block_tables["r"]) == blocks and allocated - tokens == waste
    assert waste < bm.block_size


# ---------------------------------------------------------------------------------- swap


def test_swap_out_and_in_bookkeeping():
    bm = BlockManager(num_blocks=6, block_size=4, num_cpu_blocks=3)
    a = make_req("a", range(7))
    bm.allocate(a, 7)
    computed(bm, a, 7)  # one full (cached) block, one partial
    assert bm.can_swap_out("a")
    copies = bm.swap_out("a")
    assert copies == [(0, 0), (1, 1)]  # (device, cpu): CPU blocks come from the low ids
    assert "a" not in bm.block_tables and bm.cpu_block_tables["a"] == [0, 1]
    assert bm.num_free_blocks == 6 and bm.num_free_cpu_blocks == 1
    assert bm.num_cached_free_blocks == 1  # the device copy of the full block stays reusable
    bm.check_invariants()

    # While a is away, another request takes device blocks.
    bm.allocate(make_req("b", range(100, 116)), 16)  # 4 blocks: 2, 3, 4, 5 (the unused ones first)
    assert bm.block_tables["b"] == [2, 3, 4, 5]
    assert bm.can_swap_in("a", 7) and not bm.can_swap_in("a", 9)  # 9 tokens would need 3 blocks
    copies = bm.swap_in(a)
    assert copies == [(0, 1), (1, 0)]  # (cpu, device) into fresh blocks; free queue was [1, 0]
    assert bm.block_tables["a"] == [1, 0] and bm.cpu_block_tables == {}
    assert bm.num_free_cpu_blocks == 3 and bm.num_free_blocks == 0
    bm.check_invariants()


def test_a_block_copied_on_write_and_swapped_out_in_one_step_leaves_from_its_source():
    """The runner swaps out before it copies: a copy-on-write decided in the same step has not run
    yet, so swap_out sends the copy's source to the CPU and cancels the copy; free() cancels copies
    into the blocks it gives back."""
    bm = BlockManager(num_blocks=8, block_size=4, num_cpu_blocks=4)
    a = make_req("a", range(6))
    bm.allocate(a, 6)
    computed(bm, a, 6)
    bm.fork("a", "b")  # b shares a's full block and its partial one
    bm.fork("a", "c")
    shared = bm.block_tables["b"][1]
    bm.copy_on_write("b", 1)  # b will write its next token: a private copy of the partial block
    bm.copy_on_write("c", 1)
    copy_b, copy_c = bm.block_tables["b"][1], bm.block_tables["c"][1]
    assert bm.pending_copies == [(shared, copy_b), (shared, copy_c)]
    copies = bm.swap_out("b")
    assert copies[1][0] == shared and bm.pending_copies == [(shared, copy_c)]
    bm.free("c")
    assert bm.take_copies() == []
    bm.check_invariants()


def test_swap_out_needs_cpu_room_and_free_drops_cpu_blocks():
    bm = BlockManager(num_blocks=8, block_size=2, num_cpu_blocks=2)
    big, small = make_req("big", range(5)), make_req("small", range(10, 13))
    bm.allocate(big, 5)  # 3 blocks > 2 CPU blocks
    bm.allocate(small, 3)  # 2 blocks
    assert not bm.can_swap_out("big") and bm.can_swap_out("small")
    bm.swap_out("small")
    assert not bm.can_swap_out("big")
    bm.free("small")  # aborting a swapped request gives back its CPU blocks
    assert bm.num_free_cpu_blocks == 2 and bm.cpu_block_tables == {}
    bm.check_invariants()


def test_no_swap_space():
    bm = BlockManager(num_blocks=4, block_size=2, num_cpu_blocks=0)
    bm.allocate(make_req("a", range(3)), 3)
    assert not bm.can_swap_out("a")


# ----------------------------------------------------------------------------------
# check_invariants


def busy_manager():
    bm = BlockManager(num_blocks=8, block_size=4, num_cpu_blocks=4)
    a = make_req("a", range(9))
    bm.allocate(a, 9)
    computed(bm, a, 9)
    b = make_req("b", list(range(8)) + [70, 71])
    bm.allocate(b, 10, bm.find_cached_prefix(b))  # shares blocks 0 and 1
    c = make_req("c", range(300, 305))
    bm.allocate(c, 5)
    bm.swap_out("c")
    bm.check_invariants()
    return bm


def _bad_ref_count(bm):
    bm.ref_counts[0] = 1  # shared by two tables


def _block_free_and_owned(bm):
    bm.free_queue[bm.block_tables["a"][2]] = None


def _owned_block_missing_from_queue(bm):
    bm.block_tables["a"].pop()  # a block neither owned nor free: leaked


def _block_twice_in_a_table(bm):
    bm.block_tables["a"].append(bm.block_tables["a"][0])
    bm.ref_counts[bm.block_tables["a"][0]] += 1


def _cached_map_disagrees(bm):
    h = next(iter(bm.cached))
    bm.cached[h] = 5


def _cpu_block_leaked(bm):
    bm.cpu_free.pop()


def _cpu_block_owned_twice(bm):
    bm.cpu_block_tables["d"] = [bm.cpu_block_tables["c"][0]]


@pytest.mark.parametrize(
    "corrupt",
    [
        _bad_ref_count,
        _block_free_and_owned,
        _owned_block_missing_from_queue,
        _block_twice_in_a_table,
        _cached_map_disagrees,
        _cpu_block_leaked,
        _cpu_block_owned_twice,
    ],
)
def test_check_invariants_catches_corruption(corrupt):
    bm = busy_manager()
    corrupt(bm)
    with pytest.raises(AssertionError):
        bm.check_invariants()


def test_repr_shows_the_state():
    bm = busy_manager()
    text = repr(bm)
    assert "blocks=8 x 4 tokens" in text and "a: [0, 1, 2]" in text and "cpu_free=2/4" in text


def test_a_hash_collision_never_serves_another_prompts_blocks(monkeypatch):
    # Force every block of every prompt to the same hash: a hit must still be confirmed against the
    # block's own tokens, so b (different tokens) gets nothing from a, and a copy of a gets a's
    # block.
    import minicb.core.block_manager as block_manager

    monkeypatch.setattr(block_manager, "hash_block", lambda parent, tokens: 42)
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_req("a", range(9))
    bm.allocate(a, 9)
    computed(bm, a, 9)
    assert bm.cached == {42: 0}  # a's first block holds the (colliding) hash
    # same hash, other tokens: a miss
    assert bm.find_cached_prefix(make_req("b", [7, 7, 7, 7, 7])) == []
    assert bm.find_cached_prefix(make_req("a2", list(range(4)) + [1])) == [0]  # same tokens: a hit
    bm.check_invariants()
