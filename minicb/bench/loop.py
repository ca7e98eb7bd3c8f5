"""The engine loop, synchronous against async scheduling, on the same requests in one run.

    python -m minicb bench --workload loop

Two workloads on the embedded SmolLM2-135M-Instruct (float32, greedy, EOS ignored, so both loops
produce exactly the same tokens: checked):
  - W1's 64 chat requests (bench/__init__.py) at the default 64 slots;
  - W3's shape on the real model: 256 requests of 32-token prompts, all decoding together
    (max_num_seqs 256), 24 tokens each: where the host's work per step is largest.
Each loop runs `repeats` times, alternating (sync, async, sync, async), each on a fresh engine; the
faster run of each is shown, and the ratio of the median runs beside the faster runs' (one lucky run
moves the faster one). Besides tokens per second, every step's StepTimes (trace.py) give:
  - host share: the host's work before launch (schedule, inputs) and after (update, detokenize,
    outputs) over the wall time. Synchronous steps wait for it; async steps hide it behind the
    device work of the next step, unless it is longer;
  - device idle: the time between one step's sampled tokens and the next step's forward pass, over
    the wall time: what the host's work costs the device.
On a CPU the "device" is the executor's thread (worker/executor.py), sharing the cores with the
engine's thread, so the host work hidden there still takes CPU time from the matmuls.
"""

import os
import statistics
import time

from ..sampling_params import SamplingParams
from .machine import cpu_model

W3_SHAPE = dict(num_requests=256, prompt_len=32, max_tokens=24)


def loop_shares(trace, wall_s: float) -> dict:
    """Host share, device idle share and the median host parts (ms) of a run's steps."""
    steps = [s.times for s in trace if s.rows and s.times is not None]
    steps.sort(key=lambda t: t.device_start)
    host = sum(t.host_before_s + t.host_after_s for t in steps)
    idle = sum(max(0.0, b.device_start - a.device_end) for a, b in zip(steps, steps[1:]))
    ms = lambda xs: 1e3 * statistics.median(xs) if xs else 0.0
    return dict(
        host_share=host / wall_s,
        device_idle_share=idle / wall_s,
        schedule_inputs_ms=ms([t.host_before_s for t in steps]),
        forward_ms=ms([t.forward_end - t.device_start for t in steps]),
        sample_ms=ms([t.device_end - t.sample_start for t in steps]),
        outputs_ms=ms([t.host_after_s for t in steps]),
        detokenize_ms=ms([t.detokenize_s for t in steps]),
        steps=len(steps),
    )


def run_loop(loaded, prompts, outs, async_scheduling: bool, **config) -> dict:
    from ..engine.llm import LLM

    llm = LLM.from_loaded(loaded, async_scheduling=async_scheduling, **config)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in outs]
    t0 = time.perf_counter()
    res = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = [o.outputs[0].token_ids for o in res]
    llm.engine.shutdown()
    shares = loop_shares(llm.engine.trace, wall)
    return dict(wall_s=wall, tok_s=sum(map(len, tokens)) / wall, tokens=tokens) | shares


def w3_shape_workload(vocab_size: int) -> tuple[list[list[int]], list[int]]:
    n, length = W3_SHAPE["num_requests"], W3_SHAPE["prompt_len"]
    prompts = [[(1000 * (i + 1) + j) % vocab_size for j in range(length)] for i in range(n)]
    return prompts, [W3_SHAPE["max_tokens"]] * n


def run_loop_bench(repeats: int = 2, workloads=("w1", "w3")) -> dict:
    import torch

    from ..model_executor.loader import load_model
    from .w1 import w1_workload

    torch.set_num_threads(os.cpu_count())
    loaded = load_model(None)
    report = dict(machine=f"{os.cpu_count()} cores of {cpu_model()}, torch {torch.__version__}")
    for name in workloads:
        if name == "w1":
            prompts, outs = w1_workload(loaded.tokenizer, 64)
            config = {}
        else:
            prompts, outs = w3_shape_workload(loaded.vocab_size)
            config = dict(max_num_seqs=256, max_num_batched_tokens=2048)
        runs = {False: [], True: []}
        for _ in range(repeats):
            for mode in (False, True):
                runs[mode].append(run_loop(loaded, prompts, outs, mode, **config))
        same = all(r["tokens"] == runs[False][0]["tokens"] for rs in runs.values() for r in rs)
        best = {m: min(rs, key=lambda r: r["wall_s"]) for m, rs in runs.items()}
        report[name] = dict(
            same_tokens=same,
            sync={k: v for k, v in best[False].items() if k != "tokens"},
            async_={k: v for k, v in best[True].items() if k != "tokens"},
            sync_walls=[r["wall_s"] for r in runs[False]],
            async_walls=[r["wall_s"] for r in runs[True]],
        )
    return report


def print_loop(report: dict) -> None:
    print(f"engine loop, sync vs async scheduling ({report['machine']})")
    head = (
        f"{'workload':8} {'loop':6} {'tok/s':>7} {'wall s':>7} {'host %':>7} {'dev idle %':>10} "
        f"{'sched+in ms':>11} {'fwd ms':>7} {'sample ms':>9} {'out ms':>7} {'detok ms':>8}"
    )
    print(head)
    for name in ("w1", "w3"):
        if name not in report:
            continue
        r = report[name]
        for label, key in (("sync", "sync"), ("async", "async_")):
            x = r[key]
            print(
                f"{name:8} {label:6} {x['tok_s']:7.1f} {x['wall_s']:7.2f} "
                f"{100 * x['host_share']:7.1f} {100 * x['device_idle_share']:10.1f} "
                f"{x['schedule_inputs_ms']:11.2f} {x['forward_ms']:7.1f} {x['sample_ms']:9.2f} "
                f"{x['outputs_ms']:7.2f} {x['detokenize_ms']:8.2f}"
            )
        ratio = r["async_"]["tok_s"] / r["sync"]["tok_s"]
        # the same tokens in every run, so tokens/s goes as 1 / wall time
        median = statistics.median(r["sync_walls"]) / statistics.median(r["async_walls"])
        print(
            f"{name}: async / sync = {ratio:.3f}x, the faster runs; {median:.3f}x, the median runs "
            f"(same tokens: {r['same_tokens']}; runs, s: "
            f"sync {', '.join(f'{w:.2f}' for w in r['sync_walls'])}, async "
            f"{', '.join(f'{w:.2f}' for w in r['async_walls'])})"
        )
