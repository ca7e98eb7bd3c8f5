"""Routing: which data-parallel replica serves a new request.

A fleet runs N replicas of the model, each with its own scheduler and KV cache (vLLM's
`--data-parallel-size`). Every request goes to exactly one of them and stays there, so the router
decides two things at once: how evenly the replicas are loaded, and whether a prompt meets the
prefix it shares with earlier requests in the cache of the replica that computed it. The server
(serve/) and the simulator (reference/fleet.py) use the same policies, from this file.

A replica's load is `ReplicaLoad(num_running, num_waiting)`, its scheduler's two queue lengths, and
its `score` is vLLM V1's data-parallel load balancer's (`DPLBAsyncMPClient` in
vllm/v1/engine/core_client.py, at commit 364631a): `4 * num_waiting + num_running`. A waiting
request weighs four running ones: it has no slot yet, so it will wait for its first token, while a
running one only shares the batch. (Later vLLM versions score max(in-flight, waiting + running)
plus a waiting penalty that grows with KV-cache usage.)

The policies (ROUTING_POLICIES):

- `round_robin`: replica 0, 1, 2, ... in turn. Optimizes nothing and needs nothing: even request
  counts when requests are alike. Fails twice: it is blind to load (a replica given the long
  prompts falls behind and keeps receiving its share), and it scatters a conversation's turns
  over the replicas, so every replica recomputes the same system prompt and history.
- `least_loaded`: the lowest score, ties to the lowest index (vLLM V1's DP load balancer, without
  its rotating start). Optimizes queueing: a new request goes where it waits least. Fails where
  load is not the whole story: it is as blind to the prefix cache as round robin, and it counts
  requests, not tokens (a 4,000-token prompt weighs what a 10-token one does).
- `cache_aware`: in the spirit of SGLang's router (sgl-router, src/policies/cache_aware.rs). The
  router remembers, per replica, the block hashes of the prompts it recently routed there (full
  blocks of `block_size` tokens, chained as the prefix cache chains them: the hash of block i
  names the whole prefix up to it), at most `capacity_blocks` per replica, least recently used
  first out. A prompt's expected hit on a replica is the number of its leading blocks found there.
  The longest expected hit wins (ties: the least loaded of them), unless the load gap (the highest
  score minus the lowest, over the live replicas) passes `balance_threshold`: then, and when no
  replica expects a hit, the least loaded wins. Either way the prompt's blocks are remembered for
  the chosen replica. Optimizes prefill work and time to first token: a conversation's next turn
  goes where its history is cached. Fails where its picture of the caches is wrong: it guesses
  (a replica may have evicted what the router remembers; it never sees generated tokens, so it
  underestimates a turn that follows an answer), and a hot prefix pulls load onto one replica
  until the threshold cuts in; a threshold too high piles up queues, too low gives up hits.

SGLang's router keeps an approximate radix tree of request text per worker (LRU-evicted to a
maximum size), and when balanced routes to the longest match if its match rate passes
`cache_threshold` (else to the worker with the smallest tree); it switches to the shortest queue
when the loads are imbalanced, both `max - min > balance_abs_threshold` and
`max > balance_rel_threshold * min`. minicb keeps block hashes instead of text (what the prefix
cache really reuses), one absolute threshold, and no match-rate threshold (any hit counts; ties
between equal hits go by load). The production routers that score cache and load together are
llm-d's inference scheduler (weighted scorers: prefix-cache hits, queue depth, KV-cache usage) and
NVIDIA Dynamo's KV router (cost = weighted blocks still to prefill + active decode blocks); both can
learn each replica's cached blocks from the engines' KV events instead of guessing them.
"""

from collections import OrderedDict
from dataclasses import dataclass

from ..core.block_manager import hash_chain

ROUTING_POLICIES = ("round_robin", "least_loaded", "cache_aware")
# vLLM V1's DP load balancer: a waiting request weighs four running ones
WAITING_WEIGHT = 4
# cache_aware: a load gap (in score points) past which a request goes to the least loaded replica
# whatever its expected hit: 8 = two more queued requests on the busiest replica than the idlest. On
# the simulator's multi-turn workload (tests/test_fleet_sim.py) 4-8 keep the hit rate at its best
# with even loads; from 16 up the shared system prompt piles new conversations onto the replica that
# saw it first, and 0 is least loaded's hit rate. SGLang's router counts 64 in-flight requests.
DEFAULT_BALANCE_THRESHOLD = 8
# cache_aware: block hashes remembered per replica; about what a replica's KV cache holds (the
# simulator's 4096 blocks), and a server should pass its replicas' num_blocks
DEFAULT_CAPACITY_BLOCKS = 4096


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica's queues, as its scheduler counts them (swapped requests count as waiting)."""

    num_running: int
    num_waiting: int

    @property
    def score(self) -> int:
        """vLLM V1's DP load-balancer score: lower is less loaded."""
        return WAITING_WEIGHT * self.num_waiting + self.num_running


