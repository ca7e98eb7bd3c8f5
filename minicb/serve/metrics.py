"""The server's metrics (GET /metrics), kept with prometheus_client under vLLM's names.

A monitoring system (Prometheus) reads /metrics every few seconds and stores each series; dashboards
and alerts then ask it questions such as `rate(vllm:generation_tokens_total[1m])` (tokens/s) or
`histogram_quantile(0.99, rate(vllm:time_to_first_token_seconds_bucket[5m]))` (p99 TTFT). Three
kinds: a gauge is a value now; a counter only grows (its name ends in `_total`, and its rate is what
one reads); a histogram counts observations into cumulative buckets (`le`: at most this) with a
`_sum` and a `_count`, from which quantiles are estimated.

The names are vLLM's (V1, "Production Metrics" in vLLM's docs) wherever vLLM measures the same
thing, so that a dashboard made for vLLM reads minicb, and every series has vLLM's `model_name`
label. What vLLM does not have keeps a `minicb:` name.

Gauges, the scheduler's state (publish_gauges, with a dict from scheduler_stats):
  vllm:num_requests_running      requests in the running batch vllm:num_requests_waiting
  requests waiting for a slot (those preempted by recompute too) vllm:kv_cache_usage_perc       KV
  blocks in use / all KV blocks, from 0 to 1 vllm:cache_config_info         always 1: its labels
  block_size and num_gpu_blocks say the KV cache's shape minicb:num_requests_swapped    preempted
  requests whose KV blocks wait in CPU memory (vLLM V1 has no swap) minicb:kv_blocks_used,
  minicb:kv_blocks_free, minicb:kv_blocks_total
Per engine step (record_step):
  vllm:generation_tokens         tokens generated, every sample of a request with n > 1 included
  vllm:num_preemptions           requests preempted, by recompute or by swap
  minicb:engine_steps            steps run
  minicb:batch_size              (histogram) requests in one step: the rows of its batch
Per finished request (record_finished: one observation per request, with its first sample's times):
  vllm:request_success           requests finished, by label finished_reason: stop, length, abort,
  or
                                 error (stopped by a failure in the engine; recent vLLM has it too)
  vllm:prompt_tokens             prompt tokens of the requests that were prefilled
  vllm:request_prompt_tokens, vllm:request_generation_tokens   (histograms) tokens of one request
  vllm:time_to_first_token_seconds   arrival -> first token: queueing + prefill (TTFT)
  vllm:request_queue_time_seconds    arrival -> first scheduled vllm:request_prefill_time_seconds
  first scheduled -> first token vllm:request_decode_time_seconds   first token -> last token
  vllm:e2e_request_latency_seconds   arrival -> finish vllm:request_time_per_output_token_seconds
  the request's mean gap between two output tokens,
                                 decode time / (tokens - 1): minicb's TPOT (minicb/metrics.py)
  vllm:inter_token_latency_seconds   every gap between two consecutive tokens (ITL); its tail shows
                                 the stalls that a request's mean hides
The engine's life (publish_gauges; stopped_stats once the engine is gone):
  minicb:engine_alive            1 while the engine can serve; 0 once its core process died or the
                                 engine loop stopped: the other gauges then read 0, not the last
                                 state. vLLM has no such gauge (its API server exits when its engine
                                 core dies, EngineDeadError); a scraper of minicb alerts on it.
  minicb:trace_records           step records the engine keeps for its trace (--trace-steps bounds
                                 them, in the engine core's process too)
Speculative decoding (publish_gauges, from the engine's totals; 0 when it is off):
  vllm:spec_decode_num_drafts, vllm:spec_decode_num_draft_tokens,
  vllm:spec_decode_num_accepted_tokens
                                 rows that verified drafts, drafts verified, drafts accepted: the
                                 acceptance rate is rate(accepted) / rate(draft tokens), as in
                                 vLLM's dashboards
The prefix cache (publish_gauges, from the scheduler's totals; vLLM V1's names, in tokens):
  vllm:prefix_cache_queries, vllm:prefix_cache_hits
                                 prompt tokens looked up and found in the cache when a request is
                                 first admitted: the hit rate is rate(hits) / rate(queries); with
                                 data parallelism, per replica (engine label), which is what a
                                 cache-aware router is judged by. vLLM also counts the lookups of
                                 preempted requests again; minicb counts a request once
  minicb:kv_offload_hits, minicb:kv_offload_bytes_to_cpu, minicb:kv_offload_bytes_to_device
                                 the prefix cache's CPU tier (kv_offloading_size): the hits' tokens
                                 that came from host memory, and the bytes copied each way
Admission (count_rejected):
  vllm:admission_rejections      requests refused because the server held max_num_seqs + max_waiting
                                 (HTTP 503), the rule of vLLM's --max-num-queued-reqs; vLLM adds a
                                 `reason` label naming which of its two caps refused

Where minicb differs: vLLM observes TTFT and counts prompt tokens in the step that makes a request's
first token, and ITL at every step; minicb observes everything of a request when it finishes, from
the times the engine recorded (so those series lag by one request). vLLM observes a TPOT of 0 for a
request of one token; minicb has no TPOT for it. Tokens per second are Prometheus' rate() of
vllm:generation_tokens_total; the server keeps no window of its own.
"""

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ..metrics import inter_token_latencies, mean_gap

