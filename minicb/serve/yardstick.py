"""The load test's yardstick (issue 14): the same requests through an offline LLM on the server's
weights and config, and the server's measure set against it, level by level.

At 1 client the server's TPOT p50 is set against the offline per-token time of LLM.stream (at most
MAX_TPOT_RATIO); at more clients its output tokens/s against LLM.generate's (at least
MIN_THROUGHPUT_RATIO). On a VM whose speed moves 10-20% from one run to the next, one run's ratio
can land on either side of a target it really meets or misses; with --repeat the verdict is the
median of the run-by-run ratios, given with a distribution-free interval (bench/machine.py's
median_interval), and it says "within noise" while that interval holds the target.
"""

import os
import time
from dataclasses import asdict

from ..bench.machine import median_interval
from ..metrics import mean_gap, percentile

MAX_TPOT_RATIO = 1.25  # at 1 client: the server's TPOT p50 / offline's per-token time, at most
MIN_THROUGHPUT_RATIO = 0.90  # at more clients: the server's output tokens/s / offline's, at least
CONFIDENCE = 0.95  # of the interval the median ratio of --repeat runs is given in
# the fewest runs with such an interval: the chance that all n fall on one side, 2 / 2**n, must
# be at most 1 - CONFIDENCE (6 at 95%)
INTERVAL_RUNS = next(n for n in range(1, 99) if median_interval([0.0] * n, CONFIDENCE))


class Offline:
    """Offline LLMs on the server's weights and config, one at a time (`slots` = their
    max_num_seqs)."""

    def __init__(self, config):
        from ..model_executor.loader import load_model

        self.config, self.loaded, self.llm, self.slots = (
            config,
            # "auto" is resolved by the engine, which converts float32 weights
            load_model(config.model, "float32" if config.dtype == "auto" else config.dtype),
            None,
            None,
        )

    def with_slots(self, slots: int):
        if slots != self.slots:
            from ..engine.llm import LLM
            from ..sampling_params import SamplingParams

            self.llm = None  # free the previous one's KV cache first
            fields = {k: v for k, v in asdict(self.config).items() if k != "model"}
            self.llm, self.slots = (
                LLM.from_loaded(self.loaded, **{**fields, "max_num_seqs": slots}),
                slots,
            )
            # warm-up
            self.llm.generate([[5, 6, 7]] * slots, SamplingParams(max_tokens=4), use_tqdm=False)
        return self.llm

    def run(self, bodies: list[dict], concurrency: int) -> dict:
        """The bodies as `concurrency` clients would send them, but in this process, without
        HTTP."""
        from ..sampling_params import SamplingParams

        llm = self.with_slots(min(concurrency, self.config.max_num_seqs))
        params = [
            SamplingParams(max_tokens=b["max_tokens"], temperature=0, ignore_eos=True)
            for b in bodies
        ]
        prompts = [b["prompt"] for b in bodies]
        t0, cpu0, token_ids, tpots = time.perf_counter(), time.process_time(), [], []
        if (
            concurrency == 1
        ):  # one at a time, each token timed as it comes out, as a client times it
            for prompt, p in zip(prompts, params):
                times = []
                for out in llm.stream([prompt], p):
                    times.append(time.perf_counter())
                token_ids.append(out.outputs[0].token_ids)
                tpots.append(mean_gap(times[0], times[-1], len(times)))
        else:
            token_ids = [
                o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
            ]
        wall = time.perf_counter() - t0
        return {
            "cpu_s": time.process_time() - cpu0,
            "token_ids": token_ids,
            "tokens_per_s": sum(map(len, token_ids)) / wall,
            "tpot_p50": percentile([t for t in tpots if t is not None], 50),
        }


