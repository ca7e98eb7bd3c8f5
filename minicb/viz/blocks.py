"""The paged KV pool, rebuilt from a trace and drawn (vLLM's PagedAttention block tables).

  block_views   one BlockView per step: who holds each block, how full it is, which free blocks
                still cache a prefix
  memory_map    blocks x steps: owner colour, pale = reserved but not yet written, dots = shared
                (ref count > 1), grey = free but cached; preemptions and swaps marked on top
  block_grid    the pool during one step as a grid of boxes, filled as far as tokens are written

The trace records every running request's block table; the fill of a block follows from how many
tokens its request has computed, so the pictures need nothing but the trace.
"""

from dataclasses import dataclass

import numpy as np
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from ..config import cdiv
from ..trace import Trace
from .style import CACHED, IDLE, frame_step, new_axes, step_record, steps_extent, trace_colors

# StepRecord field -> (marker, colour, legend label)
EVENTS = {
    "preempted": ("v", "#d62728", "preempted (recompute)"),
    "swapped_out": ("v", "#9467bd", "swapped out"),
    "swapped_in": ("^", "#2ca02c", "swapped in"),
}


@dataclass
class BlockView:
    """The KV block pool during one step, rebuilt from the trace."""

    step: int
    owners: dict[int, list[str]]  # block id -> requests whose block table holds it (2+: shared)
    filled: dict[int, int]  # block id -> tokens of computed K/V it holds at the end of the step
    cached: set[int]  # blocks nobody holds that still keep a prefix the prefix cache can reuse


def block_views(trace: Trace) -> list[BlockView]:
    """One BlockView per step. A free block counts as cached if it was full of computed tokens the
    last time a request held it (the block manager registers exactly those; it keeps only the first
    copy when two requests compute the same prefix at once, which this cannot see)."""
    bs, computed, full, views = trace.block_size, {}, {}, []
    # prefix caching off: nothing is cached
    any_cache = any(rec.num_cached_blocks for rec in trace.steps)
    for rec in trace.steps:
        for r in rec.rows:
            computed[r.request_id] = r.start + r.num_tokens
        owners, filled = {}, {}
        for rid, table in rec.block_tables.items():
            done = min(computed.get(rid, 0), len(table) * bs)
            for i, b in enumerate(table):
                owners.setdefault(b, []).append(rid)
                filled[b] = max(filled.get(b, 0), min(max(done - i * bs, 0), bs))
        full.update({b: filled[b] == bs for b in owners})
        cached = {b for b, f in full.items() if f and b not in owners} if any_cache else set()
        views.append(BlockView(rec.step, owners, filled, cached))
    return views


def _num_shown(trace, views, max_blocks):
    """All blocks of a small pool; of a big one (the simulator's default 4096), those ever used."""
    if max_blocks is None and trace.num_blocks <= 256:
        return trace.num_blocks
    used = max((b for v in views for b in (*v.owners, *v.cached)), default=-1) + 1
    return min(trace.num_blocks, max_blocks or max(used, 1))


def _events(ax, trace):
    """Preemption and swap events as markers above the plot; returns legend handles."""
    handles = []
    for name, (marker, color, label) in EVENTS.items():
        xs = [rec.step for rec in trace.steps if getattr(rec, name)]
        if xs:
            ax.plot(
                xs,
                [1.02] * len(xs),
                marker,
                color=color,
                transform=ax.get_xaxis_transform(),
                clip_on=False,
                markersize=6,
            )
            handles.append(Line2D([], [], marker=marker, color=color, linestyle="", label=label))
    return handles


