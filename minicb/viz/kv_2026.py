"""Pictures of the KV cache of 2026 (notebook 21): what one token costs under multi-head,
grouped-query and latent attention, what a decode step reads in latent attention's two forms, and
what a CPU tier under the prefix cache buys on a multi-turn workload.

  bytes_per_token  the cache one token needs, per attention layout, and the tokens a budget holds
  decode_reads     bytes (and multiply-adds) of one decode step against the context length, one
                   line per form of the attention (latent attention: absorbed against expanded)
  tier_sweep       the cached share of prompt tokens and the time to first token against the size
                   of the CPU tier, beside other ways to spend memory (a larger device pool)
  tier_traffic     blocks copied to the CPU tier and back in each step of an engine run
  group_pages      one request's block table in each KV cache group, step by step: a full group's
                   pages pile up, a sliding window's are given back as the window moves on

No torch: plain numbers in, closed Figures out.
"""

import textwrap

import matplotlib.pyplot as plt
from matplotlib.colors import ListedColormap

from .charts import bars, curves


def _kib(n: float) -> str:
    return f"{n / 1024:,.0f} KiB" if n >= 1024 else f"{n:,.0f} B"


def _wrapped(label: str, width: int = 18) -> str:
    """A long bar label on a few short lines, so that neighbours do not overlap."""
    return "\n".join(textwrap.fill(line, width) for line in label.split("\n"))


def bytes_per_token(per_token: dict[str, float], budget_bytes: float, title: str | None = None):
    """Two panels of bars, one bar per layout (label -> bytes of cache one token needs, over all
    layers): the bytes per token, and how many tokens `budget_bytes` of cache holds (log scales:
    the layouts differ by up to two orders of magnitude)."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.4))
    plt.close(fig)
    bars(
        {_wrapped(label): n / 1024 for label, n in per_token.items()},
        ylabel="KiB of cache per token (all layers)",
        title="one token's KV cache",
        ax=axes[0],
        fmt="{:,.0f}",
        logy=True,
    )
    bars(
        {_wrapped(label): budget_bytes / n for label, n in per_token.items()},
        ylabel="tokens",
        title=f"tokens that fit in {budget_bytes / 1e9:g} GB of cache",
        ax=axes[1],
        fmt="{:,.0f}",
        logy=True,
    )
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def decode_reads(
    context_lens: list[int],
    bytes_read: dict[str, list[float]],
    macs: dict[str, list[float]] | None = None,
    title: str | None = None,
):
    """Bytes one decode step moves per sequence and layer against the context length, one line
    per form (label -> one value per context length), log-log; with `macs`, a second panel of the
    multiply-adds each form does."""
    panels = 2 if macs else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.2), squeeze=False)
    plt.close(fig)
    curves(
        context_lens,
        {label: [b / 2**20 for b in values] for label, values in bytes_read.items()},
        xlabel="context length (tokens)",
        ylabel="MiB per sequence and layer",
        title="bytes one decode step moves",
        ax=axes[0][0],
        logx=True,
        logy=True,
    )
    if macs:
        curves(
            context_lens,
            macs,
            xlabel="context length (tokens)",
            ylabel="multiply-adds per sequence and layer",
            title="work one decode step does",
            ax=axes[0][1],
            logx=True,
            logy=True,
        )
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def tier_sweep(
    tier_blocks: list[int],
    cached_share: dict[str, list[float]],
    ttft: dict[str, list[float]],
    pool_blocks: int,
    title: str | None = None,
):
    """Two panels against the memory added, in blocks (the CPU tier's slots, or extra device
    blocks): the share of prompt tokens served from a cache, and the time to first token (label ->
    one value per size). A dotted line marks the size of the device pool itself."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    plt.close(fig)
    xlabel = "blocks added (CPU tier slots, or device blocks)"
    curves(tier_blocks, cached_share, xlabel, "cached prompt tokens / prompt tokens", ax=axes[0])
    axes[0].set(ylim=(0, 1), title="prompt tokens served from a cache")
    curves(tier_blocks, ttft, xlabel, "steps", ax=axes[1])
    axes[1].set(ylim=(0, None), title="time to first token")
    for ax in axes:
        ax.axvline(pool_blocks, color="0.4", ls=":", lw=1)
        ax.text(
            pool_blocks,
            ax.get_ylim()[1] * 0.97,
            f" device pool: {pool_blocks}",
            fontsize=8,
            va="top",
        )
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def tier_traffic(
    steps: list[int],
    offloaded: list[int],
    loaded: list[int],
    marks: dict[str, int] | None = None,
    block_bytes: int | None = None,
    title: str | None = None,
):
    """Per step, the blocks evicted from the device's prefix cache and copied to the CPU tier
    (below the axis) and those copied back on a hit (above), from a trace's StepRecords. `marks`:
    label -> step, drawn as vertical lines (where each turn of a workload began)."""
    fig, ax = plt.subplots(figsize=(11, 3.6))
    plt.close(fig)
    suffix = f" ({_kib(block_bytes)} each)" if block_bytes else ""
    ax.bar(
        steps,
        loaded,
        width=0.8,
        color="tab:green",
        label=f"loaded back: {sum(loaded)} blocks{suffix}",
    )
    ax.bar(
        steps,
        [-n for n in offloaded],
        width=0.8,
        color="tab:purple",
        label=f"copied to the tier: {sum(offloaded)} blocks",
    )
    ax.axhline(0, color="k", lw=0.8)
    for label, step in (marks or {}).items():
        ax.axvline(step - 0.5, color="0.5", ls="--", lw=0.8)
        ax.text(step - 0.3, ax.get_ylim()[1] * 0.95, label, fontsize=8, va="top")
    ax.set(
        xlabel="step",
        ylabel="blocks (down: to CPU, up: to the device)",
        title=title or "the CPU tier's copies, step by step",
    )
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def group_pages(
    steps: list[int],
    tables: list[list[list[int | None]]],
    labels: list[str],
    title: str | None = None,
):
    """One panel per KV cache group: x the step, y the request's logical block (0 at the bottom),
    each cell the physical block that holds it after that step (its id written in), grey where a
    window gave it back (the null block), white before it exists. `tables[g][s]`: group g's table
    after steps[s], None for a null entry."""
    rows = max((len(t) for group in tables for t in group), default=1)
    fig, axes = plt.subplots(1, len(tables), figsize=(3.2 * len(tables), 4.2), sharey=True)
    plt.close(fig)
    axes = [axes] if len(tables) == 1 else list(axes)
    cmap = ListedColormap([(1, 1, 1), (0.8, 0.8, 0.8), (0.55, 0.75, 0.95)])
    for ax, group, label in zip(axes, tables, labels):
        grid = [[0] * len(steps) for _ in range(rows)]  # 0 none yet, 1 given back, 2 held
        for s, table in enumerate(group):
            for i, block in enumerate(table):
                grid[i][s] = 1 if block is None else 2
                if block is not None and len(steps) * rows <= 1200:
                    ax.text(s, i, str(block), ha="center", va="center", fontsize=6)
        ax.imshow(grid, cmap=cmap, vmin=0, vmax=2, origin="lower", aspect="auto")
        held = max((sum(b is not None for b in t) for t in group), default=0)
        ax.set(title=f"{label}\nat most {held} held", xlabel="step")
        ax.set_xticks(range(len(steps)))
        ax.set_xticklabels([str(s) if k % 4 == 0 else "" for k, s in enumerate(steps)])
    axes[0].set_ylabel("the request's block (logical)")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
