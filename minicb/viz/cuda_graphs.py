"""The pictures of notebook 07's graph shapes: which (rows, columns) graphs are captured, what a
width costs, and measured step times. Numbers in, a Figure out (no torch, no engine)."""

import math

import matplotlib.pyplot as plt
from matplotlib.colors import LogNorm


def graph_grid(
    buckets: list[int],
    widths: dict[int, list[int]],
    block_size: int,
    max_graph_tokens: int,
    ax=None,
):
    """One cell per (batch bucket, width bucket): coloured by the context tokens the graph attends
    (rows x columns x block_size) where it is captured, blank where that exceeds max_graph_tokens
    (the step runs eagerly). widths: bucket -> its captured widths (DecodeGraphRunner.widths)."""
    every = sorted({w for ws in widths.values() for w in ws})
    own = ax is None
    if own:
        fig, ax = plt.subplots(figsize=(7, 5))
        plt.close(fig)
    grid = [[b * w * block_size if w in widths[b] else math.nan for w in every] for b in buckets]
    image = ax.imshow(
        grid,
        aspect="auto",
        origin="lower",
        cmap="viridis",
        norm=LogNorm(vmin=block_size, vmax=max(buckets) * max(every) * block_size),
    )
    ax.set_xticks(range(len(every)), [str(w) for w in every], fontsize=7)
    ax.set_yticks(range(len(buckets)), [str(b) for b in buckets], fontsize=7)
    count = sum(len(ws) for ws in widths.values())
    ax.set(
        xlabel="width bucket (block-table columns)",
        ylabel="batch bucket (rows)",
        title=f"{count} graphs captured; blank: over {max_graph_tokens:,} tokens, eager",
    )
    ax.figure.colorbar(image, ax=ax, label="context tokens attended (rows x columns x block)")
    return ax.figure


def _powers(n: int) -> list[int]:
    """cuda_graph.width_buckets, restated here because the viz package imports no torch (tests
    compare them)."""
    return [1 << i for i in range(n.bit_length()) if 1 << i < n] + [n]


def read_ratio(contexts: list[int], block_size: int, max_model_len: int, ax=None):
    """Positions a decode row gathers per layer over positions it needs, against its context: one
    graph width of max_model_len (minicb's first design) beside width buckets (1, 2, 4, ...
    columns)."""
    own = ax is None
    if own:
        fig, ax = plt.subplots(figsize=(7, 4))
        plt.close(fig)
    max_blocks = -(-max_model_len // block_size)
    buckets = _powers(max_blocks)
    fixed = [max_blocks * block_size / c for c in contexts]
    bucketed = [min(w for w in buckets if w * block_size >= c) * block_size / c for c in contexts]
    ax.plot(contexts, fixed, label=f"one width: max_model_len ({max_model_len:,})")
    ax.plot(contexts, bucketed, label="width buckets 1, 2, 4, ... columns")
    ax.axhline(2, color="k", lw=0.8, ls=":")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="context of the batch's longest row (tokens)",
        ylabel="positions gathered / positions needed",
        title=f"What a graph's width costs (block {block_size})",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax.figure


def step_times(series: dict[str, dict[int, float]], title: str, ax=None):
    """Measured ms per decode step against the batch size, one line per series (e.g. eager,
    graph)."""
    own = ax is None
    if own:
        fig, ax = plt.subplots(figsize=(7, 4))
        plt.close(fig)
    for label, points in series.items():
        ax.plot(list(points), list(points.values()), marker="o", markersize=3, label=label)
    ax.set(xscale="log", xlabel="decode batch size", ylabel="ms per decode step", title=title)
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax.figure


def read_measurements(path) -> list[dict]:
    """The JSON lines `python -m minicb.bench.w2 --json` wrote (figures/gpu_*.jsonl), first a line
    of metadata."""
    import json
    from pathlib import Path

    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def measured_gpu(
    rows: list[dict], call: int = 2, extra_steps: dict[str, dict[int, float]] | None = None
):
    """Two panels from a GPU run's measurements: the decode step per batch size, eager vs graph
    (left; plus `extra_steps`, other series to compare with), and W2's output tokens/s per
    competitor (right)."""
    from .charts import bars

    meta = rows[0]
    latency = {r["batch_size"]: r for r in rows if r["kind"] == "latency" and r["call"] == call}
    fig, axes = plt.subplots(1, 2, figsize=(14, 4))
    plt.close(fig)
    series = dict(extra_steps or {})
    series[f"{meta['device'].split(' (')[0]}, eager"] = {
        b: r["eager_ms"] for b, r in latency.items()
    }
    series[f"{meta['device'].split(' (')[0]}, CUDA graph"] = {
        b: r["graph_ms"] for b, r in latency.items()
    }
    step_times(series, "Decode step, context 512 (Qwen3-0.6B shape, bf16)", ax=axes[0])
    w2 = {
        f"{r['competitor']} ({r['call']})": r["output_tokens_per_s"]
        for r in rows
        if r["kind"] == "w2"
    }
    bars(
        w2,
        "output tokens/s",
        title=f"W2 on an {meta['device'].split(' (')[0]} (competitor (call))",
        ax=axes[1],
        fmt="{:.0f}",
    )
    axes[1].tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
    return fig