def compare(row: dict, results: list[dict], offline: dict) -> None:
    """Add the yardstick to a level's row: the measure on both sides, their ratio, the tokens that
    agree."""
    pairs = [
        (r["token_ids"], ids) for r, ids in zip(results, offline["token_ids"]) if "error" not in r
    ]
    row["same_output"], row["compared"] = sum(a == b for a, b in pairs), len(pairs)
    key = "tpot_p50" if row["concurrency"] == 1 else "tokens_per_s"
    row.update(measure=key, server=row[key], offline=offline[key], ratio=row[key] / offline[key])
    if "cpu_s" in offline:
        row["cpu_offline_s"] = offline["cpu_s"]


def yardstick(runs: list[dict]) -> dict:
    """One level's runs (--repeat) in one row: the median of each side and of the run-by-run
    ratios, and how firm the verdict is. `met`: the median ratio is on the target's good side.
    `interval`: where the true median ratio lies, at 95% (None under 6 runs). `verdict`: "met" or
    "NOT MET" when the interval lies wholly on one side of the target (or, without an interval,
    as the median says), "within noise" when it holds the target: this machine's run-to-run noise
    is then wider than the distance to the target, and more runs narrow it."""
    tpot = runs[0]["measure"] == "tpot_p50"
    ratios = [r["ratio"] for r in runs]
    ratio = percentile(ratios, 50)
    target = MAX_TPOT_RATIO if tpot else MIN_THROUGHPUT_RATIO
    good = (lambda x: x <= target) if tpot else (lambda x: x >= target)
    interval = median_interval(ratios, CONFIDENCE)
    sides = {good(x) for x in interval or (ratio,)}
    return {k: runs[0][k] for k in ("engine", "concurrency", "measure")} | {
        "server": percentile([r["server"] for r in runs], 50),
        "offline": percentile([r["offline"] for r in runs], 50),
        "ratio": ratio,
        "ratios": ratios,
        "target": target,
        "met": good(ratio),
        "interval": interval,
        "verdict": "within noise" if len(sides) == 2 else "met" if True in sides else "NOT MET",
    }


def print_yardstick(rows: list[dict], cpu: str, out=None) -> None:
    print(
        f"\nthe yardstick (issue 14) on {cpu}, {os.cpu_count()} CPUs: the server against offline "
        "LLM on the same requests, measured in turn",
        file=out,
    )
    print(
        f"{'engine':<11} {'clients':>7} {'measure':<13} {'server':>10} {'offline':>10} "
        f"{'ratio':>6} {f'{CONFIDENCE:.0%} CI':>11}  {'target':<9} {'':<12} "
        f"{'runs' if any(len(r['ratios']) > 1 for r in rows) else ''}",
        file=out,
    )
    for r in rows:
        tpot = r["measure"] == "tpot_p50"
        value = (lambda x: f"{1000 * x:.1f} ms") if tpot else (lambda x: f"{x:.1f}")
        target = f"<= {r['target']:.2f}x" if tpot else f">= {r['target']:.2f}"
        runs = " ".join(f"{x:.2f}" for x in r["ratios"]) if len(r["ratios"]) > 1 else ""
        interval = "%.2f-%.2f" % r["interval"] if r["interval"] else "-"
        print(
            f"{r['engine']:<11} {r['concurrency']:>7} {'TPOT p50' if tpot else 'output tok/s':<13} "
            f"{value(r['server']):>10} {value(r['offline']):>10} {r['ratio']:>6.2f} "
            f"{interval:>11}  {target:<9} {r['verdict']:<12} {runs}",
            file=out,
        )
    if any(r["interval"] is None for r in rows):
        print(
            f"(-: under {INTERVAL_RUNS} runs, no interval (CI) for the median ratio; the verdict "
            "is the median's, and on a noisy machine one run's ratio can be 20% off)",
            file=out,
        )
    if any(r["verdict"] == "within noise" for r in rows):
        print(
            "(within noise: the median's confidence interval (CI) holds the target, so this "
            "machine's noise from run to run is wider than the distance to it; more --repeat runs "
            "narrow the interval)",
            file=out,
        )