FINISH_REASONS = ("stop", "length", "abort", "error")
# SpecDecodingStats' totals
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
# Bucket bounds: vLLM's, with finer ones below theirs where a tiny model on a CPU answers in
# milliseconds. seconds (vLLM's)
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
# seconds (vLLM's from 0.01)
TOKEN_GAP_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
# seconds (vLLM's from 0.3)
REQUEST_BUCKETS = (
    0.001,
    0.01,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
# 1, 2, 5, 10, ... 500000
TOKEN_COUNT_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # rows in one step

# Observed once per finished request: name -> (help, buckets).
REQUEST_HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": ("Arrival to first token (TTFT), seconds.", TTFT_BUCKETS),
    "vllm:request_queue_time_seconds": ("Arrival to first scheduled, seconds.", REQUEST_BUCKETS),
    "vllm:request_prefill_time_seconds": (
        "First scheduled to first token, seconds.",
        REQUEST_BUCKETS,
    ),
    "vllm:request_decode_time_seconds": ("First token to last token, seconds.", REQUEST_BUCKETS),
    "vllm:e2e_request_latency_seconds": ("Arrival to finish, seconds.", REQUEST_BUCKETS),
    "vllm:request_time_per_output_token_seconds": (
        "A request's mean time between two output tokens (TPOT), seconds.",
        TOKEN_GAP_BUCKETS,
    ),
    "vllm:request_prompt_tokens": ("Prompt tokens of a request.", TOKEN_COUNT_BUCKETS),
    "vllm:request_generation_tokens": (
        "Tokens generated for a request, all its samples.",
        TOKEN_COUNT_BUCKETS,
    ),
}


def scheduler_stats(scheduler, spec_stats=None) -> dict[str, int]:
    """What the gauges show, read from a minicb Scheduler (and the runner's SpecDecodingStats):
    plain ints, so that an engine running in another process can send them (vLLM's engine core sends
    its SchedulerStats and SpecDecodingStats the same way). The speculative counters are totals
    since the engine started."""
    bm = scheduler.block_manager
    spec = {f"spec_decode_{k}": getattr(spec_stats, k, 0) for k in SPEC_COUNTERS}
    return dict(
        num_requests_running=len(scheduler.running),
        num_requests_waiting=len(scheduler.waiting),
        num_requests_swapped=len(scheduler.swapped),
        kv_blocks_used=bm.num_used_blocks,
        kv_blocks_free=bm.num_free_blocks,
        kv_blocks_total=bm.num_blocks,
        block_size=bm.block_size,
        # totals since the engine started, in prompt tokens: first admissions only
        prefix_cache_queries=scheduler.prefix_cache_queries,
        prefix_cache_hits=scheduler.prefix_cache_hits,
        # the CPU tier (core/kv_offload.py): hits in tokens, copies in blocks
        kv_offload_hits=scheduler.offload_hits,
        kv_offload_blocks_stored=bm.tier.num_stored if bm.tier else 0,
        kv_offload_blocks_loaded=bm.tier.num_loaded if bm.tier else 0,
        **spec,
    )


