"""A fleet without a model: N replicas of the engine behind a router, on a multi-turn workload.

Each replica is the REAL Scheduler and BlockManager, stepped by the scripted model of `sim`
(`scripted_step`), with prefix caching on (EngineConfig.enable_prefix_caching), so every number
here is what the engine's own scheduler does: which prompt tokens its cache already holds, when a
request gets its first token. The replicas step in lockstep, one step per tick; a request that
arrives in tick t is routed in tick t by a router (engine/router.py, the server's own policies)
that sees every replica's queues as they are then.

The workload is a closed loop of conversations sharing one system prompt (`multi_turn_workload`):
turn k + 1's prompt is turn k's prompt, then the tokens turn k generated, then a new user message,
and it arrives `think_steps` after turn k has finished. Turns are released as they finish, so a
slow replica slows its conversations down, as real users wait for an answer before they reply. The
next turn holds exactly the tokens the previous one produced (read from the finished request), so
a replica that served turn k may find all of it in its cache; another replica recomputes it.

What is measured (FleetResult): the prefix hit rate, cached prompt tokens / prompt tokens, where a
request's cached tokens are those its scheduler found in the prefix cache when it first admitted it
(its first row starts there); per replica, the requests routed there and the prompt tokens it
computed (prompt minus cached), each with its imbalance max / mean (1.0 is perfectly even); and
TTFT in steps, from arrival to first token counting both ends, p50 and p99. Steps are not priced:
a cache hit shortens TTFT here only where it saves a queue or a step's token budget (a long prompt
prefilled over two steps), not by the compute it saves; pool.StepCost would price it. No torch.
"""

import heapq
import random
from dataclasses import dataclass

from ..config import EngineConfig
from ..core.request import Request
from ..core.scheduler import Scheduler
from ..engine.router import DEFAULT_BALANCE_THRESHOLD, ReplicaLoad, Router, make_router
from ..metrics import percentile
from ..sampling_params import SamplingParams
from ..sim import SIM_NUM_BLOCKS, scripted_step
from ..trace import Trace

VOCAB = 32_000  # token ids of system prompts and user messages are drawn below this


@dataclass(frozen=True)
class Turn:
    user_token_ids: tuple[int, ...]  # the new user message
    output_len: int  # tokens the model answers with (the scripted model, as with ignore_eos)


@dataclass(frozen=True)
class Conversation:
    start_step: int  # the first turn's arrival step (0 and 1: from the start)
    system_prompt_token_ids: tuple[int, ...]  # the first turn's prompt begins with it
    turns: tuple[Turn, ...]
    think_steps: int  # steps from one turn's finish to the next turn's arrival (at least 1)


def multi_turn_workload(
    num_conversations: int,
    turns: int,
    system_prompt_len: int,
    user_len: int,
    output_len: int,
    think_steps: int,
    seed: int = 0,
    arrival_window: int | None = None,
    length_spread: float = 0.5,
) -> list[Conversation]:
    """Conversations sharing one system prompt, `turns` turns each. Each starts at a step drawn
    uniformly from 1..arrival_window (default: num_conversations, about one new conversation a
    step); each user message and answer is between (1 - length_spread) and (1 + length_spread)
    times user_len and output_len tokens, drawn with `seed`."""
    sizes = {"num_conversations": num_conversations, "turns": turns, "user_len": user_len}
    sizes |= {"output_len": output_len, "think_steps": think_steps}
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if system_prompt_len < 0:
        raise ValueError(f"system_prompt_len must be >= 0, got {system_prompt_len}")
    if not 0 <= length_spread < 1:
        raise ValueError(f"length_spread must be in [0, 1), got {length_spread}")
    rng = random.Random(seed)
    window = arrival_window or num_conversations

    def length(mean: int) -> int:
        lo = max(1, round(mean * (1 - length_spread)))
        return rng.randint(lo, max(lo, round(mean * (1 + length_spread))))

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(2, VOCAB) for _ in range(n))  # 1 is the scripted model's

    system = tokens(system_prompt_len)
    starts = sorted(rng.randint(1, window) for _ in range(num_conversations))
    return [
        Conversation(
            start,
            system,
            tuple(Turn(tokens(length(user_len)), length(output_len)) for _ in range(turns)),
            think_steps,
        )
        for start in starts
    ]


