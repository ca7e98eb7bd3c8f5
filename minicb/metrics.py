"""Serving metrics: what users feel (latency) and what operators pay for (throughput).

- TTFT, time to first token: arrival -> first generated token (queueing + prefill).
- TPOT, time per output token: (finish - first token) / (output tokens - 1), one request's MEAN
  decode pace (what guidellm and others call a request's "inter-token latency").
- ITL, inter-token latency: every gap between two consecutive tokens of a stream, pooled over the
  requests. Its p99 (or max) shows stalls that a mean hides, e.g. decodes held up by a long
  prefill when chunked prefill is off (Sarathi-Serve calls it time between tokens, TBT).
- Throughput: output tokens / wall time from first arrival to last finish.
"""

import dataclasses
from dataclasses import dataclass, field


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of a non-empty list."""
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def mean_gap(first: float, last: float, num_tokens: int) -> float | None:
    """The mean time between `num_tokens` tokens, the first at `first` and the last at `last`."""
    return (last - first) / (num_tokens - 1) if num_tokens >= 2 else None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.perf_counter seconds) filled in by the engine."""

    arrival_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    # only ever grows; snapshots share it
    _times: list[float] = field(default_factory=list, repr=False)
    # a snapshot sees only its first _seen entries
    _seen: int | None = field(default=None, repr=False)

    @property
    def token_times(self) -> list[float]:
        """When each output token came out, in order (inter-token latency is their differences)."""
        return self._times if self._seen is None else self._times[: self._seen]

    def record_token(self, t: float) -> None:
        self._times.append(t)

    def snapshot(self) -> "RequestMetrics":
        """A copy that later tokens do not change. O(1) per step, not O(tokens so far): it shares
        the list of times, which only grows, and remembers how much of it existed."""
        return dataclasses.replace(self, _seen=len(self._times))

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None or self.arrival_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival until the first generated token exists."""
        if self.first_token_time is None or self.arrival_time is None:
            return None
        return self.first_token_time - self.arrival_time


def tpot(metrics, num_output_tokens: int) -> float | None:
    """TPOT of one request from its RequestMetrics (None with fewer than two tokens or
    unfinished)."""
    if metrics.first_token_time is None or metrics.finish_time is None:
        return None
    return mean_gap(metrics.first_token_time, metrics.finish_time, num_output_tokens)


def inter_token_latencies(metrics) -> list[float]:
    """Every gap between two consecutive output tokens of one request, in seconds."""
    t = metrics.token_times
    return [b - a for a, b in zip(t, t[1:])]


@dataclass
class Summary:
    num_requests: int
    output_tokens: int
    wall_time: float
    throughput: float  # output tokens / s
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    itl_p50: float
    itl_p99: float
    itl_max: float
    queue_p50: float

    def __str__(self):
        ms = lambda x: f"{1000 * x:.0f} ms"
        return (
            f"{self.num_requests} requests, {self.output_tokens} tokens in {self.wall_time:.2f} s: "
            f"{self.throughput:.1f} tok/s | TTFT p50 {ms(self.ttft_p50)} p99 {ms(self.ttft_p99)} | "
            f"TPOT p50 {ms(self.tpot_p50)} p99 {ms(self.tpot_p99)} | "
            f"ITL p50 {ms(self.itl_p50)} p99 {ms(self.itl_p99)} max {ms(self.itl_max)}"
        )


def summarize(outputs) -> Summary:
    """Latency percentiles and throughput of finished RequestOutputs."""
    ms = [o.metrics for o in outputs]
    start = min(m.arrival_time for m in ms)
    end = max(m.finish_time for m in ms)
    ntok = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    ttfts = [m.ttft for m in ms if m.ttft is not None]
    tpots = [t for o in outputs if (t := tpot(o.metrics, len(o.outputs[0].token_ids))) is not None]
    queues = [m.queue_time for m in ms if m.queue_time is not None]
    itls = [gap for m in ms for gap in inter_token_latencies(m)]
    return Summary(
        len(outputs),
        ntok,
        end - start,
        ntok / (end - start) if end > start else float("nan"),
        percentile(ttfts, 50),
        percentile(ttfts, 99),
        percentile(tpots, 50),
        percentile(tpots, 99),
        percentile(itls, 50),
        percentile(itls, 99),
        max(itls, default=float("nan")),
        percentile(queues, 50),
    )
