"""The server's metrics (minicb/serve/metrics.py) without a server: hand-made requests whose every
time is known, and the real Scheduler driven by the simulator. The text is read back with
prometheus_client's own parser, as a Prometheus server would read it."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from minicb.config import EngineConfig
from minicb.core.request import RequestMetrics
from minicb.core.scheduler import Scheduler
from minicb.outputs import CompletionOutput, RequestOutput
from minicb.serve.metrics import (
    FINISH_REASONS,
    REQUEST_HISTOGRAMS,
    ServerMetrics,
    engine_stats,
    parse_metrics,
    scheduler_stats,
)
from minicb.sim import SimRequest, simulate

VLLM_NAMES = {  # vLLM's V1 names (docs: "Production Metrics") and their types
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:cache_config_info": "gauge",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:admission_rejections": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
}
IDLE = dict(
    num_requests_running=0,
    num_requests_waiting=0,
    num_requests_swapped=0,
    kv_blocks_used=0,
    kv_blocks_free=8,
    kv_blocks_total=8,
    block_size=16,
)


def finished(
    arrival, scheduled, token_times, reason="length", prompt_len=5, error=None, n=1, finish=None
):
    """A finished RequestOutput whose first sample's tokens came out at `token_times` (n samples
    alike)."""
    m = RequestMetrics(
        arrival_time=arrival,
        first_scheduled_time=scheduled,
        first_token_time=token_times[0] if token_times else None,
        finish_time=finish if finish is not None else (token_times or [arrival])[-1],
    )
    for t in token_times:
        m.record_token(t)
    samples = [
        CompletionOutput(i, "", list(range(len(token_times))), finish_reason=reason)
        for i in range(n)
    ]
    return RequestOutput("r", None, list(range(prompt_len)), None, samples, True, m, error)


def families(metrics: ServerMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(metrics.text())}


def test_the_text_parses_with_vllms_names_types_and_model_name():
    m = ServerMetrics("tiny-llama")
    m.publish_gauges(IDLE)
    fams = families(m)
    assert {name: fams[name].type for name in VLLM_NAMES} == VLLM_NAMES
    for name, fam in fams.items():
        if (
            name != "vllm:cache_config_info"
        ):  # an info gauge: its labels describe the cache (as vLLM's)
            assert all(s.labels["model_name"] == "tiny-llama" for s in fam.samples), name
    assert {
        "minicb:num_requests_swapped",
        "minicb:kv_blocks_used",
        "minicb:kv_blocks_free",
        "minicb:kv_blocks_total",
        "minicb:engine_steps",
        "minicb:batch_size",
    } <= set(fams)
    assert not [name for name in fams if not name.startswith(("vllm:", "minicb:"))]
    # Every finish reason is there from the start, at 0, so that a rate() has a first value.
    success = {
        s.labels["finished_reason"]: s.value
        for s in fams["vllm:request_success"].samples
        if s.name == "vllm:request_success_total"
    }
    assert success == dict.fromkeys(FINISH_REASONS, 0.0)


def test_histograms_count_what_was_observed():
    m = ServerMetrics("tiny")
    # Arrives at 10.0, scheduled at 10.5, tokens at 11.0, 11.1, 11.2 and, after a stall, 12.2.
    m.record_finished([finished(10.0, 10.5, [11.0, 11.1, 11.2, 12.2], prompt_len=7, n=2)])
    p = parse_metrics(m.text())
    hist = lambda name: (p[f"{name}_count"], p[f"{name}_sum"])
    assert hist("vllm:time_to_first_token_seconds") == (1, pytest.approx(1.0))
    assert hist("vllm:request_queue_time_seconds") == (1, pytest.approx(0.5))
    # TTFT = queue + prefill
    assert hist("vllm:request_prefill_time_seconds") == (1, pytest.approx(0.5))
    assert hist("vllm:request_decode_time_seconds") == (1, pytest.approx(1.2))
    assert hist("vllm:e2e_request_latency_seconds") == (1, pytest.approx(2.2))
    # TPOT: the mean gap
    assert hist("vllm:request_time_per_output_token_seconds") == (1, pytest.approx(0.4))
    assert hist("vllm:inter_token_latency_seconds") == (3, pytest.approx(1.2))  # ITL: every gap
    # Buckets are cumulative: two gaps of 0.1 are at most 0.1, the stall of 1.0 only from le=1.0 on.
    assert p['vllm:inter_token_latency_seconds_bucket{le="0.075"}'] == 0
    # 0.1 itself, within float rounding
    assert p['vllm:inter_token_latency_seconds_bucket{le="0.1"}'] == 2
    assert p['vllm:inter_token_latency_seconds_bucket{le="0.75"}'] == 2
    assert (
        p['vllm:inter_token_latency_seconds_bucket{le="1.0"}']
        == 3
        == p['vllm:inter_token_latency_seconds_bucket{le="+Inf"}']
    )
    assert hist("vllm:request_prompt_tokens") == (1, 7) and p["vllm:prompt_tokens_total"] == 7
    assert hist("vllm:request_generation_tokens") == (1, 8)  # both samples' 4 tokens
    assert p['vllm:request_success_total{finished_reason="length"}'] == 1


def test_requests_without_tokens_count_but_observe_only_what_they_have():
    m = ServerMetrics("tiny")
    m.record_finished(
        [
            finished(1.0, None, [], reason="abort", finish=3.0),  # aborted while waiting
            finished(1.0, 1.2, [1.5], reason="stop"),  # one token: no gap, no TPOT
            finished(1.0, 1.1, [1.3, 1.4], reason="length", error="sampler failed"),
        ]
    )
    m.count_error()  # a request the engine loop gave up on without an output
    p = parse_metrics(m.text())
    assert [p[f'vllm:request_success_total{{finished_reason="{r}"}}'] for r in FINISH_REASONS] == [
        1,
        0,
        1,
        2,
    ]
    assert p["vllm:prompt_tokens_total"] == 2 * 5  # the aborted request's prompt never ran
    assert (
        p["vllm:request_prompt_tokens_count"] == 3
        and p["vllm:e2e_request_latency_seconds_count"] == 3
    )
    assert p["vllm:e2e_request_latency_seconds_sum"] == pytest.approx(2.0 + 0.5 + 0.4)
    assert (
        p["vllm:time_to_first_token_seconds_count"] == 2
        and p["vllm:request_queue_time_seconds_count"] == 2
    )
    assert p["vllm:request_time_per_output_token_seconds_count"] == 1  # only the two-token request
    assert p["vllm:inter_token_latency_seconds_count"] == 1
    assert set(REQUEST_HISTOGRAMS) <= {k.removesuffix("_count") for k in p}


def test_steps_rejections_and_gauges():
    m = ServerMetrics("tiny")
    for rows, tokens, preempted in ((1, 1, 0), (3, 3, 0), (4, 2, 1)):
        m.record_step(rows, tokens, preempted)
    m.count_rejected()
    m.publish_gauges({**IDLE, "num_requests_running": 2, "kv_blocks_used": 6, "kv_blocks_free": 2})
    p = parse_metrics(m.text())
    assert (
        p["minicb:engine_steps_total"] == 3 == m.num_steps
        and p["vllm:generation_tokens_total"] == 6
    )
    assert p["vllm:num_preemptions_total"] == 1 and p["vllm:admission_rejections_total"] == 1
    assert (
        p['minicb:batch_size_bucket{le="1.0"}'] == 1
        and p['minicb:batch_size_bucket{le="4.0"}'] == 3
    )
    assert p["minicb:batch_size_sum"] == 8
    assert p["vllm:num_requests_running"] == 2 and p["vllm:kv_cache_usage_perc"] == 0.75
    assert p['vllm:cache_config_info{block_size="16",num_gpu_blocks="8"}'] == 1
    assert m.value("vllm:num_requests_running") == 2 and m.value("vllm:nothing") is None
    assert repr(m) == "ServerMetrics('tiny', running=2, waiting=0, kv_blocks_used=6/8, steps=3)"


def test_two_servers_in_one_process_share_nothing():
    a, b = ServerMetrics("a"), ServerMetrics("b")
    a.record_step(2, 2)
    a.record_finished([finished(0.0, 0.0, [0.1, 0.2])])
    a.publish_gauges({**IDLE, "num_requests_running": 1})
    b.publish_gauges(IDLE)
    pa, pb = parse_metrics(a.text()), parse_metrics(b.text())
    assert pa["minicb:engine_steps_total"] == 1 and pb["minicb:engine_steps_total"] == 0
    assert (
        pa["vllm:time_to_first_token_seconds_count"] == 1
        and pb["vllm:time_to_first_token_seconds_count"] == 0
    )
    assert (pa["vllm:num_requests_running"], pb["vllm:num_requests_running"]) == (1, 0)
    assert 'model_name="a"' not in b.text()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_gauges_agree_with_a_real_scheduler(mode):
    # 6 requests, 2 slots and 6 blocks of 4 tokens: requests wait, and some are preempted for
    # memory.
    config = EngineConfig(
        max_num_seqs=2,
        block_size=4,
        num_blocks=6,
        preemption_mode=mode,
        enable_prefix_caching=False,
    )
    m, seen = ServerMetrics("sim"), []

    def on_step(sched, out):
        stats = scheduler_stats(sched)
        m.publish_gauges(stats)
        # as the engine loop does
        m.record_step(len(out.scheduled), 0, len(out.preempted) + len(out.swapped_out))
        p = parse_metrics(m.text())
        assert stats == dict(
            num_requests_running=len(sched.running),
            num_requests_waiting=len(sched.waiting),
            num_requests_swapped=len(sched.swapped),
            kv_blocks_used=sched.block_manager.num_used_blocks,
            kv_blocks_free=sched.block_manager.num_free_blocks,
            kv_blocks_total=6,
            block_size=4,
            spec_decode_num_drafts=0,
            spec_decode_num_draft_tokens=0,
            spec_decode_num_accepted_tokens=0,
            prefix_cache_queries=sched.prefix_cache_queries,
            prefix_cache_hits=sched.prefix_cache_hits,
            kv_offload_hits=0,
            kv_offload_blocks_stored=0,
            kv_offload_blocks_loaded=0,
        )
        assert stats["kv_blocks_used"] + stats["kv_blocks_free"] == 6
        assert stats["num_requests_running"] + stats["num_requests_waiting"] + stats[
            "num_requests_swapped"
        ] == len(sched.requests)
        assert (
            p["vllm:num_requests_running"],
            p["vllm:num_requests_waiting"],
            p["minicb:num_requests_swapped"],
            p["minicb:kv_blocks_used"],
            p["minicb:kv_blocks_free"],
            p["minicb:kv_blocks_total"],
        ) == tuple(
            stats[k]
            for k in (
                "num_requests_running",
                "num_requests_waiting",
                "num_requests_swapped",
                "kv_blocks_used",
                "kv_blocks_free",
                "kv_blocks_total",
            )
        )
        assert p["vllm:kv_cache_usage_perc"] == pytest.approx(stats["kv_blocks_used"] / 6)
        seen.append(stats)

    res = simulate([SimRequest(4, 10) for _ in range(6)], config, on_step=on_step)
    assert max(s["num_requests_waiting"] for s in seen) >= 4
    preemptions = sum(r.num_preemptions for r in res.requests)
    assert preemptions > 0 and m.value("vllm:num_preemptions_total") == preemptions
    if mode == "swap":
        assert max(s["num_requests_swapped"] for s in seen) >= 1
    m.publish_gauges(scheduler_stats(res.scheduler))  # all done: every block free again
    assert (m.value("vllm:num_requests_running"), m.value("minicb:kv_blocks_free")) == (0, 6)


def test_speculative_counters_follow_the_engines_totals():
    """The engine reports totals; the counters add only what is new, so publishing twice counts
    nothing twice."""
    from minicb.spec_decode.ngram_proposer import SpecDecodingStats

    class Engine:  # what engine_stats reads
        def __init__(self, scheduler, stats):
            self.scheduler, self.runner = scheduler, type("Runner", (), {"spec_stats": stats})()
            self.kv_cache = type("KVCache", (), {"block_bytes": 64})()  # the CPU tier's bytes

    stats, m = SpecDecodingStats(), ServerMetrics("spec")
    engine = Engine(Scheduler(EngineConfig(num_blocks=8)), stats)
    stats.observe(4, 3)
    m.publish_gauges(engine_stats(engine))
    m.publish_gauges(engine_stats(engine))
    stats.observe(4, 0)
    m.publish_gauges(engine_stats(engine))
    p = parse_metrics(m.text())
    assert (
        p["vllm:spec_decode_num_drafts_total"],
        p["vllm:spec_decode_num_draft_tokens_total"],
        p["vllm:spec_decode_num_accepted_tokens_total"],
    ) == (2, 8, 3)


def test_prefix_cache_counters_count_each_requests_first_admission():
    """vllm:prefix_cache_queries / _hits (tokens): a request's prompt once, at its first admission,
    and the full blocks the cache gave it; a recompute after preemption counts nothing again."""
    shared = list(range(1, 13))  # three full blocks of 4
    requests = [
        SimRequest(prompt_len=14, output_len=3, prompt_token_ids=shared + [50, 51]),
        SimRequest(
            prompt_len=15, output_len=3, arrival_step=5, prompt_token_ids=shared + [60, 61, 62]
        ),
        SimRequest(prompt_len=6, output_len=2, arrival_step=5),  # nothing shared
    ]
    m = ServerMetrics("cache")
    result = simulate(
        requests,
        EngineConfig(block_size=4, num_blocks=64, max_num_seqs=4),
        on_step=lambda sched, out: m.publish_gauges(scheduler_stats(sched)),
    )
    p = parse_metrics(m.text())
    assert p["vllm:prefix_cache_queries_total"] == 14 + 15 + 6
    assert p["vllm:prefix_cache_hits_total"] == 12  # the second request's three shared blocks
    assert result.num_steps > 0

    # under preemption: each request still counted once
    m, sched_seen = ServerMetrics("preempt"), []

    def publish(sched, out):
        sched_seen.append(len(out.preempted))
        m.publish_gauges(scheduler_stats(sched))

    many = [SimRequest(prompt_len=8, output_len=12) for _ in range(6)]
    simulate(many, EngineConfig(block_size=4, num_blocks=14, max_num_seqs=6), on_step=publish)
    assert sum(sched_seen) > 0, "the workload was meant to preempt"
    p = parse_metrics(m.text())
    assert p["vllm:prefix_cache_queries_total"] == 6 * 8
