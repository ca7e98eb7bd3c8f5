"""W3 (scheduler overhead) smoke test: tiny sizes, checks the shape of the results, not the
speed."""

import argparse
import json
import math
import os
import random

import pytest
import torch

from minicb.bench import cli as bench
from minicb.bench import w3
from minicb.model_executor.attention import cache_locations
from minicb.worker.model_runner import host_inputs


def test_w3_setup_has_everyone_decoding():
    sched = w3.w3_scheduler(num_running=6, steps=4)
    assert len(sched.running) == 6 and not sched.waiting and not sched.swapped
    out = sched.schedule()
    assert len(out.scheduled) == 6 and out.num_decode_rows == 6 and out.num_batched_tokens == 6


def test_run_w3_smoke():
    for kw in ({}, {"with_trace": True}, {"with_trace": True, "with_inputs": True}):
        res = w3.run_w3(num_running=8, steps=5, **kw)
        assert res["workload"] == "w3" and res["num_running"] == 8 and res["steps"] == 5
        assert 0 < res["median_ms_per_step"] <= res["p90_ms_per_step"]
        assert res["us_per_request"] == pytest.approx(res["median_ms_per_step"] * 1000 / 8)
        assert res["with_trace"] == kw.get("with_trace", False)


def test_w3_table_prints_one_row_per_size():
    lines = []
    rows = w3.w3_table(sizes=(4, 8), steps=3, print_fn=lines.append)
    assert [r["num_running"] for r in rows] == [4, 4, 4, 8, 8, 8]
    assert len(lines) == 2 + 2 and lines[2].split()[0] == "4" and lines[3].split()[0] == "8"


