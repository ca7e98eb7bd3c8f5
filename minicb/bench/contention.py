"""What a small neighbour costs the engine on a CPU: the steps of an engine while another process
wakes up every few milliseconds and works a fraction of one (as a server's API process does for
each streamed chunk, and the load test's clients do to read it).

    python -m minicb.bench.contention                    # SmolLM2 in bfloat16 where fast, 32 rows
    python -m minicb.bench.contention --work-ms 1 --period-ms 8 --policy nice19

torch runs each operator on all its threads, which wait for one another at its end. A thread that
the neighbour takes off its core stops the operator, and the other threads wait (spinning, since
OpenMP spins a while before it sleeps). So on a machine whose every core runs one of the engine's
threads, a neighbour that uses a few percent of the machine slows each step by several times that.

The neighbour is switched on and off every `block` steps of one engine: each "on" block is set
against the "off" blocks around it in the same run, and a machine whose speed drifts from one
second to the next moves both alike. Printed: the median step with the neighbour off and on, the
slowdown, and the share of the machine the neighbour got (a neighbour at a lower priority may not
get the work done that it asked for, which a server's API process must: it would fall behind).
"""

import argparse
import multiprocessing as mp
import os
import random
import statistics
import time

POLICIES = ("normal", "nice5", "nice19", "batch")


def neighbour(ready, on, stop, done, policy: str, period_s: float, work_s: float) -> None:
    """Sleep `period_s`, then work (spin) `work_s`, over and over while `on` is set."""
    if policy.startswith("nice"):
        os.nice(int(policy[4:]))
    elif policy == "batch":  # never preempts a running thread when it wakes (sched(7))
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    ready.set()
    while not stop.is_set():
        if not on.wait(0.05):
            continue
        time.sleep(period_s)
        start = time.perf_counter()
        while time.perf_counter() - start < work_s:
            pass
        with done.get_lock():
            done.value += 1


def measure(
    engine,
    period_s: float,
    work_s: float,
    policy: str = "normal",
    block: int = 10,
    blocks: int = 16,
) -> dict:
    """Step `engine` (its requests added, enough tokens left for 2 * block * blocks steps) in
    blocks of `block` steps, the neighbour off then on, `blocks` times each."""
    ctx = mp.get_context("spawn")
    ready, on, stop, done = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Value("l", 0)
    proc = ctx.Process(
        target=neighbour, args=(ready, on, stop, done, policy, period_s, work_s), daemon=True
    )
    proc.start()
    if not ready.wait(60):
        proc.kill()
        raise RuntimeError("the neighbour process did not start")
    steps = {False: [], True: []}
    worked, on_time = 0, 0.0
    try:
        for b in range(2 * blocks):
            active = b % 2 == 1
            on.set() if active else on.clear()
            done0, t0 = done.value, time.perf_counter()
            for _ in range(block):
                start = time.perf_counter()
                engine.step()
                steps[active].append(time.perf_counter() - start)
            if active:
                worked += done.value - done0
                on_time += time.perf_counter() - t0
    finally:
        stop.set()
        on.set()
        proc.join(5)
    off, on_ = statistics.median(steps[False]), statistics.median(steps[True])
    share = worked * work_s / on_time / (os.cpu_count() or 1)
    return {
        "policy": policy,
        "period_ms": 1000 * period_s,
        "work_ms": 1000 * work_s,
        "step_off_ms": 1000 * off,
        "step_on_ms": 1000 * on_,
        "slowdown": on_ / off - 1,
        "neighbour_share": share,  # of the whole machine, while on
        "wanted_share": work_s / (period_s + work_s) / (os.cpu_count() or 1),
        "steps": {"off": steps[False], "on": steps[True]},
    }


def busy_engine(llm, rows: int, steps: int, prompt_len: int = 24):
    """`llm`'s engine with `rows` greedy requests that each run for `steps` more steps."""
    from ..sampling_params import SamplingParams

    rng = random.Random(0)
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for i in range(rows):
        prompt = [rng.randrange(3, 100) for _ in range(prompt_len)]
        llm.engine.add_request(prompt, params, request_id=f"contention-{i}")
    for _ in range(4):  # the prefills and a few decodes: the blocks measure decode steps only
        llm.engine.step()
    return llm.engine


def report(r: dict) -> str:
    return (
        f"neighbour ({r['policy']}, wakes every {r['period_ms']:g} ms, works {r['work_ms']:g} ms): "
        f"got {100 * r['neighbour_share']:.1f}% of the machine (asked "
        f"{100 * r['wanted_share']:.1f}%); engine step {r['step_off_ms']:.1f} ms alone, "
        f"{r['step_on_ms']:.1f} ms beside it ({100 * r['slowdown']:+.1f}%)"
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m minicb.bench.contention", description=__doc__)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--rows", type=int, default=32, help="requests decoding together (default 32)")
    p.add_argument("--period-ms", type=float, default=2.0, help="the neighbour sleeps this long")
    p.add_argument("--work-ms", type=float, default=0.25, help="then works this long")
    p.add_argument("--policy", choices=POLICIES, default="normal", help="the neighbour's priority")
    p.add_argument("--block", type=int, default=10, help="steps per block (default 10)")
    p.add_argument("--blocks", type=int, default=16, help="blocks on, and as many off")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="the engine's torch threads (default: one per core; fewer leave the neighbour one)",
    )
    args = p.parse_args(argv)
    import torch

    from ..engine.llm import LLM
    from .machine import cpu_model

    if args.threads is not None:
        torch.set_num_threads(args.threads)

    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.rows)
    engine = busy_engine(llm, args.rows, 2 * args.block * args.blocks)
    r = measure(
        engine, args.period_ms / 1000, args.work_ms / 1000, args.policy, args.block, args.blocks
    )
    print(
        f"{cpu_model()}, {os.cpu_count()} CPUs, {args.rows} rows decoding on "
        f"{torch.get_num_threads()} torch threads"
    )
    print(report(r))


if __name__ == "__main__":
    main()
