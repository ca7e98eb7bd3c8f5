"""A CPU tier for the prefix cache: full blocks that the device's prefix cache evicts are kept in
host memory, and a later prompt that starts with them loads them back instead of recomputing them.

vLLM V1 (since 2025) does this with its KV-offloading connector: `kv_offloading_size` GiB of host
memory, `kv_offloading_backend="native"` (or LMCache). A device block that holds a cached prefix
stays reusable while it sits free on the device; once the allocator hands it to someone else, its
contents would be lost. With the tier, that eviction first copies the block to a host slot. A
prompt whose prefix misses on the device then looks in the tier, block after block along its hash
chain, and every block found there is copied back into a fresh device block, a host-to-device copy
in place of a prefill's compute. Multi-turn chats and agents, whose conversations come back after
other traffic pushed them out of device memory, are where it pays.

This file keeps the tier's books (which hash sits in which host slot, least recently used first);
BlockManager decides when to store and load, and the KV cache (worker/kv_cache.py) moves the
bytes at the start of the step that needs them. A slot that a load reads in a step is pinned for
that step: a store that evicts from the tier never reuses it before the load has run. V0's swap
space (preemption_mode="swap") is another pool: it holds a preempted request's blocks, one owner
each; the tier holds nobody's blocks, only copies of prefixes, and any request may hit them.
"""

from collections import OrderedDict


class CpuBlockTier:
    """Host slots holding evicted prefix-cache blocks, evicted in turn least recently used first
    (vLLM's native backend; it also offers ARC)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.lru: OrderedDict[int, int] = OrderedDict()  # block hash -> slot, least recent first
        # what each slot's hash stands for, (parent hash, tokens): a hit must match it
        self.slot_key: list[tuple | None] = [None] * num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.pinned: set[int] = set()  # slots a load reads this step
        self.offloads: list[tuple[int, int]] = []  # this step's copies in: (device block, slot)
        self.loads: list[tuple[int, int]] = []  # and out: (slot, device block)
        self.num_stored = 0  # blocks copied in (device -> host), over the engine's life
        self.num_loaded = 0  # blocks copied out (host -> device)

    def evicted(self, block: int, block_hash: int, key: tuple) -> None:
        """The device's prefix cache evicts `block`: copy it into a slot at the step's start."""
        slot = self.store(block_hash, key)
        if slot is not None:
            self.offloads.append((block, slot))

    def store(self, block_hash: int, key: tuple) -> int | None:
        """The slot to copy an evicted device block into, or None: the tier has it already (it is
        now the most recent), or every slot is pinned this step."""
        if block_hash in self.lru:
            self.lru.move_to_end(block_hash)
            return None
        slot = self.free.pop() if self.free else self._evict()
        if slot is None:
            return None
        self.lru[block_hash] = slot
        self.slot_key[slot] = key
        self.num_stored += 1
        return slot

    def _evict(self) -> int | None:
        """Free the least recently used slot that no load reads this step. If this step was to copy
        a block into it, that copy is dropped: one slot, one copy (two copies into one index of
        a single index_copy_ leave either, nondeterministically on a GPU)."""
        for block_hash, slot in self.lru.items():
            if slot not in self.pinned:
                del self.lru[block_hash]
                self.slot_key[slot] = None
                self.offloads = [(b, s) for b, s in self.offloads if s != slot]
                return slot
        return None

    def lookup(self, block_hash: int, key: tuple) -> int | None:
        """The slot holding this block, or None; a hit becomes the most recent."""
        slot = self.lru.get(block_hash)
        if slot is None or self.slot_key[slot] != key:
            return None
        self.lru.move_to_end(block_hash)
        return slot

    def find_run(self, blocks: list[tuple[int, tuple]]) -> list[int]:
        """The slots of the leading (hash, key) blocks found here, up to the first miss."""
        slots = []
        for block_hash, key in blocks:
            slot = self.lookup(block_hash, key)
            if slot is None:
                break
            slots.append(slot)
        return slots

    def pin(self, slot: int) -> None:
        """A hit will be copied back this step: no store may take its slot before that."""
        self.pinned.add(slot)

    def loading(self, slot: int, block: int) -> None:
        self.loads.append((slot, block))
        self.num_loaded += 1

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's (offloads, loads); the slots are unpinned for the next step."""
        transfers = self.offloads, self.loads
        self.offloads, self.loads, self.pinned = [], [], set()
        return transfers

    def check_invariants(self) -> None:
        used = list(self.lru.values())
        assert len(set(used)) == len(used), "a slot holds two hashes"
        assert sorted(used + self.free) == list(range(self.num_blocks)), "a tier slot leaked"
        assert all(self.slot_key[s] is not None for s in used)
        assert all(self.slot_key[s] is None for s in self.free)

    def __repr__(self) -> str:
        return (
            f"CpuBlockTier(slots={self.num_blocks}, used={len(self.lru)}, "
            f"stored={self.num_stored}, loaded={self.num_loaded})"
        )