def test_w3_times_the_runners_own_input_code():
    # W3's "+inputs" column runs model_runner.host_inputs, the code the engine runs, not a copy.
    sched = w3.w3_scheduler(num_running=3, steps=2, block_size=16)
    out = sched.schedule()
    h = host_inputs(out, 16)
    locs = cache_locations(h.block_tables, h.context_lens, h.query_lens, 16)
    assert len(h.input_ids) == len(h.positions) == len(locs) == 3 and h.query_lens == [1, 1, 1]
    assert h.num_decodes == 3 and h.sample_rows == [0, 1, 2]
    for row, p, loc, c in zip(out.scheduled, h.positions, locs, h.context_lens):
        assert p == row.start and c == row.start + 1
        assert loc == row.block_table[p // 16] * 16 + p % 16


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU-only behaviour")
def test_w2_skips_with_a_reason_without_a_gpu(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    path = tmp_path / "w2.json"
    bench.main(parser.parse_args(["--workload", "w2", "--json", str(path)]))
    assert "W2 skipped: it needs a CUDA GPU" in capsys.readouterr().out
    assert json.loads(path.read_text()) == {"skipped": "no CUDA GPU"}


def test_cli_options_and_json(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    path = tmp_path / "w3.json"
    args = parser.parse_args(
        ["--workload", "w3", "--sizes", "4", "--steps", "3", "--json", str(path)]
    )
    bench.main(args)
    rows = json.loads(path.read_text())["w3"]
    assert [r["num_running"] for r in rows] == [4, 4, 4]
    assert "W3 scheduler overhead" in capsys.readouterr().out


def test_gemm_peaks_measure_every_cpu_kernel():
    from minicb.bench.machine import cpu_model
    from minicb.model_executor.cpu_kernels import gemm_peaks

    peaks = gemm_peaks(n=128, repeats=2)
    assert "torch.matmul" in peaks and all(v > 0 for v in peaks.values())
    if torch.backends.mkldnn.is_available():
        assert "oneDNN packed" in peaks  # the kernel PackedLinear runs must be in the peak
    assert cpu_model()


FLOOR = dict(
    floor_s=9.1,
    binding="compute",
    flops={"total": 1.74e12},
    gemm_peak_flops=190e9,
    compute_s=9.1,
    longest_output=256,
    weight_bytes=538e6,
    bandwidth=22.4e9,
    sequential_s=6.1,
)


def test_w1_table_names_both_peaks(capsys):
    from minicb.bench.w1_report import print_w1

    row = dict(
        name="minicb continuous (64 slots)",
        throughput=300.0,
        wall_s=13.0,
        ttft_p50=1.0,
        ttft_p99=1.5,
        tpot_p50=0.1,
        tpot_p99=0.2,
        peak_mem_mib=5,
        slot_utilization=0.24,
        achieved_gflops=80.0,
        roofline_fraction=0.2,
        floor_fraction=9.1 / 13.0,
    )
    print_w1(
        dict(
            machine="2 cores of a CPU",
            num_requests=64,
            prompt_tokens=3103,
            output_tokens=3920,
            floor=FLOOR,
            gemm_peak_gflops=400.0,
            gemm_peaks={"torch.matmul": 190.0, "oneDNN packed": 400.0},
            flops_per_token=269e6,
            results=[row],
            decode_step=dict(
                batch=64, context=100, step_ms=140.0, gflops=120.0, gemm_peak_gflops=400.0
            ),
        )
    )
    out = capsys.readouterr().out
    assert (
        "GEMM peak 400 GFLOP/s (float32, the best of: torch.matmul 190, oneDNN packed 400)" in out
    )
    assert "= 30% of the GEMM peak (63% of torch.matmul)" in out
    assert "24%" in out  # slot utilization
    assert out.splitlines()[3].endswith("70%")  # 'of floor': floor / wall = 9.1 / 13.0
    assert (
        "the machine's floor for W1: 9.1 s (compute binds): compute 1.74 TFLOP / 190 GFLOP/s "
        "= 9.1 s" in out
    )


def test_w1_table_separates_the_schedulers_gain_from_the_batch_size(capsys):
    """Continuous vs static at the same 16 slots is the scheduler's gain; 64 vs 16 slots is the
    batch."""
    from minicb.bench.w1_report import print_w1

    def row(key, name, tok_s):
        return dict(
            key=key,
            name=name,
            throughput=tok_s,
            wall_s=10.0,
            ttft_p50=1.0,
            ttft_p99=1.5,
            tpot_p50=0.1,
            tpot_p99=0.2,
            peak_mem_mib=5,
            achieved_gflops=1.0,
            roofline_fraction=0.1,
            floor_fraction=0.5,
        )

    rows = [
        row("minicb_static", "minicb static (16 slots)", 100.0),
        row("minicb_continuous_16", "minicb continuous (16 slots)", 250.0),
        row("minicb_continuous", "minicb continuous (64 slots)", 300.0),
    ]
    print_w1(
        dict(
            machine="m",
            num_requests=64,
            prompt_tokens=1,
            output_tokens=1,
            gemm_peak_gflops=1.0,
            floor=FLOOR,
            gemm_peaks={"torch.matmul": 1.0},
            flops_per_token=1.0,
            results=rows,
            decode_step=dict(batch=64, context=100, step_ms=1.0, gflops=1.0, gemm_peak_gflops=1.0),
        )
    )
    out = capsys.readouterr().out
    assert "continuous vs static batching, both 16 slots: 2.5x" in out
    assert "64 slots vs 16, both continuous: 1.2x" in out


def test_spec_bench_compares_the_same_outputs_and_prints_the_ratios(tmp_path, capsys):
    """The speculative bench on a tiny model: both runs give the same tokens, the ratios are
    computed from them, and the table prints a row per run; a proposer that changed an output would
    make it raise."""
    from minicb.bench import spec
    from minicb.model_executor.loader import load_model, save_tiny_model

    loaded = load_model(save_tiny_model(tmp_path, arch="llama", seed=1), dtype=torch.float32)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9]]
    # one-token lookups: a random model's loops are drafted too
    config = dict(spec.SPEC, prompt_lookup_min=1)
    res = spec.compare(
        loaded,
        prompts,
        [24, 24],
        ignore_eos=True,
        repeats=1,
        cooldown_s=0,
        max_num_seqs=2,
        speculative_config=config,
    )
    off, on = res["off"], res["on"]
    assert (
        off["output_tokens"] == on["output_tokens"] == 48
        and on["drafts"] > 0
        and off["drafts"] == 0
    )
    assert res["step_ratio"] == off["decode_steps"] / on["decode_steps"]
    assert res["same_outputs"] == 1.0 and on["dtype"] == off["dtype"] == "float32"
    assert res["speedup"] == on["throughput"] / off["throughput"]
    spec.print_spec(
        dict(
            speculative_config=spec.SPEC,
            machine="test",
            results={"c1@2": res | dict(num_requests=2)},
        )
    )
    out = capsys.readouterr().out
    assert "c1@2" in out and "fewer decode steps" in out and f"{on['acceptance_rate']:.0%}" in out


def test_w1_table_prints_the_kernels_floor_and_the_ratio_it_allows(capsys):
    """The kernels' floor caps both targets: the fraction of the floor and the ratio to
    transformers."""
    from minicb.bench.w1_report import print_w1

    def row(key, name, wall):
        return dict(
            key=key,
            name=name,
            throughput=3920 / wall,
            wall_s=wall,
            ttft_p50=1.0,
            ttft_p99=1.5,
            tpot_p50=0.1,
            tpot_p99=0.2,
            peak_mem_mib=5,
            achieved_gflops=1.0,
            roofline_fraction=0.1,
            floor_fraction=9.1 / wall,
        )

    kernels = dict(
        kernel_s=26.0,
        layers_s=22.0,
        lm_head_s=4.0,
        passes=262,
        other=dict(chain=256, tail_s=23.0, even_s=24.0),
    )
    print_w1(
        dict(
            machine="m",
            num_requests=64,
            prompt_tokens=3103,
            output_tokens=3920,
            gemm_peak_gflops=1.0,
            floor=FLOOR | {"kernels": kernels},
            gemm_peaks={"torch.matmul": 1.0},
            flops_per_token=1.0,
            results=[
                row("hf_continuous", "transformers continuous batching", 104.0),
                row("minicb_continuous", "minicb continuous (64 slots)", 40.0),
            ],
            decode_step=dict(batch=64, context=100, step_ms=1.0, gflops=1.0, gemm_peak_gflops=1.0),
        )
    )
    out = capsys.readouterr().out
    assert "22.0 s of layers + 4.0 s of LM head = 26.0 s." in out
    assert "Batched so, these kernels allow at most 35% of the floor" in out
    assert "the same rows over the 256 passes the longest request needs" in out
    assert (
        "rest in full passes 23.0 s; spread evenly 24.0 s: at most 40% of the floor either way"
        in out
    )
    assert (
        "minicb vs transformers, continuous batching: 2.6x (batched as fully, these kernels allow "
        "at most 4.0x)" in out
    )


def test_busy_union_counts_overlapping_kernels_once():
    """The GPU idle share (bench --workload idle) is the window minus this union."""
    from minicb.bench.gpu_step import busy_union_us

    assert busy_union_us([]) == 0
    assert busy_union_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert busy_union_us([(20, 25), (0, 10), (10, 11)]) == 16


def test_idle_split_separates_a_graphs_own_gaps_from_the_gaps_between_steps():
    """bench --workload idle: two replays of a graph (id 7 and 9, three kernels each with 1 us
    gaps), a sampling kernel (id 8) after the first, and the device idle 5 us before the second."""
    from minicb.bench.gpu_step import idle_split

    kernels = [(0, 4, 7), (5, 9, 7), (10, 14, 7), (14, 16, 8)]
    kernels += [(21, 25, 9), (26, 30, 9), (31, 35, 9), (35, 36, 0)]
    split = idle_split(kernels, min_graph_kernels=3)
    assert split["graph_replays"] == 2 and split["window_us"] == 36
    assert split["idle_us"] == 9  # 2 + 5 + 2
    assert split["idle_in_graphs_us"] == 4 and split["idle_between_us"] == 5
    # keyed per kernel (no replay found), every gap counts as between the steps
    assert (
        idle_split([(s, e, i + 1) for i, (s, e, _) in enumerate(kernels)], 3)["idle_between_us"]
        == 9
    )


def test_print_loop_gives_the_faster_and_the_median_runs_ratio(capsys):
    """bench --workload loop: one lucky synchronous run (20 s) must not decide the ratio alone."""
    from minicb.bench.loop import print_loop

    side = dict(tok_s=100.0, wall_s=1.0, host_share=0.01, device_idle_share=0.01)
    side |= dict(schedule_inputs_ms=0, forward_ms=0, sample_ms=0, outputs_ms=0, detokenize_ms=0)
    w1 = dict(same_tokens=True, sync=side | {"tok_s": 150.0}, async_=side | {"tok_s": 120.0})
    w1 |= dict(sync_walls=[30.0, 20.0, 30.0], async_walls=[25.0, 26.0, 25.0])
    print_loop({"machine": "test", "w1": w1})
    assert (
        "async / sync = 0.800x, the faster runs; 1.200x, the median runs" in capsys.readouterr().out
    )


def test_loop_shares_from_step_times():
    """bench --workload loop: host share and device idle from hand-made StepTimes (seconds)."""
    from minicb.bench.loop import loop_shares
    from minicb.trace import RowRecord, StepRecord, StepTimes

    def record(step, *t):
        rows = [RowRecord("a", 0, step, 1, False, True)]
        return StepRecord(step, rows, {}, 0, 0, 0, 1, 0, 1, 0, times=StepTimes(*t))

    # schedule, launch, device start, forward end, sample start, device end, outputs start, end
    steps = [record(1, 0, 1, 1, 8, 8, 9, 9, 10), record(2, 10, 11, 11, 18, 18, 19, 19, 20)]
    shares = loop_shares(steps, wall_s=20)
    assert shares["host_share"] == pytest.approx(4 / 20)  # 1 + 1 per step
    assert shares["device_idle_share"] == pytest.approx(2 / 20)  # 9 -> 11
    assert shares["forward_ms"] == pytest.approx(7000) and shares["steps"] == 2


def test_median_interval_holds_the_median_as_often_as_it_says():
    """The sign test's interval, on exact cases and by drawing: from a skewed distribution whose
    median is known (exponential: ln 2), the interval of 10 draws holds it in at least 95% of
    4000 trials (exactly 97.9% in theory: 1 - 2 * 11/1024)."""
    from minicb.bench.machine import median_interval

    assert median_interval([3, 1, 2, 5, 4]) is None  # 5 draws: 2/32 > 5%, no interval at 95%
    assert median_interval([3, 1, 2, 5, 4], 0.90) == (1, 5)
    assert median_interval([6, 3, 1, 2, 5, 4]) == (1, 6)
    assert median_interval(list(range(40))) == (13, 26)  # P(B <= 13) = 1.9%, P(B <= 14) = 4.0%
    rng = random.Random(0)
    median = math.log(2)
    held = 0
    for _ in range(4000):
        lo, hi = median_interval([rng.expovariate(1.0) for _ in range(10)])
        held += lo <= median <= hi
    assert held / 4000 >= 0.96


def test_contention_steps_one_engine_with_its_neighbour_off_and_on_in_turn(tmp_path):
    # The measure (minicb/bench/contention.py), not its figure: every step is timed on its side,
    # the neighbour works only while on, and the engine's requests are still running at the end
    # (every timed step was a decode step of all its rows). Timings are printed, never asserted.
    from minicb import LLM
    from minicb.bench.contention import busy_engine, measure, report
    from minicb.model_executor.loader import save_tiny_model

    llm = LLM(model=str(save_tiny_model(tmp_path, arch="llama", seed=1)), dtype="float32")
    engine = busy_engine(llm, rows=4, steps=2 * 3 * 4)
    r = measure(engine, period_s=0.001, work_s=0.0002, block=3, blocks=4)
    print(report(r))
    assert len(r["steps"]["off"]) == len(r["steps"]["on"]) == 12
    assert 0 < r["neighbour_share"] <= 1 and r["wanted_share"] == pytest.approx(
        0.2 / 1.2 / os.cpu_count()
    )
    assert len(engine.scheduler.running) == 4 and not engine.scheduler.waiting


def test_contention_command_line_names_the_machine_and_the_engines_threads(tmp_path, capsys):
    from minicb.bench.contention import main
    from minicb.model_executor.loader import save_tiny_model

    path = str(save_tiny_model(tmp_path, arch="llama", seed=1))
    threads = torch.get_num_threads()
    try:
        main(["--model", path, "--dtype", "float32", "--rows", "2", "--block", "2"])
        main(
            ["--model", path, "--dtype", "float32", "--rows", "2", "--block", "2", "--threads", "1"]
        )
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert f"2 rows decoding on {threads} torch threads" in out
    assert "2 rows decoding on 1 torch threads" in out and out.count("neighbour (normal") == 2