@dataclass
class FleetRequestResult:
    request_id: str  # "c<conversation>t<turn>"
    conversation: int
    turn: int
    replica: int
    arrival_step: int
    prompt_len: int
    num_cached_tokens: int  # prompt tokens its replica's prefix cache held when it was admitted
    output_len: int
    first_token_step: int
    finish_step: int

    @property
    def ttft_steps(self) -> int:
        """Steps from arrival to first token, counting both ends (as SimRequestResult)."""
        return self.first_token_step - self.arrival_step + 1


@dataclass
class FleetResult:
    requests: list[FleetRequestResult]  # in arrival order
    num_steps: int
    num_replicas: int
    routing_policy: str
    traces: list[Trace]  # one per replica
    router: Router  # as the run left it (what cache_aware remembers, how it decided)

    @property
    def prefix_hit_rate(self) -> float:
        """Cached prompt tokens / prompt tokens, over every request of the fleet."""
        cached = sum(r.num_cached_tokens for r in self.requests)
        return cached / sum(r.prompt_len for r in self.requests)

    @property
    def requests_per_replica(self) -> list[int]:
        return [sum(1 for r in self.requests if r.replica == i) for i in range(self.num_replicas)]

    @property
    def computed_prompt_tokens_per_replica(self) -> list[int]:
        """Prompt tokens each replica computed: its requests' prompts less their cache hits."""
        computed = [0] * self.num_replicas
        for r in self.requests:
            computed[r.replica] += r.prompt_len - r.num_cached_tokens
        return computed

    @property
    def request_imbalance(self) -> float:
        """max / mean of the requests routed per replica (1.0: perfectly even)."""
        return _max_over_mean(self.requests_per_replica)

    @property
    def token_imbalance(self) -> float:
        """max / mean of the prompt tokens computed per replica."""
        return _max_over_mean(self.computed_prompt_tokens_per_replica)

    @property
    def mean_load_gap(self) -> float:
        """The gap least_loaded closes, averaged over the steps: max - min of the replicas' load
        scores (ReplicaLoad.score) after each step."""
        gaps = []
        for records in zip(*(t.steps for t in self.traces)):
            scores = [
                ReplicaLoad(r.num_running, r.num_waiting + r.num_swapped).score for r in records
            ]
            gaps.append(max(scores) - min(scores))
        return sum(gaps) / len(gaps)

    def ttft_percentile(self, q: float) -> float:
        return percentile([r.ttft_steps for r in self.requests], q)

    @property
    def ttft_p50(self) -> float:
        return self.ttft_percentile(50)

    @property
    def ttft_p99(self) -> float:
        return self.ttft_percentile(99)

    def __repr__(self):
        return (
            f"FleetResult({self.routing_policy}, replicas={self.num_replicas}, "
            f"requests={len(self.requests)}, steps={self.num_steps}, "
            f"hit_rate={self.prefix_hit_rate:.3f}, requests/replica={self.requests_per_replica} "
            f"(max/mean {self.request_imbalance:.2f}), computed prompt tokens/replica="
            f"{self.computed_prompt_tokens_per_replica} (max/mean {self.token_imbalance:.2f}), "
            f"TTFT p50={self.ttft_p50:.1f} p99={self.ttft_p99:.1f} steps)"
        )


def _max_over_mean(values: list[int]) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean else 1.0


