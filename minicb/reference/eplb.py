"""Expert-parallel load balancing: which experts each rank holds, and how many copies of the hot
ones to keep, chosen from the routing the engine recorded.

With expert parallelism (worker/expert_parallel.py) a step waits for its most loaded rank: every
rank runs its own experts' tokens, and the all-to-all that brings the results back completes when
the slowest rank is done. minicb places the experts contiguously, E / N per rank, which is even only
if the router is. A router is not: some experts are popular, and which ones moves with the workload.

DeepSeek-V3 (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, section 3.4) serves its 256 routed
experts with **redundant experts**: a few more physical expert slots than logical experts, so that
the hottest experts, judged from statistics of recent traffic, get a second copy, and the copies are
then packed onto the GPUs so that every GPU's load is about the same. DeepSeek published that
balancer as EPLB, and vLLM runs one of its own in the same spirit (`--enable-eplb`, with
`num_redundant_experts` extra slots, rearranging the experts every so many steps from the load it
recorded). This file is the idea in its simplest, global form, written for notebook 20:

  contiguous_placement  what minicb does: rank r holds experts r * E / N up to (r + 1) * E / N
  replicate             with num_slots >= E slots, each extra slot goes to the expert with the
                        highest load per copy (its load divided by the copies it already has)
  pack                  the copies onto N ranks of num_slots / N slots each, heaviest copy first,
                        each onto the least loaded rank that has a free slot (and no copy of the
                        same expert, while another rank has room)
  rank_loads            a placement's load per rank: an expert's tokens split evenly among its
                        copies
  imbalance             max / mean of the ranks' loads: how much longer a step takes than it would
                        if the work were spread evenly

DeepSeek's EPLB also has a hierarchical policy (expert groups to nodes first, to keep traffic inside
a node), which this file leaves out. Loads are whole tokens; everything derived from them is a
Fraction, so a notebook can assert exact numbers. No torch: lists of numbers in, lists out.
"""

from dataclasses import dataclass
from fractions import Fraction


@dataclass(frozen=True)
class Placement:
    """Physical expert slots, rank by rank: slots[r] lists the logical expert in each of rank r's
    slots. An expert in several slots has that many copies (vLLM calls the slots "physical experts"
    and the experts of the model "logical experts")."""

    slots: tuple[tuple[int, ...], ...]  # (num_ranks, slots per rank): a logical expert id each

    def __post_init__(self):
        sizes = {len(rank) for rank in self.slots}
        if len(sizes) != 1:
            raise ValueError(f"every rank needs the same number of slots, got {sorted(sizes)}")

    @property
    def num_ranks(self) -> int:
        return len(self.slots)

    @property
    def num_slots(self) -> int:
        return sum(len(rank) for rank in self.slots)

    @property
    def num_experts(self) -> int:
        return max(e for rank in self.slots for e in rank) + 1

    def copies(self) -> list[int]:
        """How many slots hold each logical expert (vLLM's logcnt)."""
        counts = [0] * self.num_experts
        for rank in self.slots:
            for e in rank:
                counts[e] += 1
        return counts

    def ranks_of(self, expert: int) -> list[int]:
        """The ranks that hold a copy of `expert`, once per copy."""
        return [r for r, rank in enumerate(self.slots) for e in rank if e == expert]

    def __repr__(self):
        ranks = "; ".join(f"rank {r}: {list(rank)}" for r, rank in enumerate(self.slots))
        extra = self.num_slots - self.num_experts
        return (
            f"Placement({self.num_experts} experts in {self.num_slots} slots on {self.num_ranks} "
            f"ranks, {extra} redundant | {ranks})"
        )


def contiguous_placement(num_experts: int, num_ranks: int) -> Placement:
    """minicb's expert parallelism (and vLLM's default): rank r holds E / N consecutive experts."""
    if num_experts % num_ranks:
        raise ValueError(f"{num_ranks} ranks must divide num_experts={num_experts}")
    per_rank = num_experts // num_ranks
    return Placement(
        tuple(tuple(range(r * per_rank, (r + 1) * per_rank)) for r in range(num_ranks))
    )


def replicate(load: list[int], num_slots: int) -> list[int]:
    """Copies of each expert for num_slots slots: one each, then every extra slot to the expert
    whose load per copy is the highest (ties: the lowest expert id). So the heaviest copy is as
    light as num_slots slots can make it."""
    if num_slots < len(load):
        raise ValueError(f"num_slots={num_slots} is fewer than the {len(load)} experts")
    copies = [1] * len(load)
    for _ in range(num_slots - len(load)):
        hottest = max(range(len(load)), key=lambda e: (Fraction(load[e], copies[e]), -e))
        copies[hottest] += 1
    return copies


def pack(load: list[int], copies: list[int], num_ranks: int) -> Placement:
    """Put every copy in a slot, num_slots / N slots per rank: the copies sorted by their load
    (an expert's load over its copies), heaviest first (ties: the lowest expert id), each onto the
    least loaded rank with a free slot (ties: the lowest rank). A rank that holds a copy of the
    same expert is passed over while another has room: two copies on one rank split nothing."""
    num_slots = sum(copies)
    if num_slots % num_ranks:
        raise ValueError(f"{num_ranks} ranks must divide the {num_slots} slots")
    per_rank = num_slots // num_ranks
    per_copy = [Fraction(load[e], copies[e]) for e in range(len(load))]
    pending = sorted(
        (e for e in range(len(load)) for _ in range(copies[e])), key=lambda e: (-per_copy[e], e)
    )
    slots: list[list[int]] = [[] for _ in range(num_ranks)]
    rank_load = [Fraction(0)] * num_ranks
    for e in pending:
        has_room = [r for r in range(num_ranks) if len(slots[r]) < per_rank]
        without_e = [r for r in has_room if e not in slots[r]]
        rank = min(without_e or has_room, key=lambda r: (rank_load[r], r))
        slots[rank].append(e)
        rank_load[rank] += per_copy[e]
    return Placement(tuple(tuple(rank) for rank in slots))


def rebalance(load: list[int], num_slots: int, num_ranks: int) -> Placement:
    """EPLB's two steps: replicate the hot experts into num_slots slots, then pack the copies."""
    return pack(load, replicate(load, num_slots), num_ranks)


def rank_loads(placement: Placement, load: list[int]) -> list[Fraction]:
    """Tokens each rank computes when expert e's load[e] tokens are split evenly among its
    copies."""
    if len(load) < placement.num_experts:
        raise ValueError(
            f"the placement holds {placement.num_experts} experts, the load names {len(load)}"
        )
    copies = placement.copies()
    return [
        sum((Fraction(load[e], copies[e]) for e in rank), Fraction(0)) for rank in placement.slots
    ]


def imbalance(loads: list[Fraction] | list[int]) -> Fraction:
    """max / mean over the ranks (1 when every rank has the same work; 1 for a step with none)."""
    total = sum(loads)
    if total == 0:
        return Fraction(1)
    return Fraction(max(loads)) * len(loads) / total
