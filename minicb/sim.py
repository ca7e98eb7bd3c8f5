"""Model-free simulation: the real Scheduler and BlockManager driven by a scripted model.

The scripted model "generates" exactly `output_len` tokens per request, one per step once the
prompt is done, so every number here (steps, slot occupancy, block usage, preemptions) is the
number the real engine would produce for the same lengths. Time is measured in steps.
"""

from dataclasses import dataclass

from .config import EngineConfig
from .core.request import Request
from .core.scheduler import Scheduler, SchedulerOutput
from .sampling_params import SamplingParams
from .trace import Trace

SIM_NUM_BLOCKS = 4096  # used when the config leaves num_blocks to the engine: memory is ample


@dataclass
class SimRequest:
    prompt_len: int
    output_len: int
    arrival_step: int = 0  # the first step in which it may be scheduled (0 and 1: from the start)
    # with scheduling_policy="priority": the lowest value is served first (vLLM's rule)
    priority: int = 0
    prompt_token_ids: list[int] | None = None  # give two requests the same prefix to share blocks
    request_id: str | None = None  # default: its index in the input list
    # samples of one prompt: they fork after its prefill and share its blocks (copy-on-write)
    n: int = 1
    # the tenant (OpenAI's `user`): scheduling_policy="vtc" serves tenants fairly, others ignore it
    user: str | None = None


@dataclass
class SimRequestResult:
    request_id: str
    prompt_len: int
    output_len: int
    arrival_step: int
    admitted_step: int | None
    first_token_step: int | None
    finish_step: int | None
    num_preemptions: int
    user: str | None = None
    # prompt tokens found in the prefix cache when it was admitted (vLLM's RequestOutput field)
    num_cached_tokens: int = 0

    @property
    def ttft_steps(self) -> int:
        """Steps from arrival to first token, counting both ends (first token in its arrival step:
        1)."""
        return self.first_token_step - max(self.arrival_step, 1) + 1

    @property
    def latency_steps(self) -> int:
        return self.finish_step - max(self.arrival_step, 1) + 1


@dataclass
class SimResult:
    requests: list[SimRequestResult]  # in input order
    num_steps: int
    trace: Trace
    scheduler: Scheduler

    @property
    def slot_utilization(self) -> float:
        return self.trace.slot_utilization()

    def __repr__(self):
        return (
            f"SimResult(num_steps={self.num_steps}, requests={len(self.requests)}, {self.trace!r})"
        )


def scripted_step(sched: Scheduler, on_step=None) -> SchedulerOutput:
    """One step with the scripted model: token 1 for every row that completes its tokens (never a
    stop token). `on_step(sched, out)` looks at the schedule before the update."""
    out = sched.schedule()
    if on_step is not None:
        on_step(sched, out)
    # n for a fork
    sched.update(out, [1] * sum(s.request.num_seqs for s in out.scheduled if s.do_sample))
    return out


def simulate(
    requests: list[SimRequest],
    config: EngineConfig | None = None,
    max_steps: int = 100_000,
    on_step=None,
) -> SimResult:
    """Run `requests` through the real scheduler. `on_step(scheduler, out)` is called after each
    schedule() for a notebook that wants to look inside."""
    config = config or EngineConfig()
    if config.num_blocks is None:
        config = config.replace(num_blocks=SIM_NUM_BLOCKS)
    sched = Scheduler(config)
    trace = Trace(config.max_num_seqs, config.num_blocks, config.block_size)
    pending = []
    for i, sr in enumerate(requests):
        if sr.prompt_len <= 0 or sr.output_len <= 0:
            raise ValueError(
                f"request {i}: prompt_len and output_len must be positive, got "
                f"{sr.prompt_len} and {sr.output_len}"
            )
        # Distinct token ids per request unless given: no accidental prefix sharing.
        tokens = sr.prompt_token_ids or [100_000 * (i + 1) + j for j in range(sr.prompt_len)]
        if len(tokens) != sr.prompt_len:
            raise ValueError(
                f"request {i}: prompt_token_ids has {len(tokens)} tokens, prompt_len is "
                f"{sr.prompt_len}"
            )
        rid = sr.request_id if sr.request_id is not None else str(i)
        params = SamplingParams(max_tokens=sr.output_len, temperature=0.0, ignore_eos=True, n=sr.n)
        pending.append((max(sr.arrival_step, 1), i, rid, tokens, params, sr.priority, sr.user))
    # Arrival order (the FIFO key) is by arrival step, then by position in the list.
    pending.sort(key=lambda p: (p[0], p[1]))
    pending = [
        (
            step,
            i,
            _with_samples(
                Request(rid, tokens, params.for_sample(0), prio, arrival_index=rank, user=user),
                params.n,
            ),
        )
        for rank, (step, i, rid, tokens, params, prio, user) in enumerate(pending)
    ]
    by_index = [p[2] for p in sorted(pending, key=lambda p: p[1])]

    step, nxt = 0, 0
    while nxt < len(pending) or sched.has_unfinished_requests():
        step += 1
        if step > max_steps:
            raise RuntimeError(f"simulation did not finish within max_steps={max_steps}")
        while nxt < len(pending) and pending[nxt][0] <= step:
            _, i, req = pending[nxt]
            try:
                sched.add_request(req)
            except ValueError as e:
                raise ValueError(f"request {i}: {e}") from None
            nxt += 1
        out = scripted_step(sched, on_step)
        trace.record(sched, out, sched.take_finished())

    results = [
        SimRequestResult(
            r.request_id,
            r.num_prompt_tokens,
            r.params.max_tokens,
            max(requests[i].arrival_step, 1),
            r.admitted_step,
            r.first_token_step,
            r.finish_step,
            r.num_preemptions,
            r.user,
            max(r.num_cached_tokens, 0),  # -1: never admitted
        )
        for i, r in enumerate(by_index)
    ]
    return SimResult(results, step, trace, sched)


def _with_samples(req: Request, n: int) -> Request:
    """Give a request its n - 1 other samples, to fork after its prefill (ids "i_<id>", as the
    engine's)."""
    req.forks = [
        Request(
            f"{i}_{req.request_id}",
            req.prompt_token_ids,
            req.params,
            req.priority,
            arrival_index=req.arrival_index,
            sample_index=i,
            user=req.user,
        )
        for i in range(1, n)
    ]
    return req


def __getattr__(name):
    """The fleet simulator (minicb/reference/fleet.py: several replicas of this scheduler behind a
    router) is reached from here too; imported on first use, since it builds on this module."""
    if name in ("simulate_fleet", "multi_turn_workload"):
        from .reference import fleet

        return getattr(fleet, name)
    raise AttributeError(f"module 'minicb.sim' has no attribute {name!r}")
