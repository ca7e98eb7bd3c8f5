"""W3, scheduler overhead: the CPU time spent between two model steps, with no model at all.

With `num_running` requests all decoding, how long do `Scheduler.schedule()` and
`Scheduler.update()` take per step, plus (optionally) recording the step's trace and building the
host-side input lists that the model runner turns into tensors (`model_runner.host_inputs`, the
engine's own code)? The "model" is the simulator's scripted one (token 1 for every row). A GPU
decode step of a small model takes a few milliseconds, so this overhead should stay well under 1 ms
at 256 running requests and grow linearly with the number of requests (the per-request column should
stay flat).

    python -m minicb bench --workload w3          # the table for 64/128/256/512 requests
"""

import statistics
import time

from ..config import EngineConfig, cdiv
from ..core.request import Request
from ..core.scheduler import Scheduler
from ..model_executor.attention import cache_locations
from ..sampling_params import SamplingParams
from ..sim import scripted_step
from ..trace import Trace
from ..worker.model_runner import host_inputs

W3_PROMPT_LEN = 32  # tokens per prompt: two blocks of 16, prefilled before timing starts
W3_SIZES = (64, 128, 256, 512)


def w3_scheduler(num_running: int, steps: int, block_size: int = 16, warmup: int = 5) -> Scheduler:
    """A scheduler holding `num_running` decoding requests, with room for `warmup + steps` more
    decode steps: outputs are long enough that nobody finishes, and the cache has the blocks."""
    budget = max(2048, num_running)  # every decode of a step fits in the token budget
    # Prompts beyond the budget prefill over several steps, while the first ones already decode.
    prefill_steps = cdiv(num_running * W3_PROMPT_LEN, budget)
    max_tokens = prefill_steps + warmup + steps + 8  # never reached while timing: all stay running
    blocks_per_req = cdiv(W3_PROMPT_LEN + max_tokens, block_size)
    config = EngineConfig(
        block_size=block_size,
        num_blocks=num_running * blocks_per_req,
        max_num_seqs=num_running,
        max_num_batched_tokens=budget,
        enable_prefix_caching=True,
        record_trace=False,
    )
    sched = Scheduler(config)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(num_running):
        prompt = [1000 * (i + 1) + j for j in range(W3_PROMPT_LEN)]  # distinct: no prefix sharing
        sched.add_request(Request(f"r{i}", prompt, params, arrival_index=i))
    # Prefill everyone (several steps when the prompts exceed the token budget), then warm up.
    while any(r.num_output_tokens == 0 for r in sched.requests.values()):
        scripted_step(sched)
    for _ in range(warmup):
        scripted_step(sched)
    assert len(sched.running) == num_running and not sched.waiting, "W3 setup: not all running"
    return sched


def run_w3(
    num_running: int = 256,
    steps: int = 200,
    with_trace: bool = False,
    with_inputs: bool = False,
    block_size: int = 16,
) -> dict:
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
        if with_inputs:  # the runner's host-side half of prepare_inputs, and where each K/V goes
            h = host_inputs(out, block_size)
            cache_locations(h.block_tables, h.context_lens, h.query_lens, block_size)
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
    print_fn(
        f"{'running':>8} {'sched+update ms':>16} {'us/request':>11} {'+trace ms':>10} "
        f"{'us/request':>11} {'+trace+inputs ms':>17}"
    )
    for n in sizes:
        plain = run_w3(n, steps)
        traced = run_w3(n, steps, with_trace=True)
        full = run_w3(n, steps, with_trace=True, with_inputs=True)
        rows += [plain, traced, full]
        print_fn(
            f"{n:>8} {plain['median_ms_per_step']:>16.3f} {plain['us_per_request']:>11.2f} "
            f"{traced['median_ms_per_step']:>10.3f} {traced['us_per_request']:>11.2f} "
            f"{full['median_ms_per_step']:>17.3f}"
        )
    return rows
