"""Slots over time: which request sat in which batch slot at every step (Orca's iteration-level
view).

  slot_occupancy           slots x steps, one colour per request; prefill hatched, idle white,
                           rows a grammar constrains (structured outputs) framed with dots
  compare_slot_occupancy   several runs stacked on one step axis (static vs continuous, fcfs vs sjf)
  utilization_curves       busy slots and free KV blocks per step, one line per run

Static batching leaves white holes where finished requests wait for the longest one in their
batch; continuous batching fills a slot again in the very next step. These pictures show both.
"""

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch, Rectangle

from ..trace import Trace
from .style import IDLE, frame_step, new_axes, steps_extent, trace_colors


def slot_occupancy(
    trace: Trace,
    title: str | None = None,
    ax=None,
    max_labels: int = 400,
    steps: tuple[int, int] | None = None,
    highlight_step: int | None = None,
    labels: bool = True,
):
    """Which request sat in which slot at every step. `steps=(a, b)` zooms on steps a..b.
    `labels=False` leaves the cells blank, for a caller that writes its own
    (viz.speculation.draft_slots)."""
    colors, n = trace_colors(trace), len(trace.steps)
    fig, ax, own = new_axes(ax, (min(16, 4 + 0.12 * n), min(9, 1.5 + 0.35 * trace.max_num_seqs)))
    img = np.tile(IDLE, (trace.max_num_seqs, max(n, 1), 1))  # (slots, steps, RGBA)
    lo, hi = steps or (1, n and trace.steps[-1].step)
    visible = [(s, r) for s in trace.steps for r in s.rows if lo <= s.step <= hi]
    for j, s in enumerate(trace.steps):
        for r in s.rows:
            img[r.slot, j] = colors[r.request_id]
    ax.imshow(
        img, aspect="auto", interpolation="nearest", extent=steps_extent(trace, trace.max_num_seqs)
    )
    runs = {}  # (slot, request) -> [first, last] step of each unbroken stretch in that slot
    for s, r in visible:
        if r.constrained:  # structured outputs: a grammar masks this row's tokens
            ax.add_patch(
                Rectangle(
                    (s.step - 0.45, r.slot - 0.45),
                    0.9,
                    0.9,
                    fill=False,
                    linestyle=":",
                    edgecolor="black",
                    linewidth=1.2,
                )
            )
        if r.is_prefill:
            ax.add_patch(
                Rectangle(
                    (s.step - 0.5, r.slot - 0.5),
                    1,
                    1,
                    fill=False,
                    hatch="///",
                    edgecolor=(0, 0, 0, 0.45),
                    linewidth=0,
                )
            )
        run = runs.get((r.slot, r.request_id))
        if run and run[-1][1] == s.step - 1:
            run[-1][1] = s.step
        else:
            runs.setdefault((r.slot, r.request_id), []).append([s.step, s.step])
    per_cell = len(visible) <= max_labels and hi - lo <= 60
    for (slot, rid), stretches in runs.items() if labels else ():
        # readable on dark and light hues
        color = "white" if sum(colors[rid][:3]) < 1.3 else "black"
        for a, b in stretches:
            if per_cell:
                xs = range(a, b + 1)
            else:  # narrow cells: one label in the middle of each stretch wide enough to hold it
                xs = [(a + b) / 2] if b - a + 1 >= (hi - lo) / 80 else []
            for x in xs:
                ax.text(
                    x, slot, rid, ha="center", va="center", fontsize=7, color=color, clip_on=True
                )
    if hi - lo < 100:  # cell borders help counting steps; in long runs they would be a grey smear
        ax.vlines(
            np.arange(lo, hi) + 0.5, -0.5, trace.max_num_seqs - 0.5, color="white", linewidth=0.6
        )
    ax.hlines(
        np.arange(trace.max_num_seqs - 1) + 0.5, lo - 0.5, hi + 0.5, color="white", linewidth=0.8
    )
    ax.set_xlim(lo - 0.5, hi + 0.5)
    frame_step(ax, highlight_step)
    ax.set(xlabel="step", ylabel="slot")
    if trace.max_num_seqs <= 16:
        ax.set_yticks(range(trace.max_num_seqs))
    ax.set_title(
        title or f"Slot occupancy ({n} steps, {trace.slot_utilization():.0%} of slot-steps busy)"
    )
    ax.legend(
        handles=[
            Patch(facecolor="lightgray", hatch="///", label="prefill"),
            Patch(facecolor="lightgray", label="decode"),
            Patch(facecolor="white", edgecolor="gray", label="idle"),
            *(
                [
                    Patch(
                        facecolor="lightgray", edgecolor="black", linestyle=":", label="constrained"
                    )
                ]
                if any(r.constrained for s in trace.steps for r in s.rows)
                else []
            ),
        ],
        loc="upper left",
        bbox_to_anchor=(1.01, 1),
        fontsize=8,
        frameon=False,
    )
    if own:
        fig.tight_layout()
    return fig


def compare_slot_occupancy(
    traces: dict[str, Trace], title: str | None = None, steps: tuple[int, int] | None = None, **kw
):
    """Several runs stacked on one step axis, e.g. {"static": t1, "continuous": t2}."""
    steps = steps or (1, max((t.steps[-1].step for t in traces.values() if t.steps), default=1))
    heights = [1.2 + 0.3 * t.max_num_seqs for t in traces.values()]  # a panel grows with its slots
    fig, axes = plt.subplots(
        len(traces),
        1,
        figsize=(min(16, 4 + 0.12 * (steps[1] - steps[0])), sum(heights) + 0.4),
        sharex=True,
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    plt.close(fig)
    for ax, (label, trace) in zip(axes[:, 0], traces.items()):
        slot_occupancy(
            trace,
            title=f"{label}: {len(trace)} steps, {trace.slot_utilization():.0%} of slot-steps busy",
            ax=ax,
            steps=steps,
            **kw,
        )
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def utilization_curves(traces: dict[str, Trace], title: str | None = None, normalize: bool = True):
    """Per step: busy slots / max_num_seqs (top; running requests if not `normalize`) and free KV
    blocks (bottom), one line per run."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 5.8), sharex=True)
    plt.close(fig)
    for i, (label, t) in enumerate(traces.items()):
        x, style = (
            [rec.step for rec in t.steps],
            dict(drawstyle="steps-mid", linestyle=("-", "--", ":", "-.")[i % 4]),
        )
        (line,) = top.plot(
            x,
            [len(rec.rows) / (t.max_num_seqs if normalize else 1) for rec in t.steps],
            **style,
            label=f"{label}: {len(t)} steps, {t.slot_utilization():.0%} of slot-steps busy",
        )
        bottom.plot(x, [rec.num_free_blocks for rec in t.steps], color=line.get_color(), **style)
    top.set(ylabel="busy slots / max_num_seqs" if normalize else "requests running", ylim=(0, None))
    # auto range: a big pool would flatten the line
    bottom.set(ylabel="free KV blocks", xlabel="step")
    top.set_title(title or "Slot and memory utilization per step")
    fig.legend(
        *top.get_legend_handles_labels(),
        loc="lower center",
        fontsize=8,
        frameon=False,
        ncol=1 if len(traces) > 2 else len(traces),
    )
    fig.tight_layout(rect=(0, 0.035 * (len(traces) if len(traces) > 2 else 1) + 0.02, 1, 1))
    return fig
