"""Capacity planning: Poisson arrivals, a clock for the simulator, Little's law and latency SLOs.

Steps become seconds through the step-cost line of notebook 05, t_step = a + b * tokens in the step:
`run_timed` drives the real Scheduler with the scripted model of `sim` and a clock. Prediction
before measurement: at lambda requests/s, u = lambda E[t_step] requests arrive per step and each
stays D steps in its slot (its prefill, then D - 1 decodes), so by Little's law (L = lambda W) u
E[D] slots are busy, u E[blocks summed over its steps] KV blocks are held and E[t_step] = a + b u
E[P + D - 1]. Each resource caps u; the smallest cap, priced by the line, is the highest sustainable
rate. Goodput counts only the requests that meet both the TTFT and the TPOT target (DistServe, Zhong
et al., OSDI 2024). No torch.
"""

import itertools
import math
import random
from dataclasses import dataclass

from ..config import EngineConfig
from ..core.request import Request
from ..metrics import mean_gap, percentile
from ..sampling_params import SamplingParams
from .pool import StepCost, run_pool


@dataclass(frozen=True)
class SLO:
    """Latency targets of one request; it counts towards goodput only if it meets both."""

    ttft: float  # seconds from arrival to the first token
    tpot: float  # seconds per output token after the first (the request's mean gap)

    def met_by(self, ttft: float, tpot: float | None) -> bool:
        # one token: no TPOT to miss
        return ttft <= self.ttft and (tpot is None or tpot <= self.tpot)


@dataclass(frozen=True)
class Workload:
    """Prompt and output lengths drawn uniformly from inclusive ranges (lo, hi)."""

    prompt_len: tuple[int, int] = (64, 192)
    output_len: tuple[int, int] = (16, 48)

    def __post_init__(self):
        for name, (lo, hi) in (("prompt_len", self.prompt_len), ("output_len", self.output_len)):
            if not 1 <= lo <= hi:
                raise ValueError(
                    f"{name} must be a range (lo, hi) with 1 <= lo <= hi, got {(lo, hi)}"
                )

    def sample(self, rate: float, num_requests: int, seed: int = 0) -> list["Arrival"]:
        # the lengths draw from their own stream: same times at any lengths
        rng = random.Random(seed + 1)
        times = poisson_arrivals(rate, num_requests, seed)
        return [
            Arrival(t, rng.randint(*self.prompt_len), rng.randint(*self.output_len)) for t in times
        ]

    def expect(self, f) -> float:
        """E[f(P, D)] over the length distribution, exactly (every pair of lengths is equally
        likely)."""
        ps, ds = (
            range(self.prompt_len[0], self.prompt_len[1] + 1),
            range(self.output_len[0], self.output_len[1] + 1),
        )
        return sum(f(p, d) for p in ps for d in ds) / (len(ps) * len(ds))

    def mean_output_len(self) -> float:
        return self.expect(lambda p, d: d)

    def mean_tokens(self) -> float:
        """Tokens a request puts through the model: its prompt, then D - 1 decodes (the last token
        is never fed)."""
        return self.expect(lambda p, d: p + d - 1)

    def mean_block_steps(self, block_size: int) -> float:
        """E[sum of the blocks a request holds over its D steps]: ceil((P + j) / block_size) in step
        j."""
        return self.expect(
            lambda p, d: _ceil_sum(p + d - 1, block_size) - _ceil_sum(p - 1, block_size)
        )


def _ceil_sum(n: int, bs: int) -> int:  # sum of ceil(x / bs) for x = 1..n, in closed form
    q, r = divmod(n, bs)
    return bs * q * (q + 1) // 2 + r * (q + 1)


def poisson_arrivals(rate: float, num_requests: int, seed: int = 0) -> list[float]:
    """Arrival times (seconds) of a Poisson process: independent exponential gaps of mean 1 /
    rate."""
    if not rate > 0:
        raise ValueError(f"rate must be positive (requests per second), got {rate!r}")
    rng = random.Random(seed)
    return list(itertools.accumulate(rng.expovariate(rate) for _ in range(num_requests)))


@dataclass
class Arrival:  # one request of a workload: when it comes, and its lengths
    time: float  # seconds
    prompt_len: int
    output_len: int


@dataclass
class TimedRequest:  # one request's life, in seconds
    arrival: float
    first_token: float
    finish: float
    output_len: int
    num_preemptions: int

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:  # None with one token: no gap to measure
        return mean_gap(self.first_token, self.finish, self.output_len)

    @property
    def latency(self) -> float:
        return self.finish - self.arrival


