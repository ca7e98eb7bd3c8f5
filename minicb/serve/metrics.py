"""The server's metrics, in Prometheus' text format (GET /metrics).

Written by the engine loop after every step and read by HTTP handlers, so every field is touched
under one lock. Gauges: requests running / waiting / swapped, KV blocks used / free / total.
Counters: engine steps, prompt and generated tokens, requests finished (by finish reason, "error"
included) and rejected. Histograms: TTFT, TPOT (a request's mean time per output token) and the
batch size of a step; and generated tokens per second over the last few seconds.
"""

import threading
import time
from collections import deque

from ..metrics import tpot

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)  # seconds
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)  # seconds per token
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # rows in one step
THROUGHPUT_WINDOW_S = 10.0  # tokens/s is averaged over the last few seconds


class Histogram:
    """A Prometheus histogram: cumulative bucket counts, a sum and a count."""

    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)  # observations <= bucket bound (cumulative)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6f}",
                      f"{name}_count {self.count}"]



class ServerMetrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.batch_size = Histogram(BATCH_BUCKETS)
        self.num_steps = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.finished_total = {"stop": 0, "length": 0, "abort": 0, "error": 0}
        self.rejected_total = 0
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps
        self.gauges: dict[str, int] = {}

    def record_step(self, rows: int, new_tokens: int) -> None:
        now = time.perf_counter()
        with self._lock:
            self.num_steps += 1
            self.batch_size.observe(rows)
            self.generation_tokens_total += new_tokens
            self._recent.append((now, new_tokens))
            while self._recent and self._recent[0][0] < now - THROUGHPUT_WINDOW_S:
                self._recent.popleft()

    def count_rejected(self) -> None:
        with self._lock:
            self.rejected_total += 1

    def count_error(self) -> None:
        with self._lock:
            self.finished_total["error"] += 1

    def record_finished(self, outputs) -> None:
        with self._lock:
            for out in outputs:  # one per request, whatever its n; its first sample's reason and pace
                self.finished_total["error" if out.error else out.outputs[0].finish_reason] += 1
                self.prompt_tokens_total += len(out.prompt_token_ids)
                if out.metrics.ttft is not None:
                    self.ttft.observe(out.metrics.ttft)
                t = tpot(out.metrics, len(out.outputs[0].token_ids))
                if t is not None:
                    self.tpot.observe(t)

    def publish_gauges(self, sched) -> None:
        bm = sched.block_manager
        gauges = dict(num_requests_running=len(sched.running), num_requests_waiting=len(sched.waiting),
                      num_requests_swapped=len(sched.swapped), kv_blocks_used=bm.num_used_blocks,
                      kv_blocks_free=bm.num_free_blocks, kv_blocks_total=bm.num_blocks)
        with self._lock:
            self.gauges = gauges

    def text(self) -> str:
        with self._lock:
            window = sum(n for _, n in self._recent)
            lines = []
            for name, value in self.gauges.items():
                lines += [f"# TYPE minicb_{name} gauge", f"minicb_{name} {value}"]
            lines += ["# HELP minicb_generation_tokens_per_second output tokens/s over the last "
                      f"{THROUGHPUT_WINDOW_S:.0f} s", "# TYPE minicb_generation_tokens_per_second gauge",
                      f"minicb_generation_tokens_per_second {window / THROUGHPUT_WINDOW_S:.3f}"]
            for name, value in (("engine_steps", self.num_steps), ("prompt_tokens", self.prompt_tokens_total),
                                ("generation_tokens", self.generation_tokens_total),
                                ("requests_rejected", self.rejected_total)):
                lines += [f"# TYPE minicb_{name}_total counter", f"minicb_{name}_total {value}"]
            lines.append("# TYPE minicb_requests_finished_total counter")
            lines += [f'minicb_requests_finished_total{{finish_reason="{k}"}} {v}'
                      for k, v in self.finished_total.items()]
            for name, hist, about in (("time_to_first_token_seconds", self.ttft, "arrival to first token"),
                                      ("time_per_output_token_seconds", self.tpot, "mean decode pace"),
                                      ("batch_size", self.batch_size, "requests in one engine step")):
                lines += [f"# HELP minicb_{name} {about}", f"# TYPE minicb_{name} histogram"]
                lines += hist.lines(f"minicb_{name}")
        return "\n".join(lines) + "\n"
