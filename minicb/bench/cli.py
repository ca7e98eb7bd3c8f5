"""Benchmark workloads (see the project's bench-workloads page) and `python -m minicb bench`.

    --workload w1    mixed-length chat on the CPU, four systems side by side (minicb/bench_w1.py)
    --workload w2    the nano-vllm / vLLM offline workload on a CUDA GPU (minicb/bench_gpu.py)
    --workload w3    scheduler overhead, model-free (this file)
    --workload all   w3, then w2 (skipped with the reason when there is no GPU), then w1

W3 asks what the scheduler costs on the critical path between two model steps: with
`num_running` requests all decoding, how much CPU time do `Scheduler.schedule()` and
`Scheduler.update()` (plus, optionally, recording the step's trace and building the flat input
lists the model runner would turn into tensors) take per step? No model runs: the scripted
"model" returns token 1 for every row, as in `minicb.sim`. A GPU decode step of a small model
takes a few milliseconds, so this overhead should stay well under 1 ms at 256 running requests,
and grow linearly with the number of requests (the per-request column should stay flat).

    python -m minicb bench --workload w3          # the table for 64/128/256/512 requests
"""

import json
import statistics
import time

from .config import EngineConfig
from .request import Request
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .trace import Trace

W3_PROMPT_LEN = 32  # tokens per prompt: two blocks of 16, prefilled before timing starts
W3_SIZES = (64, 128, 256, 512)


def host_inputs(out, block_size: int):
    """The pure-Python part of input preparation: the flat lists a model runner turns into
    tensors (input_ids, positions, cache_locs, context_lens, query_start_loc, block tables)."""
    input_ids, positions, cache_locs, context_lens, query_start_loc, tables = [], [], [], [], [0], []
    for row in out.scheduled:
        start, n, table = row.start, row.num_tokens, row.block_table
        input_ids += row.request.token_ids[start:start + n]
        positions += range(start, start + n)
        # cache location = block_id * block_size + offset: where this token's K/V is written
        cache_locs += [table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]
        context_lens.append(start + n)
        query_start_loc.append(query_start_loc[-1] + n)
        tables.append(table)
    return input_ids, positions, cache_locs, context_lens, query_start_loc, tables


