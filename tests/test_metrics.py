"""Serving metrics (minicb/metrics.py) on hand-made times, where every answer is known exactly."""

import math

import pytest

from minicb import LLM, SamplingParams
from minicb.core.request import RequestMetrics
from minicb.metrics import inter_token_latencies, mean_gap, percentile, summarize, tpot
from minicb.model_executor.loader import save_tiny_model
from minicb.outputs import CompletionOutput, RequestOutput


def output(arrival, token_times, scheduled=None):
    m = RequestMetrics(
        arrival_time=arrival,
        first_scheduled_time=scheduled if scheduled is not None else arrival,
        first_token_time=token_times[0],
        finish_time=token_times[-1],
    )
    for t in token_times:
        m.record_token(t)
    sample = CompletionOutput(0, "", list(range(len(token_times))), finish_reason="length")
    return RequestOutput("r", None, [1, 2], None, [sample], True, m)


def test_percentile_interpolates_like_numpy():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == pytest.approx(2.5) and percentile(xs, 99) == pytest.approx(3.97)
    assert math.isnan(percentile([], 50))


def test_tpot_is_a_mean_and_itl_keeps_every_gap():
    # Tokens at 1.0, 1.1, 1.2 and, after a stall, 2.2: TPOT averages the stall away, ITL shows it.
    out = output(0.5, [1.0, 1.1, 1.2, 2.2])
    assert tpot(out.metrics, 4) == pytest.approx(0.4)
    assert inter_token_latencies(out.metrics) == pytest.approx([0.1, 0.1, 1.0])
    assert mean_gap(1.0, 2.2, 4) == pytest.approx(0.4) and mean_gap(1.0, 1.0, 1) is None
    assert tpot(RequestMetrics(arrival_time=0.0), 4) is None  # unfinished: no TPOT yet


def test_summarize_ttft_throughput_and_stalls():
    outs = [output(0.0, [1.0, 1.5, 2.0]), output(0.0, [3.0, 3.5, 6.0], scheduled=2.0)]
    s = summarize(outs)
    assert (s.num_requests, s.output_tokens) == (2, 6)
    assert s.wall_time == pytest.approx(6.0) and s.throughput == pytest.approx(1.0)
    assert s.ttft_p50 == pytest.approx(2.0)  # TTFTs 1 and 3
    assert s.tpot_p50 == pytest.approx((0.5 + 1.5) / 2)  # TPOTs 0.5 and 1.5
    # gaps 0.5, 0.5, 0.5, 2.5
    assert s.itl_max == pytest.approx(2.5) and s.itl_p50 == pytest.approx(0.5)
    assert s.queue_p50 == pytest.approx(1.0)  # queue times 0 and 2
    assert "ITL p50 500 ms" in str(s)


def test_the_engine_records_a_time_per_token(tmp_path):
    # RequestOutput snapshots copy the times: a later step never changes an output handed out.
    llm = LLM(str(save_tiny_model(tmp_path, seed=1)), dtype="float64", block_size=4, num_blocks=32)
    seen = list(
        llm.stream([[3, 4, 5]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    )
    assert [len(o.metrics.token_times) for o in seen] == [1, 2, 3, 4]
    times = seen[-1].metrics.token_times
    assert times == sorted(times) and times[0] == seen[-1].metrics.first_token_time
    assert times[-1] == seen[-1].metrics.finish_time