@dataclass
class TimedRun:
    requests: list[TimedRequest]  # in arrival order
    step_ends: list[float]  # the clock at the end of step k + 1
    step_blocks: list[int]  # device blocks held during the step
    # the steady part: after the warm-up, up to the last arrival (no drain)
    window: tuple[float, float]

    def time_average(self, start_end_value) -> float:
        """Time average over the window of a sum of (start, end, value) pieces."""
        t0, t1 = self.window
        return sum(v * max(0.0, min(e, t1) - max(s, t0)) for s, e, v in start_end_value) / (t1 - t0)

    def in_flight(self) -> float:
        """L: requests arrived and not finished (waiting or running), averaged over the window."""
        return self.time_average((r.arrival, r.finish, 1) for r in self.requests)

    def blocks_in_use(self) -> float:
        starts = [0.0] + self.step_ends[:-1]
        return self.time_average(zip(starts, self.step_ends, self.step_blocks))

    def __repr__(self):
        return (
            f"TimedRun({len(self.requests)} requests, {len(self.step_ends)} steps, "
            f"window {self.window[0]:.1f}-{self.window[1]:.1f} s, in flight {self.in_flight():.1f})"
        )


def timed_window(arrivals: list[Arrival], warmup: float) -> tuple[float, float]:
    """The measured window of a run: from the arrival `warmup` of the way in, to the last
    arrival."""
    if not arrivals:
        raise ValueError("no arrivals: a run needs at least one request to measure")
    return arrivals[int(warmup * (len(arrivals) - 1))].time, arrivals[-1].time


def run_timed(
    arrivals: list[Arrival], config: EngineConfig, cost: StepCost, warmup: float = 0.2
) -> TimedRun:
    """Serve `arrivals` with the real scheduler and the scripted model; each step takes
    cost.seconds(tokens). A request that arrives during a step is admitted at the next one; an idle
    engine waits for the next arrival. The window skips the first `warmup` of the arrivals (the
    empty engine filling up) and everything after the last arrival (the drain)."""
    arrivals = sorted(arrivals, key=lambda a: a.time)
    window = timed_window(arrivals, warmup)
    reqs = [
        Request(
            str(i),
            [100_000 * (i + 1) + j for j in range(a.prompt_len)],  # no accidental prefix hits
            SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True),
            arrival_index=i,
        )
        for i, a in enumerate(arrivals)
    ]
    run = run_pool([(a.time, r) for a, r in zip(arrivals, reqs)], config, cost, {})
    timed = [
        TimedRequest(
            a.time,
            run.first_token[r.request_id],
            run.finish[r.request_id],
            a.output_len,
            run.preemptions[r.request_id],
        )
        for a, r in zip(arrivals, reqs)
    ]
    return TimedRun(timed, run.step_ends, run.step_blocks, window)


@dataclass
class RatePoint:
    """What one offered rate gave, measured over the run's window."""

    rate: float  # offered (requests/s)
    throughput: float  # requests finished per second
    goodput: float  # requests finished per second that met both SLO targets
    ttft_p50: float
    ttft_p99: float
    ttft_mean: float
    tpot_p50: float
    tpot_p99: float
    tpot_mean: float
    latency_mean: float  # W: arrival to finish
    in_flight: float  # L, time-averaged
    blocks_in_use: float
    preemptions: int

    def __repr__(self):
        return (
            f"RatePoint(rate={self.rate:.2f}/s, throughput={self.throughput:.2f}/s, "
            f"goodput={self.goodput:.2f}/s, TTFT p50/p99 "
            f"{1e3 * self.ttft_p50:.0f}/{1e3 * self.ttft_p99:.0f} ms, TPOT p50/p99 "
            f"{1e3 * self.tpot_p50:.1f}/{1e3 * self.tpot_p99:.1f} ms, in flight "
            f"{self.in_flight:.1f})"
        )


def measure(run: TimedRun, rate: float, slo: SLO) -> RatePoint:
    """Throughput and goodput count the requests that FINISH in the window; latencies are those of
    the requests that ARRIVE in it (so an overloaded run shows the queue that its late arrivals
    meet)."""
    t0, t1 = run.window
    done = [r for r in run.requests if t0 <= r.finish <= t1]
    good = [r for r in done if slo.met_by(r.ttft, r.tpot)]
    arrived = [r for r in run.requests if t0 <= r.arrival <= t1]
    ttft = [r.ttft for r in arrived]
    tpot = [r.tpot for r in arrived if r.tpot is not None]
    return RatePoint(
        rate,
        len(done) / (t1 - t0),
        len(good) / (t1 - t0),
        percentile(ttft, 50),
        percentile(ttft, 99),
        sum(ttft) / len(ttft),
        percentile(tpot, 50),
        percentile(tpot, 99),
        sum(tpot) / len(tpot),
        sum(r.latency for r in arrived) / len(arrived),
        run.in_flight(),
        run.blocks_in_use(),
        sum(r.num_preemptions for r in arrived),
    )


