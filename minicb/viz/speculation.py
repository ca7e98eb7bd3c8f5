"""Speculative decoding in pictures, from the engine's trace (RowRecord.num_drafts, num_accepted).

  draft_slots       slots x steps: each cell is the request in that slot, and says how many tokens the step
                    gave it ("+1" a plain decode, "+3 (2/4)" two of four drafts kept, then the model's own)
  speculation_runs  the same requests without and with drafts: output tokens against steps, and how many
                    drafts the verifying rows kept
"""

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch, Rectangle

from ..trace import Trace
from .style import IDLE, new_axes, steps_extent, trace_colors


def tokens_yielded(row) -> int:
    """Tokens a row gave its request: 0 for a prompt chunk that samples nothing, else its kept drafts + 1."""
    return row.num_accepted + 1 if row.sampled else 0


def draft_slots(trace: Trace, steps: tuple[int, int] | None = None, title: str | None = None, ax=None):
    """Which request sat in which slot at each step, and what each step gave it. Hatched: a prompt chunk;
    a red frame: a row whose drafts were not all kept."""
    colors, lo = trace_colors(trace), steps[0] if steps else 1
    hi = steps[1] if steps else (trace.steps[-1].step if trace.steps else 1)
    shown = [s for s in trace.steps if lo <= s.step <= hi]
    fig, ax, own = new_axes(ax, (min(16, 3 + 0.55 * len(shown)), 1.2 + 0.45 * trace.max_num_seqs))
    img = np.tile(IDLE, (trace.max_num_seqs, max(len(trace.steps), 1), 1))  # (slots, steps, RGBA)
    for j, s in enumerate(trace.steps):
        for r in s.rows:
            img[r.slot, j] = colors[r.request_id]
    ax.imshow(img, aspect="auto", interpolation="nearest", extent=steps_extent(trace, trace.max_num_seqs))
    for s in shown:
        for r in s.rows:
            dark = sum(colors[r.request_id][:3]) < 1.3
            if r.is_prefill and not r.num_drafts:
                ax.add_patch(Rectangle((s.step - 0.5, r.slot - 0.5), 1, 1, fill=False, hatch="///",
                                       edgecolor=(0, 0, 0, 0.45), linewidth=0))
            label = f"{r.request_id}\n+{tokens_yielded(r)}"
            label += f"\n{r.num_accepted}/{r.num_drafts}" if r.num_drafts else ""
            ax.text(s.step, r.slot, label, ha="center", va="center", fontsize=6.5, color="white" if dark else "black")
            if r.num_drafts and r.num_accepted < r.num_drafts:
                ax.add_patch(Rectangle((s.step - 0.46, r.slot - 0.46), 0.92, 0.92, fill=False, edgecolor="#c44e52",
                                       linewidth=1.6))
    ax.vlines(np.arange(lo, hi) + 0.5, -0.5, trace.max_num_seqs - 0.5, color="white", linewidth=0.6)
    ax.hlines(np.arange(trace.max_num_seqs - 1) + 0.5, lo - 0.5, hi + 0.5, color="white", linewidth=0.8)
    ax.set(xlim=(lo - 0.5, hi + 0.5), xlabel="step", ylabel="slot", yticks=range(trace.max_num_seqs))
    ax.set_title(title or "What each step gave each request: +tokens, and drafts kept / proposed")
    ax.legend(handles=[Patch(facecolor="lightgray", hatch="///", label="prompt chunk"),
                       Patch(facecolor="white", edgecolor="#c44e52", linewidth=1.6, label="a draft rejected"),
                       Patch(facecolor="white", edgecolor="gray", label="idle")],
              loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    if own:
        fig.tight_layout()
    return fig


def speculation_runs(off: Trace, on: Trace, k: int, title: str | None = None):
    """Left: output tokens so far against steps, without and with drafts. Right: how many of its drafts
    each verifying row kept (0..k)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [1.6, 1]})
    for trace, label, color in ((off, "without drafts", "#4c72b0"), (on, "with drafts", "#dd8452")):
        made = np.cumsum([sum(tokens_yielded(r) for r in s.rows) for s in trace.steps])
        left.plot([s.step for s in trace.steps], made, label=f"{label}: {len(trace)} steps", color=color)
    left.set(xlabel="step", ylabel="output tokens so far", title="The same outputs in fewer steps")
    left.legend(frameon=False)
    kept = [r.num_accepted for s in on.steps for r in s.rows if r.num_drafts]
    counts = np.bincount(kept, minlength=k + 1) if kept else np.zeros(k + 1, int)
    right.bar(range(len(counts)), counts, color="#dd8452")
    right.set(xlabel="drafts kept by a verifying row", ylabel="rows", xticks=range(len(counts)),
              title=f"{len(kept)} verifying rows, {sum(kept)} of {sum(r.num_drafts for s in on.steps for r in s.rows)}"
                    " drafts kept")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
