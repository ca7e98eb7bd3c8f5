"""Speculative decoding in pictures, from the engine's trace (RowRecord.num_drafts, num_accepted).

draft_slots       slots x steps: each cell is the request in that slot, and says how many tokens the
step
                  gave it ("+1" a plain decode, "+3 (2/4)" two of four drafts kept, then the model's
                  own)
speculation_runs  the same requests without and with drafts: output tokens against steps, and how
many
                  drafts the verifying rows kept
"""

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch, Rectangle

from ..trace import Trace
from .slots import slot_occupancy
from .style import trace_colors

REJECTED = "#c44e52"  # the frame of a row that rejected a draft


def tokens_yielded(row) -> int:
    """Tokens a row gave its request: 0 for a prompt chunk that samples nothing, else its kept
    drafts + 1."""
    return row.num_accepted + 1 if row.sampled else 0


def draft_slots(
    trace: Trace, steps: tuple[int, int] | None = None, title: str | None = None, ax=None
):
    """slot_occupancy, with what each step gave each request written in its cell, and a red frame on
    a row whose drafts were not all kept."""
    fig = slot_occupancy(
        trace,
        title=title or "What each step gave each request: +tokens, and drafts kept / proposed",
        ax=ax,
        steps=steps,
        labels=False,
    )
    ax = ax or fig.axes[0]
    colors, (lo, hi) = trace_colors(trace), ax.get_xlim()
    for s in trace.steps:
        for r in (r for r in s.rows if lo < s.step < hi):
            label = f"{r.request_id}\n+{tokens_yielded(r)}"
            label += f"\n{r.num_accepted}/{r.num_drafts}" if r.num_drafts else ""
            ax.text(
                s.step,
                r.slot,
                label,
                ha="center",
                va="center",
                fontsize=6.5,
                color="white" if sum(colors[r.request_id][:3]) < 1.3 else "black",
            )
            if r.num_accepted < r.num_drafts:
                ax.add_patch(
                    Rectangle(
                        (s.step - 0.46, r.slot - 0.46),
                        0.92,
                        0.92,
                        fill=False,
                        edgecolor=REJECTED,
                        linewidth=1.6,
                    )
                )
    ax.add_artist(ax.get_legend())  # slot_occupancy's legend stays, this one goes below it
    ax.legend(
        handles=[
            Patch(facecolor="white", edgecolor=REJECTED, linewidth=1.6, label="a draft rejected")
        ],
        loc="lower left",
        bbox_to_anchor=(1.01, 0),
        fontsize=8,
        frameon=False,
    )
    return fig


def speculation_runs(off: Trace, on: Trace, k: int, title: str | None = None):
    """Left: output tokens so far against steps, without and with drafts. Right: how many of its
    drafts each verifying row kept (0..k)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [1.6, 1]})
    for trace, label, color in ((off, "without drafts", "#4c72b0"), (on, "with drafts", "#dd8452")):
        made = np.cumsum([sum(tokens_yielded(r) for r in s.rows) for s in trace.steps])
        left.plot(
            [s.step for s in trace.steps], made, label=f"{label}: {len(trace)} steps", color=color
        )
    left.set(xlabel="step", ylabel="output tokens so far", title="The same outputs in fewer steps")
    left.legend(frameon=False)
    kept = [r.num_accepted for s in on.steps for r in s.rows if r.num_drafts]
    counts = np.bincount(kept, minlength=k + 1) if kept else np.zeros(k + 1, int)
    right.bar(range(len(counts)), counts, color="#dd8452")
    right.set(
        xlabel="drafts kept by a verifying row",
        ylabel="rows",
        xticks=range(len(counts)),
        title=(
            f"{len(kept)} verifying rows, {sum(kept)} of "
            f"{sum(r.num_drafts for s in on.steps for r in s.rows)} drafts kept"
        ),
    )
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