def simulate_fleet(
    conversations: list[Conversation],
    num_replicas: int = 4,
    routing_policy: str = "cache_aware",
    config: EngineConfig | None = None,
    balance_threshold: int = DEFAULT_BALANCE_THRESHOLD,
    router: Router | None = None,
    max_steps: int = 100_000,
) -> FleetResult:
    """Serve `conversations` with `num_replicas` replicas, each a real Scheduler built from
    `config` (prefix caching as the config says: on by default), routed by `routing_policy` (or by
    `router`, when given, e.g. a cache-aware router with another capacity). The cache-aware router
    remembers at most num_blocks blocks per replica, what one replica's cache can hold."""
    config = config or EngineConfig()
    if config.num_blocks is None:
        config = config.replace(num_blocks=SIM_NUM_BLOCKS)
    router = router or make_router(
        routing_policy,
        num_replicas,
        config.block_size,
        balance_threshold,
        capacity_blocks=config.num_blocks,
    )
    if router.num_replicas != num_replicas:
        raise ValueError(f"the router has {router.num_replicas} replicas, the fleet {num_replicas}")
    scheds = [Scheduler(config) for _ in range(num_replicas)]
    traces = [Trace(config.max_num_seqs, config.num_blocks, config.block_size) for _ in scheds]
    cached: dict[str, int] = {}  # request id -> prompt tokens found cached at first admission

    def count_cached(sched, out):  # after schedule(): an admitted row starts past its cache hits
        for row in out.scheduled:
            rid = row.request.request_id
            if rid in out.admitted and rid not in cached:
                cached[rid] = row.start

    # (arrival step, release order, conversation, turn, prompt): the turns released so far
    arrivals: list[tuple[int, int, int, int, list[int]]] = []
    for c, conv in enumerate(conversations):
        if conv.think_steps < 1:
            raise ValueError(f"conversation {c}: think_steps must be at least 1")
        first = list(conv.system_prompt_token_ids) + list(conv.turns[0].user_token_ids)
        heapq.heappush(arrivals, (max(conv.start_step, 1), c, c, 0, first))
    released = len(conversations)
    placed: dict[str, tuple[int, int, int, int]] = {}  # id -> conversation, turn, replica, arrival
    results = []
    step = 0
    while arrivals or any(s.has_unfinished_requests() for s in scheds):
        step += 1
        if step > max_steps:
            raise RuntimeError(f"the fleet did not finish within max_steps={max_steps}")
        while arrivals and arrivals[0][0] <= step:
            _, _, c, k, prompt = heapq.heappop(arrivals)
            loads = [ReplicaLoad(len(s.running), len(s.waiting) + len(s.swapped)) for s in scheds]
            replica = router.route(prompt, loads)
            rid = f"c{c}t{k}"
            params = SamplingParams(
                max_tokens=conversations[c].turns[k].output_len, temperature=0.0, ignore_eos=True
            )
            scheds[replica].add_request(Request(rid, prompt, params, arrival_index=len(placed)))
            placed[rid] = (c, k, replica, step)
        for replica, sched in enumerate(scheds):
            out = scripted_step(sched, count_cached)
            finished = sched.take_finished()
            traces[replica].record(sched, out, finished)
            for req in finished:
                c, k, _, arrival = placed[req.request_id]
                results.append(_result(req, c, k, replica, arrival, cached[req.request_id]))
                conv = conversations[c]
                if k + 1 < len(conv.turns):
                    # the next turn: this prompt, what the model answered, the user's reply
                    nxt = req.token_ids + list(conv.turns[k + 1].user_token_ids)
                    arrive = req.finish_step + conv.think_steps
                    heapq.heappush(arrivals, (arrive, released, c, k + 1, nxt))
                    released += 1
    order = {rid: i for i, rid in enumerate(placed)}
    results.sort(key=lambda r: order[r.request_id])
    return FleetResult(results, step, num_replicas, router.policy, traces, router)


def _result(req: Request, c: int, k: int, replica: int, arrival: int, num_cached: int):
    return FleetRequestResult(
        req.request_id,
        c,
        k,
        replica,
        arrival,
        req.num_prompt_tokens,
        num_cached,
        req.num_output_tokens,
        req.first_token_step,
        req.finish_step,
    )