def engine_stats(engine) -> dict[str, int]:
    """scheduler_stats of a minicb Engine: its scheduler's, with its speculative-decoding totals."""
    stats = scheduler_stats(engine.scheduler, engine.runner.spec_stats)
    block = engine.kv_cache.block_bytes  # one block over every layer: what a tier copy moves
    stats["kv_offload_bytes_to_cpu"] = stats["kv_offload_blocks_stored"] * block
    stats["kv_offload_bytes_to_device"] = stats["kv_offload_blocks_loaded"] * block
    return stats


def server_stats(engine) -> dict[str, int]:
    """What a server's gauges show of a minicb Engine: engine_stats, and the number of step records
    its trace keeps (in the API process, or in the engine core's, which sends them)."""
    return {**engine_stats(engine), "num_trace_records": len(engine.trace.steps)}


def stopped_stats(stats: dict[str, int]) -> dict[str, int]:
    """What the gauges say once the engine is gone (its core process died): nothing runs, waits or
    holds a KV block, and no block is free, for the cache went with it. Its shape stays, and
    engine_alive turns 0, so a dashboard reads "dead", not the last state it saw."""
    gone = dict.fromkeys(
        ("num_requests_running", "num_requests_waiting", "num_requests_swapped"), 0
    )
    return {**stats, **gone, "kv_blocks_used": 0, "kv_blocks_free": 0, "engine_alive": 0}