class Router:
    """Chooses a live replica for each request; subclasses say how (`_choose`)."""

    policy = ""  # the policy's name, one of ROUTING_POLICIES

    def __init__(self, num_replicas: int):
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
        self.num_replicas = num_replicas
        self.dead: set[int] = set()

    @property
    def live_replicas(self) -> list[int]:
        return [i for i in range(self.num_replicas) if i not in self.dead]

    def route(self, prompt_token_ids: list[int], loads: list[ReplicaLoad]) -> int:
        """The replica (an index) that serves this prompt, given every replica's load now."""
        if len(loads) != self.num_replicas:
            raise ValueError(f"got {len(loads)} loads for {self.num_replicas} replicas")
        live = self.live_replicas
        if not live:
            raise RuntimeError(
                f"all {self.num_replicas} replicas are dead (forgotten): nowhere to route"
            )
        return self._choose(prompt_token_ids, loads, live)

    def forget(self, replica: int) -> None:
        """A replica died: route nothing more to it."""
        if not 0 <= replica < self.num_replicas:
            raise ValueError(f"replica {replica} is out of range: there are {self.num_replicas}")
        self.dead.add(replica)

    def _choose(
        self, prompt_token_ids: list[int], loads: list[ReplicaLoad], live: list[int]
    ) -> int:
        raise NotImplementedError

    def __repr__(self):
        return f"{type(self).__name__}(replicas={self.num_replicas}, live={self.live_replicas})"


def least_loaded(loads: list[ReplicaLoad], candidates: list[int]) -> int:
    """The candidate with the lowest score, ties to the lowest index."""
    return min(candidates, key=lambda i: (loads[i].score, i))


class RoundRobinRouter(Router):
    policy = "round_robin"

    def __init__(self, num_replicas: int):
        super().__init__(num_replicas)
        self.next_replica = (
            0  # where the turn is; a dead replica's turn passes to the next live one
        )

    def _choose(self, prompt_token_ids, loads, live):
        chosen = next((i for i in live if i >= self.next_replica), live[0])
        self.next_replica = (chosen + 1) % self.num_replicas
        return chosen


class LeastLoadedRouter(Router):
    policy = "least_loaded"

    def _choose(self, prompt_token_ids, loads, live):
        return least_loaded(loads, live)


class CacheAwareRouter(Router):
    policy = "cache_aware"

    def __init__(
        self,
        num_replicas: int,
        block_size: int = 16,
        balance_threshold: int = DEFAULT_BALANCE_THRESHOLD,
        capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS,
    ):
        super().__init__(num_replicas)
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if balance_threshold < 0:
            raise ValueError(f"balance_threshold must be >= 0, got {balance_threshold}")
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be at least 1, got {capacity_blocks}")
        self.block_size = block_size
        self.balance_threshold = balance_threshold
        self.capacity_blocks = capacity_blocks
        # per replica: the block hashes routed there, least recently used first
        self.remembered: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]
        self.num_routed = 0
        self.num_balanced = 0  # routed by load because the load gap passed the threshold

    def block_hashes(self, prompt_token_ids: list[int]) -> list[int]:
        """The hash chain of the prompt's full blocks, as the prefix cache computes it."""
        num_full = len(prompt_token_ids) // self.block_size
        return hash_chain([], prompt_token_ids, self.block_size, num_full)

    def expected_hits(self, prompt_token_ids: list[int]) -> list[int]:
        """Per replica, the prompt's leading blocks the router believes are cached there."""
        hashes = self.block_hashes(prompt_token_ids)
        return [self._leading_blocks_found(r, hashes) for r in range(self.num_replicas)]

    def _leading_blocks_found(self, replica: int, hashes: list[int]) -> int:
        seen = self.remembered[replica]
        found = 0
        while found < len(hashes) and hashes[found] in seen:
            found += 1
        return found

    def _choose(self, prompt_token_ids, loads, live):
        hashes = self.block_hashes(prompt_token_ids)
        scores = [loads[i].score for i in live]
        is_imbalanced = max(scores) - min(scores) > self.balance_threshold
        hits = {i: self._leading_blocks_found(i, hashes) for i in live}
        best_hit = max(hits.values())
        self.num_routed += 1
        self.num_balanced += is_imbalanced
        if is_imbalanced or best_hit == 0:
            chosen = least_loaded(loads, live)
        else:
            chosen = least_loaded(loads, [i for i in live if hits[i] == best_hit])
        self._remember(chosen, hashes)
        return chosen

    def remember(self, replica: int, prompt_token_ids: list[int]) -> None:
        """The prompt went to `replica` after all (the one chosen was full): remember it there."""
        self._remember(replica, self.block_hashes(prompt_token_ids))

    def _remember(self, replica: int, hashes: list[int]) -> None:
        seen = self.remembered[replica]
        # Deepest block first, so the prompt's first block is the most recent: eviction then takes
        # a chain from its tail, as the prefix cache frees a request's blocks (a chain whose head
        # was evicted could never be found again).
        for h in reversed(hashes):
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity_blocks:
            seen.popitem(last=False)

    def forget(self, replica: int) -> None:
        super().forget(replica)
        self.remembered[replica].clear()

    def __repr__(self):
        sizes = [len(s) for s in self.remembered]
        return (
            f"CacheAwareRouter(replicas={self.num_replicas}, live={self.live_replicas}, "
            f"remembered_blocks={sizes}, balance_threshold={self.balance_threshold}, "
            f"capacity_blocks={self.capacity_blocks}, "
            f"balanced={self.num_balanced}/{self.num_routed})"
        )


def make_router(
    policy: str,
    num_replicas: int,
    block_size: int = 16,
    balance_threshold: int = DEFAULT_BALANCE_THRESHOLD,
    capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS,
) -> Router:
    """A router for `policy` (one of ROUTING_POLICIES) over `num_replicas` replicas. `block_size`,
    `balance_threshold` and `capacity_blocks` matter to cache_aware only."""
    if policy == "round_robin":
        return RoundRobinRouter(num_replicas)
    if policy == "least_loaded":
        return LeastLoadedRouter(num_replicas)
    if policy == "cache_aware":
        return CacheAwareRouter(num_replicas, block_size, balance_threshold, capacity_blocks)
    raise ValueError(
        f"routing policy {policy!r} is unknown: choose one of {', '.join(ROUTING_POLICIES)}"
    )