def w3_scheduler(num_running: int, steps: int, block_size: int = 16, warmup: int = 5) -> Scheduler:
    """A scheduler holding `num_running` decoding requests, with room for `warmup + steps` more
    decode steps: outputs are long enough that nobody finishes, and the cache has the blocks."""
    budget = max(2048, num_running)  # every decode of a step fits in the token budget
    # Prompts beyond the budget prefill over several steps, while the first ones already decode.
    prefill_steps = -(-num_running * W3_PROMPT_LEN // budget)
    max_tokens = prefill_steps + warmup + steps + 8  # never reached while timing: all stay running
    blocks_per_req = -(-(W3_PROMPT_LEN + max_tokens) // block_size)
    config = EngineConfig(block_size=block_size, num_blocks=num_running * blocks_per_req,
                          max_num_seqs=num_running, max_num_batched_tokens=budget,
                          enable_prefix_caching=True, record_trace=False)
    sched = Scheduler(config)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(num_running):
        prompt = [1000 * (i + 1) + j for j in range(W3_PROMPT_LEN)]  # distinct: no prefix sharing
        sched.add_request(Request(f"r{i}", prompt, params, arrival_index=i))
    # Prefill everyone (several steps when the prompts exceed the token budget), then warm up.
    while any(r.num_output_tokens == 0 for r in sched.requests.values()):
        _scripted_step(sched)
    for _ in range(warmup):
        _scripted_step(sched)
    assert len(sched.running) == num_running and not sched.waiting, "W3 setup: not all running"
    return sched


def _scripted_step(sched: Scheduler):
    out = sched.schedule()
    sched.update(out, [1] * sum(1 for s in out.scheduled if s.do_sample))
    return out


def run_w3(num_running: int = 256, steps: int = 200, with_trace: bool = False,
           with_inputs: bool = False, block_size: int = 16) -> dict:
    """Median CPU time per step of schedule() + update() (+ Trace.record, + host_inputs) with
    `num_running` requests decoding. Times are process CPU time (time.process_time_ns), so other
    processes on the machine do not inflate them."""
    sched = w3_scheduler(num_running, steps, block_size)
    trace = Trace(num_running, sched.config.num_blocks, block_size) if with_trace else None
    per_step = []
    clock = time.process_time_ns
    for _ in range(steps):
        t0 = clock()
        out = sched.schedule()
        if with_inputs:
            host_inputs(out, block_size)
        sched.update(out, [1] * len(out.scheduled))  # every row is a decode: one token each
        if trace is not None:
            trace.record(sched, out, sched.take_finished())
        per_step.append(clock() - t0)
        assert len(out.scheduled) == num_running, "W3: a request stopped running while timed"
    median_ns = statistics.median(per_step)
    return {
        "workload": "w3",
        "num_running": num_running,
        "steps": steps,
        "with_trace": with_trace,
        "with_inputs": with_inputs,
        "block_size": block_size,
        "median_ms_per_step": median_ns / 1e6,
        "p90_ms_per_step": sorted(per_step)[int(0.9 * (len(per_step) - 1))] / 1e6,
        "us_per_request": median_ns / 1e3 / num_running,
    }


def w3_table(sizes=W3_SIZES, steps: int = 200, print_fn=print) -> list[dict]:
    """Run W3 for each size, without and with trace recording, and print one table. Linear
    growth shows as a flat "us/request" column."""
    rows = []
    print_fn("W3 scheduler overhead: CPU time per step (median), all requests decoding")
    print_fn(f"{'running':>8} {'sched+update ms':>16} {'us/request':>11} {'+trace ms':>10} "
             f"{'us/request':>11} {'+trace+inputs ms':>17}")
    for n in sizes:
        plain = run_w3(n, steps)
        traced = run_w3(n, steps, with_trace=True)
        full = run_w3(n, steps, with_trace=True, with_inputs=True)
        rows += [plain, traced, full]
        print_fn(f"{n:>8} {plain['median_ms_per_step']:>16.3f} {plain['us_per_request']:>11.2f} "
                 f"{traced['median_ms_per_step']:>10.3f} {traced['us_per_request']:>11.2f} "
                 f"{full['median_ms_per_step']:>17.3f}")
    return rows


def add_arguments(parser) -> None:
    """Options of `python -m minicb bench`."""
    parser.add_argument("--workload", choices=["w1", "w2", "w3", "all"], default="w3",
                        help="w1: CPU chat side by side; w2: GPU offline (needs CUDA); w3: scheduler overhead")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(W3_SIZES),
                        help="W3: numbers of running requests (default: 64 128 256 512)")
    parser.add_argument("--steps", type=int, default=200, help="W3: timed steps per size")
    parser.add_argument("--competitors", nargs="+", default=None,
                        help="W1: a subset of hf_static hf_continuous minicb_static minicb_continuous_16 minicb_continuous")
    parser.add_argument("--cooldown", type=float, default=20.0,
                        help="W1: idle seconds before each competitor after the first, so that none runs on a "
                             "machine still slowed by the previous one (default 20)")
    parser.add_argument("--model", default=None, help="W2: model dir or hub id (default Qwen3-0.6B from the HF cache)")
    parser.add_argument("--figures-dir", default="figures", help="W1: where the comparison figure goes")
    parser.add_argument("--json", default=None, help="write the results to this JSON file")


def _w2(args) -> dict:
    import torch

    if not torch.cuda.is_available():
        print("W2 skipped: it needs a CUDA GPU and torch.cuda.is_available() is False on this machine")
        return {"skipped": "no CUDA GPU"}
    from .bench_gpu import run_w2

    rows = [run_w2(args.model, use_cuda_graph=graphs) for graphs in (False, True)]
    for r in rows:
        print(r)
    print(f"CUDA graphs speed-up on W2: {rows[1]['output_tokens_per_s'] / rows[0]['output_tokens_per_s']:.2f}x")
    return {"w2": rows}


def _w1(args) -> dict:
    from pathlib import Path

    from .bench_w1 import COMPETITORS, print_w1, run_w1, w1_figure

    report = run_w1(competitors=args.competitors or COMPETITORS, cooldown_s=args.cooldown)
    for r in report["results"]:
        r.pop("trace", None)
    print_w1(report)
    Path(args.figures_dir).mkdir(parents=True, exist_ok=True)
    path = Path(args.figures_dir) / "bench_w1.png"
    w1_figure(report).savefig(path, dpi=110, bbox_inches="tight")
    print(f"wrote {path}")
    return {"w1": report}


def main(args) -> None:
    """Entry point of `python -m minicb bench`."""
    results = {}
    if args.workload in ("w3", "all"):
        results["w3"] = w3_table(sizes=args.sizes, steps=args.steps)
    if args.workload in ("w2", "all"):
        results |= _w2(args)
    if args.workload in ("w1", "all"):
        results |= _w1(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