def sweep(
    rates: list[float],
    workload: Workload,
    config: EngineConfig,
    cost: StepCost,
    slo: SLO,
    num_requests: int = 1000,
    seed: int = 0,
) -> list[RatePoint]:
    """One seeded Poisson run per rate (the same seed: the same lengths, the same gaps scaled by 1 /
    rate)."""
    return [
        measure(run_timed(workload.sample(rate, num_requests, seed), config, cost), rate, slo)
        for rate in rates
    ]


def knee(points: list[RatePoint]) -> RatePoint:
    """Where goodput peaks: past it, more offered load buys fewer requests that meet their
    targets."""
    return max(points, key=lambda p: p.goodput)


# ---------------------------------------------------------------- predictions (no simulation)
def predict_step_time(rate: float, workload: Workload, cost: StepCost) -> float:
    """E[t_step] = a + b * rate * E[t_step] * E[P + D - 1], solved: a / (1 - b * rate * E[P + D -
    1])."""
    # the share of each second spent on per-token work
    load = cost.b * rate * workload.mean_tokens()
    return cost.a / (1 - load) if load < 1 else math.inf


def predict_latency(rate: float, workload: Workload, cost: StepCost) -> float:
    """W below the knee, no queue: half a step waiting for the step in progress, then E[D] steps,
    the first of which also carries the request's own prompt (b * E[P] more than an average
    step)."""
    mean_prompt = workload.expect(lambda p, d: p)
    return (workload.mean_output_len() + 0.5) * predict_step_time(
        rate, workload, cost
    ) + cost.b * mean_prompt


def predict_in_flight(rate: float, workload: Workload, cost: StepCost) -> float:
    """Little's law: L = lambda * W."""
    return rate * predict_latency(rate, workload, cost)


def predict_blocks(rate: float, workload: Workload, cost: StepCost, block_size: int) -> float:
    """KV blocks held on average: Little's law on block-steps, u * E[blocks summed over a request's
    steps]."""
    return rate * predict_step_time(rate, workload, cost) * workload.mean_block_steps(block_size)


@dataclass
class Capacity:
    """Requests per step each resource allows (u), and the rate that is: u / (a + b * u * E[P + D -
    1])."""

    per_step: dict[str, float]  # resource -> the largest u it allows
    rates: dict[str, float]  # resource -> the highest sustainable rate (requests/s)

    @property
    def binding(self) -> str:  # the resource that runs out first
        return min(self.rates, key=self.rates.get)

    @property
    def rate(self) -> float:
        return self.rates[self.binding]

    def __repr__(self):
        caps = ", ".join(f"{k} {v:.2f}/s" for k, v in self.rates.items())
        return f"Capacity({self.rate:.2f} requests/s, bound by {self.binding}; {caps})"


def predict_capacity(
    workload: Workload, config: EngineConfig, cost: StepCost, slo: SLO | None = None
) -> Capacity:
    """The highest rate each resource sustains, from the lengths, the config and the step-cost line
    alone. A target caps the MEAN step time (TPOT: t_step <= target; TTFT: the step in progress plus
    the prefill step, 2 t_step <= target), so at its rate the median request just meets it: plan
    below it for the p99."""
    tokens = workload.mean_tokens()
    u = {
        "slots": config.max_num_seqs / workload.mean_output_len(),
        "token budget": config.max_num_batched_tokens / tokens,
    }
    if config.num_blocks is not None:
        u["KV blocks"] = config.num_blocks / workload.mean_block_steps(config.block_size)
    if slo is not None:
        u["TPOT target"] = _per_step_within(slo.tpot, cost, tokens)
        u["TTFT target"] = _per_step_within(slo.ttft / 2, cost, tokens)
    return Capacity(u, {k: v / cost.seconds(v * tokens) for k, v in u.items()})


def _per_step_within(
    t_max: float, cost: StepCost, tokens: float
) -> float:  # the largest u: a + b u tokens <= t_max
    if t_max < cost.a:
        return 0.0
    return (t_max - cost.a) / (cost.b * tokens) if cost.b else math.inf


def devices_needed(
    rate: float, workload: Workload, config: EngineConfig, cost: StepCost, slo: SLO | None = None
) -> int:
    """Replicas of `config` that serve `rate` between them, each at most at its predicted
    capacity."""
    return math.ceil(rate / predict_capacity(workload, config, cost, slo).rate)
