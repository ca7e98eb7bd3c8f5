"""Figures drawn from a Trace: every function returns a matplotlib Figure.

slot_occupancy: slots x steps, one colour per request; prefill cells hatched, decode cells
solid, idle slots left blank. It is the picture of continuous batching: blank cells are
paid-for compute that did nothing.
"""

import matplotlib.pyplot as plt
from matplotlib.patches import Patch, Rectangle

from .trace import Trace


def request_colors(request_ids: list[str]) -> dict[str, tuple]:
    """A stable colour per request: tab20 then tab20b/c, cycling for very many requests."""
    cmaps = [plt.get_cmap(n) for n in ("tab20", "tab20b", "tab20c")]
    palette = [c(i) for c in cmaps for i in range(20)]
    return {rid: palette[(3 * i) % len(palette)] for i, rid in enumerate(request_ids)}


def slot_occupancy(trace: Trace, title: str | None = None, ax=None, max_labels: int = 400):
    """Which request sat in which slot at every step."""
    steps = trace.steps
    colors = request_colors(trace.request_ids())
    if ax is None:
        width = min(16, 4 + 0.12 * len(steps))
        height = min(9, 1.5 + 0.35 * trace.max_num_seqs)
        fig, ax = plt.subplots(figsize=(width, height))
    else:
        fig = ax.figure
    num_cells = sum(len(s.rows) for s in steps)
    for s in steps:
        for r in s.rows:
            ax.add_patch(Rectangle((s.step - 0.5, r.slot - 0.5), 1, 1, facecolor=colors[r.request_id],
                                   edgecolor="white", linewidth=0.5, hatch="///" if r.is_prefill else None))
            if num_cells <= max_labels:
                ax.text(s.step, r.slot, r.request_id, ha="center", va="center", fontsize=7)
    n = len(steps)
    ax.set_xlim(0.5, n + 0.5)
    ax.set_ylim(trace.max_num_seqs - 0.5, -0.5)
    ax.set_xlabel("step")
    ax.set_ylabel("slot")
    if trace.max_num_seqs <= 16:
        ax.set_yticks(range(trace.max_num_seqs))
    util = trace.slot_utilization()
    ax.set_title(title or f"Slot occupancy ({n} steps, {util:.0%} of slot-steps busy)")
    ax.legend(handles=[Patch(facecolor="lightgray", hatch="///", label="prefill"),
                       Patch(facecolor="lightgray", label="decode"),
                       Patch(facecolor="white", edgecolor="gray", label="idle")],
              loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig
