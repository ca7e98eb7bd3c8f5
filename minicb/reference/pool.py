"""One pool of the engine on a clock: the real Scheduler, the scripted model of `sim`, and a step
that costs t_step = a + b * tokens seconds (notebook 05 fits the line to measured steps).

Capacity planning (capacity.py) serves a whole workload with one pool; a disaggregated setup
(disaggregated.py) runs a prefill pool and a decode pool, each with this same loop. No torch.
"""

from dataclasses import dataclass

from ..config import EngineConfig
from ..core.request import Request
from ..core.scheduler import Scheduler
from ..sim import SIM_NUM_BLOCKS, scripted_step


@dataclass(frozen=True)
class StepCost:
    """t_step = a + b * tokens (notebook 05 fits it to measured steps; these defaults are
    illustrative)."""

    # seconds every step pays whatever it carries: reading all weights once, launches
    a: float = 0.015
    b: float = 5e-5  # seconds per token in the step: the matmuls grow with the tokens they multiply

    def __post_init__(self):
        if not (self.a > 0 and self.b >= 0):
            raise ValueError(
                f"a step needs a > 0 and b >= 0 seconds, got a={self.a!r}, b={self.b!r}"
            )

    def seconds(self, num_tokens: int) -> float:
        return self.a + self.b * num_tokens


@dataclass
class PoolRun:
    """One pool's timeline: every request's token steps as clock times, and the pool's steps."""

    first_token: dict[str, float]
    finish: dict[str, float]
    step_ends: list[float]
    step_blocks: list[int]
    preemptions: dict[str, int]
    blocks_held_at_end: (
        int  # blocks still allocated when every request has finished: 0 unless a leak
    )
    tokens_computed: (
        int  # tokens priced over the run (loaded KV is not, unless a preemption dropped it)
    )


def run_pool(
    entries: list[tuple[float, Request]],
    config: EngineConfig,
    cost: StepCost,
    loaded: dict[str, int],
) -> PoolRun:
    """Serve (time, request) pairs with a real Scheduler and the scripted model. `loaded`: request
    id -> prompt positions whose KV arrives from elsewhere (priced as no compute); others cost every
    token. A request preempted by recompute has lost that KV: its recomputation is priced like any
    prefill."""
    if config.num_blocks is None:
        config = config.replace(num_blocks=SIM_NUM_BLOCKS)
    entries = sorted(entries, key=lambda e: e[0])
    sched = Scheduler(config)
    ends, blocks = [], []

    def held(s, out):  # after schedule(): this step's blocks are allocated, none freed yet
        blocks.append(s.block_manager.num_blocks - s.block_manager.num_free_blocks)

    clock, nxt, total = 0.0, 0, 0
    while nxt < len(entries) or sched.has_unfinished_requests():
        if not sched.has_unfinished_requests():
            clock = max(clock, entries[nxt][0])  # idle until the next request arrives
        while nxt < len(entries) and entries[nxt][0] <= clock:
            sched.add_request(entries[nxt][1])
            nxt += 1
        out = scripted_step(sched, held)
        sched.take_finished()
        computed = sum(
            max(
                0,
                r.start
                + r.num_tokens
                - max(
                    r.start, 0 if r.request.num_preemptions else loaded.get(r.request.request_id, 0)
                ),
            )
            for r in out.scheduled
        )
        clock, total = clock + cost.seconds(computed), total + computed
        ends.append(clock)
    reqs = [r for _, r in entries]
    return PoolRun(
        {r.request_id: ends[r.first_token_step - 1] for r in reqs},
        {r.request_id: ends[r.finish_step - 1] for r in reqs},
        ends,
        blocks,
        {r.request_id: r.num_preemptions for r in reqs},
        sched.block_manager.num_blocks - sched.block_manager.num_free_blocks,
        total,
    )
