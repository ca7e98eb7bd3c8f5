"""BlockManager: paged KV-cache memory, as in vLLM's PagedAttention (Kwon et al., SOSP 2023).

The KV cache is cut into `num_blocks` fixed-size blocks of `block_size` tokens. A request
owns a *block table*: the list of physical block ids that hold its tokens in order, so logical
token i lives in block `table[i // block_size]` at offset `i % block_size`. Blocks are handed out
one at a time as a sequence grows, so at most one partly filled block per request is wasted
(internal fragmentation), instead of a whole max_model_len reservation.

Prefix caching: once a block is full and computed, it is named by a hash chained over all the
tokens before it. A new request whose prompt starts with the same tokens reuses those blocks
(the reference count goes up) and skips computing them. Freed blocks keep their hash and wait at
the end of the free queue, so they can still be reused until the allocator hands them out again.

Fork and copy-on-write: the n samples of one prompt share its blocks after the prefill (fork: the
reference counts go up, nothing is copied). A full block is never written again, so sharing it is
free forever; the last, partly filled block is written by every sample's next token, so the first
sample to write into it while it is still shared gets a private copy (copy_on_write), and the last
one left writes in place. vLLM's PagedAttention paper keeps reference counts for exactly this.

Swap: a preempted request's blocks can be copied to a pool of CPU blocks and back. This class only
keeps the books (which block goes where); the torch side (kv_cache.py) copies the bytes.

A CPU tier for the prefix cache (num_offload_blocks > 0; kv_offload.py): a cached block that the
allocator evicts is first copied to a host slot, and a prompt that misses on the device but finds
the next blocks of its chain there has them copied back (`find_offloaded`, then `allocate`).

KV cache groups (vLLM V1's hybrid KV cache manager; kv_cache_groups.py): with `windows` of several
groups, a request has one table per group (`tables[rid]`, group 0's is `block_tables[rid]`), all of
the same length and all drawn from this one pool. A sliding-window group's leading entries become
NULL_BLOCK as its blocks fall out of the window (`remove_skipped`), and its prefix-cache hits need
only the window's blocks. The null block is the sink (its id is num_blocks): nobody owns it.
"""

from collections import OrderedDict

from ..config import cdiv
from .kv_cache_groups import num_skipped_blocks
from .kv_offload import CpuBlockTier
from .request import Request


def hash_block(parent_hash: int | None, tokens: tuple[int, ...]) -> int:
    # Chaining makes the hash name the whole prefix, not just this block's tokens. Python's hash()
    # is fast and fine inside one process; a hit is still confirmed against the block's tokens
    # (find_cached_prefix), so a collision can never serve another prompt's K/V. vLLM offers
    # SHA-256.
    return hash((parent_hash, tokens))