def memory_map(
    trace: Trace,
    title: str | None = None,
    ax=None,
    max_blocks: int | None = None,
    highlight_step: int | None = None,
):
    """Blocks x steps: colour = owning request (pale = block partly filled), dots = shared block,
    grey = free but still caching a prefix, white = free. Markers on top: preemptions and swaps."""
    views, colors, bs = block_views(trace), trace_colors(trace), trace.block_size
    n = _num_shown(trace, views, max_blocks)
    fig, ax, own = new_axes(ax, (min(16, 4 + 0.1 * len(views)), min(9, 2 + 0.12 * n)))
    img, shared = np.tile(IDLE, (n, max(len(views), 1), 1)), []  # (blocks, steps, RGBA)
    for j, v in enumerate(views):
        for b in v.cached:
            if b < n:
                img[b, j] = CACHED
        for b, rids in v.owners.items():
            if b < n:
                img[b, j] = colors.get(rids[0], CACHED)
                # over white: pale = reserved, not yet written
                img[b, j, 3] = 0.3 + 0.7 * v.filled[b] / bs
                if len(rids) > 1:
                    shared.append((v.step, b))
    ax.imshow(img, aspect="auto", interpolation="nearest", extent=steps_extent(trace, n))
    if shared:
        ax.plot(*zip(*shared), ".", color="black", markersize=3)
    frame_step(ax, highlight_step)
    handles = [Patch(facecolor=colors[rid], label=f"held by {rid}") for rid in list(colors)[:8]]
    pale = (*next(iter(colors.values()), (0.5, 0.5, 0.5))[:3], 0.35)
    handles += [
        Patch(facecolor=pale, label="partly filled (pale)"),
        Patch(facecolor=CACHED, label="free, prefix cached"),
        Patch(facecolor="white", edgecolor="gray", label="free"),
        Line2D([], [], marker=".", color="black", linestyle="", label="shared (ref > 1)"),
    ]
    handles += _events(ax, trace)
    ax.legend(
        handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False
    )
    ax.set(xlabel="step", ylabel="KV block id")
    ax.set_title(title or f"KV memory map ({trace.num_blocks} blocks of {bs} tokens)", pad=14)
    if own:
        fig.tight_layout()
    return fig


def block_grid(
    trace: Trace,
    step: int | None,
    title: str | None = None,
    ax=None,
    max_blocks: int | None = None,
    ncols: int | None = None,
):
    """The block pool during `step` as a grid: owner colour and id, fill level, ref count > 1
    framed."""
    views, colors, bs = block_views(trace), trace_colors(trace), trace.block_size
    rec = step_record(trace, step)
    v = views[trace.steps.index(rec)]
    n = _num_shown(trace, views, max_blocks)
    ncols = ncols or (8 if n <= 64 else 16 if n <= 256 else 32)
    nrows = cdiv(n, ncols)
    fig, ax, own = new_axes(ax, (min(14, 1 + 0.9 * ncols), 1.2 + 0.7 * nrows))
    for b in range(n):
        y, x = divmod(b, ncols)  # block ids row by row, #0 top left
        rids = v.owners.get(b)
        if rids:
            c = colors.get(rids[0], CACHED)
            ax.add_patch(Rectangle((x, y), 1, 1, facecolor=(*c[:3], 0.3), edgecolor="none"))
            ax.add_patch(Rectangle((x, y), v.filled[b] / bs, 1, facecolor=c, edgecolor="none"))
            label = "+".join(rids) if len(rids) < 4 else f"{rids[0]}+{len(rids) - 1}"
            if n <= 128:
                ax.text(
                    x + 0.5,
                    y + 0.55,
                    label + (f"\nref {len(rids)}" if len(rids) > 1 else ""),
                    ha="center",
                    va="center",
                    fontsize=7,
                )
        face = CACHED if b in v.cached else "none"
        shared = rids is not None and len(rids) > 1
        ax.add_patch(
            Rectangle(
                (x, y),
                1,
                1,
                facecolor=face,
                edgecolor="black" if shared else "0.6",
                linewidth=2.5 if shared else 0.6,
                zorder=3 if shared else 2,
            )
        )
        if n <= 128:
            ax.text(
                x + 0.05,
                y + 0.05,
                f"#{b}",
                ha="left",
                va="top",
                fontsize=6.5,
                zorder=4,
                bbox=dict(
                    boxstyle="square,pad=0.1", facecolor="white", edgecolor="none", alpha=0.7
                ),
            )
    ax.set_xlim(-0.05, ncols + 0.05)
    ax.set_ylim(nrows + 0.05, -0.05)
    ax.set_aspect("equal")
    ax.axis("off")
    used, nshared = len(v.owners), sum(len(r) > 1 for r in v.owners.values())
    ax.set_title(
        title
        or f"KV blocks in step {rec.step}: {used} held ({nshared} shared), {len(v.cached)} "
        f"free+cached, {trace.num_blocks - used - len(v.cached)} free",
        fontsize=10,
    )
    ax.legend(
        handles=[
            Patch(facecolor="0.5", label="tokens written"),
            Patch(facecolor="0.85", label="reserved"),
            Patch(facecolor="white", edgecolor="black", linewidth=2, label="shared (ref > 1)"),
            Patch(facecolor=CACHED, edgecolor="0.6", label="free, prefix cached"),
        ],
        loc="upper left",
        bbox_to_anchor=(1.01, 1),
        fontsize=8,
        frameon=False,
    )
    if own:
        fig.tight_layout()
    return fig
