"""Disaggregated prefill and decode, simulated: a prefill pool and a decode pool joined by a KV
transfer.

Idea (DistServe, Zhong et al., OSDI 2024; Splitwise, Patel et al., ISCA 2024): prefill is
compute-bound and decode memory-bound, and in one pool they interfere. Every step that carries a
prompt chunk is longer, so every running decode waits for it (TPOT grows with the prompts that
arrive); and every step that carries decodes leaves less of the token budget to prompts (TTFT grows
with the decodes that run). Disaggregation runs them on separate devices: a prefill pool computes
each prompt and the first token, then the request's KV cache travels to a decode pool, which
produces the remaining tokens.

The simulation drives two real Schedulers (each with its own EngineConfig, BlockManager and clock)
with the scripted model of `sim`, and prices a step with the line of notebook 05, t = a + b x tokens
computed:

  prefill pool  each request enters with max_tokens = 1: its prefill (chunked as the pool's config
  says)
                ends with its first token, which the user sees at once (TTFT is decided here);
  transfer      its prompt's KV leaves when the prefill ends and lands
  `kv_transfer_seconds(prompt_len)`
                later: a fixed latency plus prompt_len x KV bytes per token / link bandwidth;
  decode pool   the request enters as a prompt of prompt_len + 1 tokens (its prompt and its first
  token)
                that needs output_len - 1 more. The prompt's KV is real blocks of the decode pool's
                BlockManager, written by the transfer, so its positions cost the decode pool NO
                compute:
                of the row that admits the request, only the last token (the first output token, fed
                for the first decode) is priced. That row still uses the pool's token budget, so
                give the decode pool a budget of a few prompts (the landing of KV is not free of
                slots, only of arithmetic).

Two approximations, both stated in notebook 13: the pools do not push back on each other (a decode
pool out of memory would stall transfers in a real system; here it preempts, as any pool does), and
the prefill pool runs first and hands over its finish times (exact under the first approximation).
"""

from dataclasses import dataclass

from ..config import EngineConfig
from ..core.request import Request
from ..sampling_params import SamplingParams
from .capacity import Arrival, TimedRequest, TimedRun, timed_window
from .pool import StepCost, run_pool


@dataclass(frozen=True)
class KVTransfer:
    """What moving one request's KV cache from the prefill pool to the decode pool costs."""

    latency: float = 0.0  # seconds every transfer pays (connection, handshake, first byte)
    seconds_per_token: float = 0.0  # KV bytes per token / link bytes per second

    def __post_init__(self):
        if self.latency < 0 or self.seconds_per_token < 0:
            raise ValueError(
                f"a transfer cannot take negative time: latency={self.latency!r}, "
                f"seconds_per_token={self.seconds_per_token!r}"
            )

    @classmethod
    def over_link(
        cls, kv_bytes_per_token: int, gb_per_s: float, latency: float = 0.0
    ) -> "KVTransfer":
        """A link of `gb_per_s` GB/s (1e9 bytes) moving `kv_bytes_per_token` bytes per prompt
        token."""
        if not gb_per_s > 0:
            raise ValueError(f"link bandwidth must be positive (GB/s), got {gb_per_s!r}")
        return cls(latency, kv_bytes_per_token / (gb_per_s * 1e9))

    def seconds(self, prompt_len: int) -> float:
        return self.latency + self.seconds_per_token * prompt_len


def _request(i: int, tokens: list[int], max_tokens: int, rank: int) -> Request:
    return Request(
        str(i),
        tokens,
        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        arrival_index=rank,
    )


def run_disaggregated(
    arrivals: list[Arrival],
    prefill: EngineConfig,
    decode: EngineConfig,
    cost: StepCost,
    transfer: KVTransfer = KVTransfer(),
    decode_cost: StepCost | None = None,
    warmup: float = 0.2,
) -> TimedRun:
    """One prefill pool and one decode pool (see the module's docstring). Returns the requests'
    lives as a TimedRun (TTFT from the prefill pool, TPOT and finish from the decode pool) with the
    decode pool's steps and blocks."""
    arrivals = sorted(arrivals, key=lambda a: a.time)
    window = timed_window(arrivals, warmup)  # refuses an empty list before anything runs
    prompts = [[100_000 * (i + 1) + j for j in range(a.prompt_len)] for i, a in enumerate(arrivals)]
    pre = run_pool(
        [(a.time, _request(i, p, 1, i)) for i, (a, p) in enumerate(zip(arrivals, prompts))],
        prefill,
        cost,
        {},
    )
    handoff = []  # requests with more than one token continue in the decode pool
    for i, (a, p) in enumerate(zip(arrivals, prompts)):
        if a.output_len > 1:
            lands = pre.first_token[str(i)] + transfer.seconds(a.prompt_len)
            handoff.append((lands, _request(i, p + [1], a.output_len - 1, i)))  # + its first token
    dec = run_pool(
        handoff, decode, decode_cost or cost, {str(i): a.prompt_len for i, a in enumerate(arrivals)}
    )
    timed = []
    for i, a in enumerate(arrivals):
        rid, first = str(i), pre.first_token[str(i)]
        timed.append(
            TimedRequest(
                a.time,
                first,
                dec.finish.get(rid, first),
                a.output_len,
                pre.preemptions[rid] + dec.preemptions.get(rid, 0),
            )
        )
    return TimedRun(timed, dec.step_ends, dec.step_blocks, window)


def run_replicas(
    arrivals: list[Arrival],
    config: EngineConfig,
    cost: StepCost,
    replicas: int = 2,
    warmup: float = 0.2,
) -> TimedRun:
    """The colocated baseline on the same number of devices: `replicas` identical pools, each
    serving prefill and decode (with chunked prefill if the config says so), the arrivals dealt
    round-robin. Steps and blocks are those of the first replica."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    arrivals = sorted(arrivals, key=lambda a: a.time)
    window = timed_window(arrivals, warmup)
    runs, timed = [], [None] * len(arrivals)
    for k in range(replicas):
        mine = list(range(k, len(arrivals), replicas))
        run = run_pool(
            [
                (
                    arrivals[i].time,
                    _request(
                        i,
                        [100_000 * (i + 1) + j for j in range(arrivals[i].prompt_len)],
                        arrivals[i].output_len,
                        i,
                    ),
                )
                for i in mine
            ],
            config,
            cost,
            {},
        )
        runs.append(run)
        for i in mine:
            timed[i] = TimedRequest(
                arrivals[i].time,
                run.first_token[str(i)],
                run.finish[str(i)],
                arrivals[i].output_len,
                run.preemptions[str(i)],
            )
    return TimedRun(timed, runs[0].step_ends, runs[0].step_blocks, window)