def hash_chain(hashes: list[int], token_ids, block_size: int, num_full_blocks: int) -> list[int]:
    """Extend `hashes`, the chain of `token_ids`' full blocks, in place to `num_full_blocks`."""
    while len(hashes) < num_full_blocks:
        i = len(hashes)
        block = tuple(token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(hash_block(hashes[-1] if hashes else None, block))
    return hashes


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = True,
        num_offload_blocks: int = 0,
        windows: tuple[int | None, ...] = (None,),
    ):
        if num_offload_blocks and tuple(windows) != (None,):
            raise ValueError("the CPU tier keeps one full-attention KV cache group's blocks")
        self.num_blocks = num_blocks
        # per KV cache group, its sliding window (None: full attention)
        self.windows, self.slides = tuple(windows), any(w is not None for w in windows)
        self.null_block = num_blocks  # vLLM's null block: the sink, owned by no request
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        # Free queue in eviction order: allocation takes from the front; freed blocks go to the
        # back, so a cached block that was used recently survives longest. OrderedDict: O(1) removal
        # from the middle when a prefix hit revives a free block.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_hash: list[int | None] = [None] * num_blocks  # hash of a full computed block
        # What that hash stands for, (parent hash, tokens): a hit is trusted only if it matches, so
        # a hash collision costs a recomputation, never another prompt's K/V.
        self.block_key: list[tuple | None] = [None] * num_blocks
        # hash (group 0) or (group, hash) -> block id holding that prefix block
        self.cached: dict = {}
        self.block_tables: dict[str, list[int]] = {}  # request id -> physical block ids (group 0)
        self.tables: dict[str, list[list[int]]] = {}  # request id -> one table per group
        self.num_hashed: dict[str, int] = {}  # request id -> leading blocks already registered
        # Swap space: CPU blocks have no prefix sharing, one owner each.
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_free: list[int] = list(range(num_cpu_blocks - 1, -1, -1))
        self.cpu_block_tables: dict[str, list[int]] = {}
        self.swapped_nulls: dict[str, list[list[bool]]] = {}  # which entries were null, per group
        # (src, dst) device copies the runner must make
        self.pending_copies: list[tuple[int, int]] = []
        # the prefix cache's CPU tier, with this step's copies to it and from it
        self.tier = CpuBlockTier(num_offload_blocks) if num_offload_blocks else None

    # ------------------------------------------------------------------ statistics
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a reusable prefix (evicted only when handed out again)."""
        return sum(1 for b in self.free_queue if self.block_hash[b] is not None)

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self.cpu_free)

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ------------------------------------------------------------------ prefix cache
    def _hashes(self, req: Request, num_full_blocks: int) -> list[int]:
        """Extend the request's hash chain to cover its first `num_full_blocks` blocks."""
        return hash_chain(req.block_hashes, req.token_ids, self.block_size, num_full_blocks)

    def find_cached_prefix(self, req: Request) -> list:
        """Blocks already holding this request's leading tokens. At least one token is always left
        to compute (its logits are needed for the next sample), so the block holding the last
        token is never taken from the cache and no write ever lands in a shared block. With several
        KV cache groups, each entry is a tuple: the block in each group (NULL_BLOCK out of a
        window)."""
        if not self._may_hit(req):
            return []
        num_full = (req.num_tokens - 1) // self.block_size
        self._hashes(req, num_full)
        n, groups = 0, range(len(self.windows))
        full = [g for g in groups if self.windows[g] is None]
        while n < num_full and all(self._hit(g, req, n) is not None for g in full):
            n += 1  # full attention: left to right, to the first miss
        shortened = self.slides
        while shortened:  # a window: its blocks before the hit's end, right to left
            shortened = False
            for g in groups:
                while (
                    self.windows[g]
                    and n
                    and not all(self._hit(g, req, i) is not None for i in self._window(g, n))
                ):
                    n, shortened = n - 1, True
        skip = [num_skipped_blocks(w, n * self.block_size, self.block_size) for w in self.windows]
        hits = [
            tuple(self._hit(g, req, i) if i >= skip[g] else self.null_block for g in groups)
            for i in range(n)
        ]
        return [col[0] for col in hits] if len(groups) == 1 else hits

    def _window(self, g: int, num_blocks: int) -> range:
        """The blocks of group g that a query after `num_blocks` full blocks may see."""
        bs = self.block_size
        return range(num_skipped_blocks(self.windows[g], num_blocks * bs, bs), num_blocks)

    def _ck(self, g: int, h: int):
        """The prefix cache's key of hash h in group g (group 0: the bare hash, as with one
        group)."""
        return h if g == 0 else (g, h)

    def _hit(self, g: int, req: Request, i: int) -> int | None:
        """The cached block of group g holding block i of `req`, if its tokens match."""
        block = self.cached.get(self._ck(g, req.block_hashes[i]))
        return None if block is None or self.block_key[block] != self._key(req, i) else block

    def find_offloaded(self, req: Request, start: int) -> list[int]:
        """Tier slots holding this request's blocks start, start + 1, ... (after its device hits):
        the run of its hash chain found in the CPU tier, as far as find_cached_prefix may go."""
        if self.tier is None or not self._may_hit(req):
            return []
        num_full = (req.num_tokens - 1) // self.block_size
        hashes = self._hashes(req, num_full)
        return self.tier.find_run([(hashes[i], self._key(req, i)) for i in range(start, num_full)])

    def _may_hit(self, req: Request) -> bool:
        # prompt_logprobs need every prompt token's logits: cached blocks have none
        scores_prompt = req.prompt_logprobs is not None
        return self.enable_prefix_caching and not (
            scores_prompt and len(req.prompt_logprobs) < req.num_prompt_tokens
        )

    def _key(self, req: Request, i: int) -> tuple:
        """(parent hash, tokens) of block i of `req`: what its hash must stand for."""
        bs = self.block_size
        return (req.block_hashes[i - 1] if i else None, tuple(req.token_ids[i * bs : (i + 1) * bs]))

    def cache_full_blocks(self, req: Request) -> None:
        """Register the hash of every block that became full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        rid = req.request_id
        # (a step's accepted drafts have K/V before update() appends them: their blocks are hashed
        # next time)
        start, end = (
            self.num_hashed[rid],
            min(req.num_computed_tokens, req.num_tokens) // self.block_size,
        )
        if end <= start:
            return
        hashes = self._hashes(req, end)
        for g, table in enumerate(self.tables[rid]):
            for i in range(start, end):
                key, block = self._ck(g, hashes[i]), table[i]
                # the same prefix computed twice keeps the first copy; a window's freed block none
                if key not in self.cached and block != self.null_block:
                    self.cached[key] = block
                    self.block_hash[block] = key
                    self.block_key[block] = self._key(req, i)
        self.num_hashed[rid] = end

    # ------------------------------------------------------------------ allocate / free
    def _take_free_block(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        h = self.block_hash[block]
        if h is not None and self.tier is not None:  # keep a copy of the prefix it held
            self.tier.evicted(block, h, self.block_key[block])
        if h is not None:  # evict the prefix it held
            self.block_hash[block] = self.block_key[block] = None
            if self.cached.get(h) == block:
                del self.cached[h]
        self.ref_counts[block] = 1
        return block

    def must_copy(self, rid: str, num_computed: int) -> bool:
        """Would the next write (at position num_computed) land in a block shared with another
        sample?"""
        table, i = self.block_tables.get(rid, ()), num_computed // self.block_size
        return (
            num_computed % self.block_size != 0 and i < len(table) and self.ref_counts[table[i]] > 1
        )

    def covers(self, rid: str, num_tokens: int, num_computed: int) -> bool:
        """Does `rid`'s table hold `num_tokens` tokens already, no copy-on-write due? (Most decode
        steps: the scheduler asks this first and then skips can_allocate and allocate.)"""
        table = self.block_tables.get(rid)  # none yet: allocate makes it, even for no tokens
        return (
            table is not None
            and len(table) * self.block_size >= num_tokens
            and not self.must_copy(rid, num_computed)
        )

    def num_blocks_needed(
        self, rid: str, num_tokens: int, computed_blocks: list[int] = (), num_computed: int = 0
    ) -> int:
        """Free blocks that `allocate` would consume to cover `num_tokens` tokens (with these
        prefix-cache hits, or for a request with `num_computed` tokens in the cache)."""
        have = len(self.block_tables.get(rid, ())) + len(computed_blocks)
        per_group = max(0, self.blocks_for(num_tokens) - have) + self.must_copy(rid, num_computed)
        new = per_group * len(self.windows)
        if not computed_blocks:
            return new
        hits = self._live(b for col in computed_blocks for b in self._columns(col))
        return new + sum(1 for b in hits if self.ref_counts[b] == 0)  # cached but free

    def _columns(self, hit) -> tuple:
        """A prefix hit's block in each group (find_cached_prefix)."""
        return hit if isinstance(hit, tuple) else (hit,)

    def _live(self, blocks) -> list[int]:
        return [b for b in blocks if b != self.null_block]

    def can_allocate(
        self, rid: str, num_tokens: int, computed_blocks: list[int] = (), num_computed: int = 0
    ) -> bool:
        return self.num_blocks_needed(rid, num_tokens, computed_blocks, num_computed) <= len(
            self.free_queue
        )

    def allocate(
        self,
        req: Request,
        num_tokens: int,
        computed_blocks: list[int] = (),
        offloaded: list[int] = (),
    ) -> None:
        """Grow `req`'s block table so it covers `num_tokens` tokens. `computed_blocks`
        (prefix-cache hits, only when the table is new) are shared instead of allocated, and the
        blocks in `offloaded` tier slots (find_offloaded) are loaded into fresh blocks after them.
        If the next write lands in a block shared with a sibling sample, that block is copied
        first."""
        rid = req.request_id
        if not self.can_allocate(
            rid, num_tokens, computed_blocks, req.num_computed_tokens
        ):  # refuse first
            raise RuntimeError(f"out of KV blocks for request {rid}: call can_allocate first")
        if self.must_copy(rid, req.num_computed_tokens):
            self.copy_on_write(rid, req.num_computed_tokens // self.block_size)
        tables = self.tables.get(rid)
        if tables is None:
            tables = self._new_tables(rid)
            self.num_hashed[rid] = len(computed_blocks)
        elif computed_blocks:
            raise ValueError("computed_blocks can only be shared into a new block table")
        for hit in computed_blocks:
            for table, block in zip(tables, self._columns(hit)):
                if block != self.null_block and self.ref_counts[block] == 0:
                    del self.free_queue[block]
                if block != self.null_block:
                    self.ref_counts[block] += 1
                table.append(block)
        self._load(req, tables[0], offloaded)
        for table in tables:
            while len(table) * self.block_size < num_tokens:
                table.append(self._take_free_block())

    def _new_tables(self, rid: str) -> list[list[int]]:
        tables = self.tables[rid] = [[] for _ in self.windows]
        self.block_tables[rid] = tables[0]
        return tables

    def remove_skipped(self, rid: str, num_computed: int) -> None:
        """Free the blocks of `rid`'s sliding-window groups that no query from position
        `num_computed` on can see (vLLM's remove_skipped_blocks): right to left, down to the first
        entry already null, each replaced by NULL_BLOCK; hashes are kept for later hits."""
        if not self.slides:
            return
        for window, table in zip(self.windows, self.tables.get(rid, ())):
            skipped = min(num_skipped_blocks(window, num_computed, self.block_size), len(table))
            for i in range(skipped - 1, -1, -1):
                if table[i] == self.null_block:
                    break
                self._release([table[i]])
                table[i] = self.null_block

    def _load(self, req: Request, table: list[int], slots: list[int]) -> None:
        """Fresh device blocks for the tier's hits, filled from their slots at the step's start and
        cached again under their hashes."""
        for slot in slots:
            self.tier.pin(slot)  # first: taking blocks below may store into the tier
        for slot in slots:
            i, block = len(table), self._take_free_block()
            table.append(block)
            self.tier.loading(slot, block)
            h = req.block_hashes[i]
            if h not in self.cached:
                self.cached[h] = block
                self.block_hash[block], self.block_key[block] = h, self._key(req, i)
        self.num_hashed[req.request_id] += len(slots)

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's copies to the CPU tier and from it: (offloads, loads)."""
        return ([], []) if self.tier is None else self.tier.take_transfers()

    def fork(self, parent_rid: str, child_rid: str) -> None:
        """The child shares every block of the parent (reference counts up, nothing copied)."""
        if child_rid in self.block_tables:
            raise ValueError(
                f"request {child_rid} already has a block table: a fork makes a new one"
            )
        for table, copy in zip(self.tables[parent_rid], self._new_tables(child_rid)):
            for block in self._live(table):
                self.ref_counts[block] += 1
            copy += table
        self.num_hashed[child_rid] = self.num_hashed[parent_rid]

    def copy_on_write(self, rid: str, i: int) -> None:
        """Give `rid` a private copy of its shared block i (the device copy goes to
        pending_copies)."""
        block = self.block_tables[rid][i]
        # refuse before changing anything
        if self.ref_counts[block] < 2 or len(self.free_queue) < len(self.windows):
            raise RuntimeError(f"block {block} of request {rid} is not shared, or no block is free")
        for table in self.tables[rid]:  # forked together, so shared in every group
            new = self._take_free_block()
            self.ref_counts[table[i]] -= 1  # still >= 1: a sibling keeps it
            self.pending_copies.append((table[i], new))
            table[i] = new

    def take_copies(self) -> list[tuple[int, int]]:
        """The copies decided since the last call, for this step's
        SchedulerOutput.blocks_to_copy."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def _release(self, table: list[int]) -> None:
        # Tail blocks are queued first so that the shared prefix blocks, released last, are
        # evicted last.
        for block in reversed(self._live(table)):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None

    def free(self, rid: str) -> None:
        """Drop everything a request holds: device blocks (hashes kept) and swapped CPU blocks."""
        self.block_tables.pop(rid, None)
        for table in self.tables.pop(rid, ()):
            self._drop_copies_into(table)  # a copy into a block given back is not needed
            self._release(table)
        self.num_hashed.pop(rid, None)
        self.swapped_nulls.pop(rid, None)
        self.cpu_free.extend(self.cpu_block_tables.pop(rid, ()))

    def free_tail(self, rid: str, num_tokens: int) -> None:
        """Give back the blocks past the first blocks_for(num_tokens) (none, unless a row verified
        drafts: then those that held only rejected drafts, never hashed since cache_full_blocks
        covers computed tokens only)."""
        for table in self.tables[rid]:
            self._release(table[self.blocks_for(num_tokens) :])
            del table[self.blocks_for(num_tokens) :]

    # ------------------------------------------------------------------ swap
    def can_swap_out(self, rid: str) -> bool:
        return self._num_live(rid) <= len(self.cpu_free)

    def _num_live(self, rid: str) -> int:
        return sum(len(self._live(t)) for t in self.tables.get(rid, ()))

    def swap_out(self, rid: str) -> list[tuple[int, int]]:
        """Move a request's blocks to CPU. Returns (device block, cpu block) copies, which the
        runner must perform before this step's forward pass reuses the device blocks."""
        if not self.can_swap_out(rid):  # refuse before changing anything
            raise ValueError(
                f"request {rid} needs {self._num_live(rid)} CPU blocks to swap "
                f"out, only {len(self.cpu_free)} are free: call can_swap_out first"
            )
        tables = self.tables.pop(rid)
        del self.block_tables[rid]
        self.num_hashed.pop(rid, None)
        # which entries a window had freed: they come back null (groups in order, flat on the CPU)
        self.swapped_nulls[rid] = [[b == self.null_block for b in t] for t in tables]
        table = [b for t in tables for b in self._live(t)]
        # A copy-on-write decided this step has not run yet (the runner swaps out first): such a
        # block is swapped out from its source, and the copy is dropped.
        source = self._drop_copies_into(table)
        cpu_table = [self.cpu_free.pop() for _ in table]
        self.cpu_block_tables[rid] = cpu_table
        self._release(table)  # back to the free queue, hashes kept
        return [(source.get(block, block), cpu) for block, cpu in zip(table, cpu_table)]

    def _drop_copies_into(self, table: list[int]) -> dict[int, int]:
        """Forget the pending copies into these blocks; returns {target: source}."""
        source = {dst: src for src, dst in self.pending_copies if dst in table}
        self.pending_copies = [(s, d) for s, d in self.pending_copies if d not in source]
        return source

    def can_swap_in(self, rid: str, num_tokens: int) -> bool:
        length = len(self.swapped_nulls[rid][0])  # every group's table has this length
        grow = max(0, self.blocks_for(num_tokens) - length) * len(self.windows)
        return len(self.cpu_block_tables[rid]) + grow <= len(self.free_queue)

    def swap_in(self, req: Request) -> list[tuple[int, int]]:
        """Bring a swapped request back into fresh device blocks. Returns (cpu, device) copies."""
        rid = req.request_id
        cpu_table = self.cpu_block_tables.pop(rid)
        tables = self._new_tables(rid)
        for table, nulls in zip(tables, self.swapped_nulls.pop(rid)):
            table += [self.null_block if null else self._take_free_block() for null in nulls]
        self.cpu_free.extend(cpu_table)
        table = [b for t in tables for b in self._live(t)]
        self.num_hashed[rid] = 0
        self.cache_full_blocks(req)  # its full blocks are valid prefix blocks again
        return list(zip(cpu_table, table))

    # ------------------------------------------------------------------ checks and display
    def check_invariants(self) -> None:
        """Raise AssertionError if the books do not balance (used by the property tests)."""
        owners, group_of = [0] * self.num_blocks, {}
        for rid, tables in self.tables.items():
            assert self.block_tables[rid] is tables[0], "group 0's table is not block_tables'"
            assert len({len(t) for t in tables}) == 1, "a request's groups differ in length"
            for g, (window, table) in enumerate(zip(self.windows, tables)):
                live = self._live(table)
                assert len(set(live)) == len(live), "a block appears twice in one table"
                # a window frees from the left: its nulls lead; full attention holds no null
                assert table[len(table) - len(live) :] == live and (
                    window or len(live) == len(table)
                )
                for b in live:
                    owners[b] += 1
                    assert group_of.setdefault(b, g) == g, "a block is in two groups at once"
        assert self.tables.keys() == self.block_tables.keys(), "tables and block_tables differ"
        assert owners == self.ref_counts, (
            "reference counts differ from the tables holding each block"
        )
        free = set(self.free_queue)
        assert free == {b for b in range(self.num_blocks) if owners[b] == 0}, (
            "free queue != unowned blocks"
        )
        for h, b in self.cached.items():
            assert self.block_hash[b] == h, "cached map and block hashes disagree"
            g = h[0] if isinstance(h, tuple) else 0
            assert group_of.get(b, g) == g, "a cached block is held by another group"
        cpu_owned = [b for t in self.cpu_block_tables.values() for b in t]
        assert len(cpu_owned) == len(set(cpu_owned)), "a CPU block is owned twice"
        assert sorted(cpu_owned + self.cpu_free) == list(range(self.num_cpu_blocks)), (
            "CPU blocks leaked"
        )
        if self.tier is not None:
            self.tier.check_invariants()

    def __repr__(self):
        tables = ", ".join(f"{rid}: {t}" for rid, t in self.block_tables.items())
        return (
            f"BlockManager(blocks={self.num_blocks} x {self.block_size} tokens, "
            f"used={self.num_used_blocks}, free={self.num_free_blocks} (cached "
            f"{self.num_cached_free_blocks}), "
            f"cpu_free={self.num_free_cpu_blocks}/{self.num_cpu_blocks}, tables={{{tables}}})"
        )