def request_record(out, stream_id: str, received_at: float) -> dict:
    """One finished request as the server saw it (serve --request-log): times in seconds of
    time.perf_counter, TTFT from `received_at` (when the engine loop was handed it) and from the
    engine's arrival, TPOT as the mean gap between its first sample's output tokens."""
    m, sample, t = out.metrics, out.outputs[0], out.metrics.token_times
    return {
        "stream_id": stream_id,
        "request_id": out.request_id,
        "received": received_at,
        "arrival": m.arrival_time,
        "first_token": m.first_token_time,
        "finish": m.finish_time,
        "prompt_tokens": len(out.prompt_token_ids),
        "output_tokens": len(sample.token_ids),
        "ttft_s": None if m.first_token_time is None else m.first_token_time - received_at,
        "engine_ttft_s": m.ttft,
        "tpot_s": (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None,
    }


def request_observations(out) -> dict[str, float | None]:
    """One finished RequestOutput's value for each of REQUEST_HISTOGRAMS (None: not defined for it,
    e.g. no TTFT for a request aborted before its first token). Times are its first sample's."""
    m = out.metrics
    t = m.token_times  # when each output token came out
    first, last = (t[0], t[-1]) if t else (None, None)
    since = lambda a, b: b - a if a is not None and b is not None else None
    return {
        "vllm:time_to_first_token_seconds": m.ttft,
        "vllm:request_queue_time_seconds": m.queue_time,
        "vllm:request_prefill_time_seconds": since(m.first_scheduled_time, first),
        "vllm:request_decode_time_seconds": since(first, last),
        "vllm:e2e_request_latency_seconds": since(m.arrival_time, m.finish_time),
        "vllm:request_time_per_output_token_seconds": mean_gap(first, last, len(t)),
        "vllm:request_prompt_tokens": len(out.prompt_token_ids),
        "vllm:request_generation_tokens": sum(len(s.token_ids) for s in out.outputs),
    }


class ServerMetrics:
    """The server's metrics: written by the engine loop, read by GET /metrics (text()).

    Each instance has its own CollectorRegistry instead of prometheus_client's global REGISTRY, so
    that two servers in one process (the tests start many) never share a value. One lock covers
    every write and text(), so a reading never shows half of an update (e.g. a request counted as
    running while its KV blocks are not yet counted as used)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.gauges: dict[str, int] = {}  # the last dict given to publish_gauges
        self._unpublished = False  # gauges holds what the Prometheus objects do not show yet
        self.totals_seen: dict[
            str, int
        ] = {}  # the totals (speculative, prefix cache) last published
        self._lock = threading.Lock()
        reg, label = self.registry, ["model_name"]

        def gauge(name, doc):
            return Gauge(name, doc, label, registry=reg).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, label, registry=reg).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, label, buckets=buckets, registry=reg).labels(model_name)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting for a slot.")
        self.kv_usage = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage: used blocks / all blocks (1 = full)."
        )
        self.cache_config = Gauge(
            "vllm:cache_config_info",
            "The KV cache's shape, in the labels.",
            ["block_size", "num_gpu_blocks"],
            registry=reg,
        )
        self.swapped = gauge(
            "minicb:num_requests_swapped", "Preempted requests whose KV blocks are in CPU memory."
        )
        self.alive = gauge("minicb:engine_alive", "1 while the engine can serve, 0 once it died.")
        self.alive.set(1)
        self.trace_records = gauge(
            "minicb:trace_records", "Step records kept for the engine's trace (--trace-steps)."
        )
        self.blocks = {
            k: gauge(f"minicb:{k}", f"KV blocks {k.removeprefix('kv_blocks_')}.")
            for k in ("kv_blocks_used", "kv_blocks_free", "kv_blocks_total")
        }
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.preemptions = counter(
            "vllm:num_preemptions", "Requests preempted (by recompute or swap)."
        )
        self.steps = counter("minicb:engine_steps", "Engine steps run.")
        self.batch_size = histogram(
            "minicb:batch_size", "Requests (rows) in one engine step.", BATCH_BUCKETS
        )
        self.prompt_tokens = counter(
            "vllm:prompt_tokens", "Prompt tokens of the requests prefilled."
        )
        self.success = Counter(
            "vllm:request_success",
            "Requests finished, by finish reason.",
            label + ["finished_reason"],
            registry=reg,
        )
        for reason in FINISH_REASONS:  # every reason is shown from the start, at 0
            self.success.labels(model_name, reason)
        self.rejections = counter(
            "vllm:admission_rejections", "Requests refused: the server was full (HTTP 503)."
        )
        self.per_request = {
            name: histogram(name, doc, buckets)
            for name, (doc, buckets) in REQUEST_HISTOGRAMS.items()
        }
        self.spec = {
            k: counter(f"vllm:spec_decode_{k}", doc)
            for k, doc in zip(
                SPEC_COUNTERS,
                (
                    "Rows that verified drafts (speculative decoding).",
                    "Draft tokens verified.",
                    "Draft tokens accepted.",
                ),
            )
        }
        self.prefix_cache = {
            k: counter(f"vllm:prefix_cache_{k}", doc)
            for k, doc in (
                ("queries", "Prompt tokens looked up in the prefix cache, at first admission."),
                ("hits", "Prompt tokens found in the prefix cache, at first admission."),
            )
        }
        self.offload = {
            k: counter(f"minicb:kv_offload_{k}", doc)
            for k, doc in (
                (
                    "hits",
                    "Prompt tokens loaded from the CPU tier at first admission (of the hits).",
                ),
                ("bytes_to_cpu", "Bytes copied from the device to the prefix cache's CPU tier."),
                ("bytes_to_device", "Bytes copied back from the CPU tier on a hit."),
            )
        }
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Time between two consecutive output tokens, seconds.",
            TOKEN_GAP_BUCKETS,
        )

    # ------------------------------------------------------------------ written by the engine loop
    def record_step(self, rows: int, new_tokens: int, num_preempted: int = 0) -> None:
        """One engine step: its batch had `rows` requests, made `new_tokens` tokens, preempted
        some."""
        with self._lock:
            self.steps.inc()
            self.batch_size.observe(rows)
            self.generation_tokens.inc(new_tokens)
            self.preemptions.inc(num_preempted)

    def record_finished(self, outputs) -> None:
        """Finished RequestOutputs (one per request, whatever its n): its finish reason (its first
        sample's; "error" when the engine stopped it) and its times."""
        with self._lock:
            for out in outputs:
                reason = "error" if out.error else str(out.outputs[0].finish_reason)
                self.success.labels(self.model_name, reason).inc()
                if out.metrics.first_token_time is not None:  # its prompt went through the model
                    self.prompt_tokens.inc(len(out.prompt_token_ids))
                for name, value in request_observations(out).items():
                    if value is not None:
                        self.per_request[name].observe(value)
                for gap in inter_token_latencies(out.metrics):
                    self.itl.observe(gap)

    def count_rejected(self) -> None:
        with self._lock:
            self.rejections.inc()

    def count_error(self) -> None:
        """A request that failed without a RequestOutput (the engine loop gave up on it)."""
        with self._lock:
            self.success.labels(self.model_name, "error").inc()

    def publish_gauges(self, stats: dict[str, int]) -> None:
        """Set the gauges from a dict as scheduler_stats makes it. The engine loop calls this at
        every step, /metrics is read every few seconds: the dict is kept here, and set into the
        Prometheus objects when a reading needs them (about 0.1 ms a step saved in the API
        process, whose CPU the engine shares on a small machine; serve/README.md)."""
        with self._lock:
            self.gauges, self._unpublished = dict(stats), True

    def _publish(self) -> None:
        """Set the Prometheus objects from the newest dict (under the lock, before a reading)."""
        if self._unpublished:
            self._unpublished, stats = False, self.gauges
            self.running.set(stats["num_requests_running"])
            self.waiting.set(stats["num_requests_waiting"])
            self.swapped.set(stats["num_requests_swapped"])
            self.alive.set(stats.get("engine_alive", 1))
            self.trace_records.set(stats.get("num_trace_records", 0))
            for key, g in self.blocks.items():
                g.set(stats[key])
            total = stats["kv_blocks_total"]
            self.kv_usage.set(stats["kv_blocks_used"] / total if total else 0.0)
            self.cache_config.clear()  # one series, with the newest labels
            self.cache_config.labels(str(stats["block_size"]), str(total)).set(1)
            # totals in, counters out: add what is new since the last call
            counters = {f"spec_decode_{k}": c for k, c in self.spec.items()}
            counters.update({f"prefix_cache_{k}": c for k, c in self.prefix_cache.items()})
            counters.update({f"kv_offload_{k}": c for k, c in self.offload.items()})
            for key, c in counters.items():
                c.inc(max(0, stats.get(key, 0) - self.totals_seen.get(key, 0)))
                self.totals_seen[key] = stats.get(key, 0)

    # ------------------------------------------------------------------ read by GET /metrics
    def text(self) -> str:
        """Every metric in Prometheus' text format (version 0.0.4)."""
        with self._lock:
            self._publish()
            return generate_latest(self.registry).decode()

    def families(self) -> list:
        """Every metric family with its samples now (a data-parallel server merges them)."""
        with self._lock:
            self._publish()
            return list(self.registry.collect())

    def value(self, name: str, **labels: str) -> float | None:
        """One sample's value as /metrics shows it (e.g. value("minicb:engine_steps_total")), None
        if absent."""
        with self._lock:
            self._publish()
            return self.registry.get_sample_value(name, {"model_name": self.model_name, **labels})

    @property
    def num_steps(self) -> int:
        return int(self.value("minicb:engine_steps_total"))

    def __repr__(self):
        s = self.gauges
        return (
            f"ServerMetrics({self.model_name!r}, running={s.get('num_requests_running')}, "
            f"waiting={s.get('num_requests_waiting')}, kv_blocks_used={s.get('kv_blocks_used')}/"
            f"{s.get('kv_blocks_total')}, steps={self.num_steps})"
        )


def parse_metrics(text: str) -> dict[str, float]:
    """The samples of a /metrics text, read with prometheus_client's own parser, keyed by sample
    name and labels, model_name left out: {"vllm:num_requests_running": 2.0,
    'vllm:request_success_total{finished_reason="abort"}': 1.0, ...}."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(
                f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "model_name"
            )
            samples[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return samples
