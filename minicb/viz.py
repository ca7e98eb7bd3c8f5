"""Pictures of continuous batching, drawn from a Trace. Every function returns a matplotlib Figure.

Time runs left to right in steps everywhere, and a request keeps its colour in every picture:
  slot_occupancy / compare_slot_occupancy   slots x steps: who ran where; prefill hatched, idle blank
  memory_map / block_grid                   the paged KV pool over time / at one step: owner, fill,
                                            shared blocks (ref count > 1), free blocks that still
                                            cache a prefix
  utilization_curves                        busy slots and free blocks per step, one line per run
  request_timeline                          one bar per request: waiting, prefill, decode (paused)
  latency_distributions                     CDFs of TTFT / TPOT per run
  curves / bars                             small charts for back-of-envelope models
                                            (these four live in viz_charts.py)
  step_through                              a slider over the steps (ipywidgets) or a static figure
                                            (viz_widgets.py)

Figures are made with pyplot and closed at once: a notebook then shows a figure exactly when it
displays it (no second copy at the end of the cell) and loops do not pile up open figures.
"""

from dataclasses import dataclass

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from .trace import Trace
from .viz_charts import _axes
from .viz_charts import bars, curves, latency_distributions, request_timeline  # noqa: F401  (the viz API)

CACHED = (0.82, 0.82, 0.82, 1.0)  # free block that still holds a reusable prefix
EVENTS = {"preempted": ("v", "#d62728", "preempted (recompute)"), "swapped_out": ("v", "#9467bd", "swapped out"),
          "swapped_in": ("^", "#2ca02c", "swapped in")}


def request_colors(request_ids: list[str]) -> dict[str, tuple]:
    """A colour per request, in the order given: strong hues first, no greys (grey means 'cached')."""
    tab10, t20b, t20c = (plt.get_cmap(n) for n in ("tab10", "tab20b", "tab20c"))
    palette = ([tab10(i) for i in range(10) if i != 7] + [t20b(4 * h + s) for s in range(4) for h in range(5)]
               + [t20c(4 * h + s) for s in range(4) for h in range(4)])
    return {rid: palette[i % len(palette)] for i, rid in enumerate(request_ids)}


def _colors(trace: Trace) -> dict[str, tuple]:
    # Sorted ids, so the same request has the same colour in two runs that schedule it differently.
    ids = trace.request_ids()
    return request_colors(sorted(ids, key=lambda r: (0, int(r), "") if r.isdigit() else (1, 0, r)))


def _record(trace: Trace, step: int | None):
    if not trace.steps:
        raise ValueError("the trace has no steps")
    if step is None:
        return trace.steps[-1]
    for rec in trace.steps:
        if rec.step == step:
            return rec
    raise ValueError(f"step {step} is not in the trace (steps {trace.steps[0].step}..{trace.steps[-1].step})")


def _cursor(ax, step):
    if step is not None:
        ax.axvspan(step - 0.5, step + 0.5, facecolor="none", edgecolor="black", linewidth=2, zorder=5)


def _steps_extent(trace, rows):
    first, last = (trace.steps[0].step, trace.steps[-1].step) if trace.steps else (1, 1)
    return (first - 0.5, last + 0.5, rows - 0.5, -0.5)


# ---------------------------------------------------------------------------------------- slots
def slot_occupancy(trace: Trace, title: str | None = None, ax=None, max_labels: int = 400,
                   steps: tuple[int, int] | None = None, highlight_step: int | None = None):
    """Which request sat in which slot at every step. `steps=(a, b)` zooms on steps a..b."""
    colors, n = _colors(trace), len(trace.steps)
    fig, ax, own = _axes(ax, (min(16, 4 + 0.12 * n), min(9, 1.5 + 0.35 * trace.max_num_seqs)))
    img = np.ones((trace.max_num_seqs, max(n, 1), 4))  # white: an idle slot
    lo, hi = steps or (1, n and trace.steps[-1].step)
    visible = [(s, r) for s in trace.steps for r in s.rows if lo <= s.step <= hi]
    for j, s in enumerate(trace.steps):
        for r in s.rows:
            img[r.slot, j] = colors[r.request_id]
    ax.imshow(img, aspect="auto", interpolation="nearest", extent=_steps_extent(trace, trace.max_num_seqs))
    runs = {}  # (slot, request) -> [first, last] step of its current stretch in that slot
    for s, r in visible:
        if r.is_prefill:
            ax.add_patch(Rectangle((s.step - 0.5, r.slot - 0.5), 1, 1, fill=False, hatch="///",
                                   edgecolor=(0, 0, 0, 0.45), linewidth=0))
        run = runs.get((r.slot, r.request_id))
        if run and run[-1][1] == s.step - 1:
            run[-1][1] = s.step
        else:
            runs.setdefault((r.slot, r.request_id), []).append([s.step, s.step])
    per_cell = len(visible) <= max_labels and hi - lo <= 60
    for (slot, rid), stretches in runs.items():
        color = "white" if sum(colors[rid][:3]) < 1.3 else "black"
        for a, b in stretches:
            if per_cell:
                xs = range(a, b + 1)
            else:  # narrow cells: one label in the middle of each stretch wide enough to hold it
                xs = [(a + b) / 2] if b - a + 1 >= (hi - lo) / 80 else []
            for x in xs:
                ax.text(x, slot, rid, ha="center", va="center", fontsize=7, color=color, clip_on=True)
    if hi - lo < 100:  # cell borders help counting steps; in long runs they would be a grey smear
        ax.vlines(np.arange(lo, hi) + 0.5, -0.5, trace.max_num_seqs - 0.5, color="white", linewidth=0.6)
    ax.hlines(np.arange(trace.max_num_seqs - 1) + 0.5, lo - 0.5, hi + 0.5, color="white", linewidth=0.8)
    ax.set_xlim(lo - 0.5, hi + 0.5)
    _cursor(ax, highlight_step)
    ax.set(xlabel="step", ylabel="slot")
    if trace.max_num_seqs <= 16:
        ax.set_yticks(range(trace.max_num_seqs))
    ax.set_title(title or f"Slot occupancy ({n} steps, {trace.slot_utilization():.0%} of slot-steps busy)")
    ax.legend(handles=[Patch(facecolor="lightgray", hatch="///", label="prefill"),
                       Patch(facecolor="lightgray", label="decode"),
                       Patch(facecolor="white", edgecolor="gray", label="idle")],
              loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    if own:
        fig.tight_layout()
    return fig


def compare_slot_occupancy(traces: dict[str, Trace], title: str | None = None,
                           steps: tuple[int, int] | None = None, **kw):
    """Several runs stacked on one step axis, e.g. {"static": t1, "continuous": t2}."""
    steps = steps or (1, max((t.steps[-1].step for t in traces.values() if t.steps), default=1))
    heights = [1.2 + 0.3 * t.max_num_seqs for t in traces.values()]
    fig, axes = plt.subplots(len(traces), 1, figsize=(min(16, 4 + 0.12 * (steps[1] - steps[0])),
                             sum(heights) + 0.4), sharex=True, gridspec_kw={"height_ratios": heights}, squeeze=False)
    plt.close(fig)
    for ax, (label, trace) in zip(axes[:, 0], traces.items()):
        slot_occupancy(trace, title=f"{label}: {len(trace)} steps, {trace.slot_utilization():.0%} of "
                       "slot-steps busy", ax=ax, steps=steps, **kw)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------- blocks
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
            ax.plot(xs, [1.02] * len(xs), marker, color=color, transform=ax.get_xaxis_transform(),
                    clip_on=False, markersize=6)
            handles.append(Line2D([], [], marker=marker, color=color, linestyle="", label=label))
    return handles


def memory_map(trace: Trace, title: str | None = None, ax=None, max_blocks: int | None = None,
               highlight_step: int | None = None):
    """Blocks x steps: colour = owning request (pale = block partly filled), dots = shared block,
    grey = free but still caching a prefix, white = free. Markers on top: preemptions and swaps."""
    views, colors, bs = block_views(trace), _colors(trace), trace.block_size
    n = _num_shown(trace, views, max_blocks)
    fig, ax, own = _axes(ax, (min(16, 4 + 0.1 * len(views)), min(9, 2 + 0.12 * n)))
    img, shared = np.ones((n, max(len(views), 1), 4)), []
    for j, v in enumerate(views):
        for b in v.cached:
            if b < n:
                img[b, j] = CACHED
        for b, rids in v.owners.items():
            if b < n:
                img[b, j] = colors.get(rids[0], CACHED)
                img[b, j, 3] = 0.3 + 0.7 * v.filled[b] / bs  # over white: pale = reserved, not yet written
                if len(rids) > 1:
                    shared.append((v.step, b))
    ax.imshow(img, aspect="auto", interpolation="nearest", extent=_steps_extent(trace, n))
    if shared:
        ax.plot(*zip(*shared), ".", color="black", markersize=3)
    _cursor(ax, highlight_step)
    handles = [Patch(facecolor=colors[rid], label=f"held by {rid}") for rid in list(colors)[:8]]
    pale = (*next(iter(colors.values()), (0.5, 0.5, 0.5))[:3], 0.35)
    handles += [Patch(facecolor=pale, label="partly filled (pale)"),
                Patch(facecolor=CACHED, label="free, prefix cached"), Patch(facecolor="white", edgecolor="gray",
                label="free"), Line2D([], [], marker=".", color="black", linestyle="", label="shared (ref > 1)")]
    handles += _events(ax, trace)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    ax.set(xlabel="step", ylabel="KV block id")
    ax.set_title(title or f"KV memory map ({trace.num_blocks} blocks of {bs} tokens)", pad=14)
    if own:
        fig.tight_layout()
    return fig


def block_grid(trace: Trace, step: int | None, title: str | None = None, ax=None,
               max_blocks: int | None = None, ncols: int | None = None):
    """The block pool during `step` as a grid: owner colour and id, fill level, ref count > 1 framed."""
    views, colors, bs = block_views(trace), _colors(trace), trace.block_size
    rec = _record(trace, step)
    v = views[trace.steps.index(rec)]
    n = _num_shown(trace, views, max_blocks)
    ncols = ncols or (8 if n <= 64 else 16 if n <= 256 else 32)
    nrows = -(-n // ncols)
    fig, ax, own = _axes(ax, (min(14, 1 + 0.9 * ncols), 1.2 + 0.7 * nrows))
    for b in range(n):
        y, x = divmod(b, ncols)
        rids = v.owners.get(b)
        if rids:
            c = colors.get(rids[0], CACHED)
            ax.add_patch(Rectangle((x, y), 1, 1, facecolor=(*c[:3], 0.3), edgecolor="none"))
            ax.add_patch(Rectangle((x, y), v.filled[b] / bs, 1, facecolor=c, edgecolor="none"))
            label = "+".join(rids) if len(rids) < 4 else f"{rids[0]}+{len(rids) - 1}"
            if n <= 128:
                ax.text(x + 0.5, y + 0.55, label + (f"\nref {len(rids)}" if len(rids) > 1 else ""),
                        ha="center", va="center", fontsize=7)
        face = CACHED if b in v.cached else "none"
        shared = rids is not None and len(rids) > 1
        ax.add_patch(Rectangle((x, y), 1, 1, facecolor=face, edgecolor="black" if shared else "0.6",
                               linewidth=2.5 if shared else 0.6, zorder=3 if shared else 2))
        if n <= 128:
            ax.text(x + 0.05, y + 0.05, f"#{b}", ha="left", va="top", fontsize=6.5, zorder=4,
                    bbox=dict(boxstyle="square,pad=0.1", facecolor="white", edgecolor="none", alpha=0.7))
    ax.set_xlim(-0.05, ncols + 0.05)
    ax.set_ylim(nrows + 0.05, -0.05)
    ax.set_aspect("equal")
    ax.axis("off")
    used, nshared = len(v.owners), sum(len(r) > 1 for r in v.owners.values())
    ax.set_title(title or f"KV blocks in step {rec.step}: {used} held ({nshared} shared), {len(v.cached)} "
                 f"free+cached, {trace.num_blocks - used - len(v.cached)} free", fontsize=10)
    ax.legend(handles=[Patch(facecolor="0.5", label="tokens written"), Patch(facecolor="0.85", label="reserved"),
                       Patch(facecolor="white", edgecolor="black", linewidth=2, label="shared (ref > 1)"),
                       Patch(facecolor=CACHED, edgecolor="0.6", label="free, prefix cached")],
              loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    if own:
        fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------- runs
def utilization_curves(traces: dict[str, Trace], title: str | None = None, normalize: bool = True):
    """Per step: busy slots / max_num_seqs (top; running requests if not `normalize`) and free KV
    blocks (bottom), one line per run."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 5.8), sharex=True)
    plt.close(fig)
    for i, (label, t) in enumerate(traces.items()):
        x, style = [rec.step for rec in t.steps], dict(drawstyle="steps-mid", linestyle=("-", "--", ":", "-.")[i % 4])
        line, = top.plot(x, [len(rec.rows) / (t.max_num_seqs if normalize else 1) for rec in t.steps], **style,
                         label=f"{label}: {len(t)} steps, {t.slot_utilization():.0%} of slot-steps busy")
        bottom.plot(x, [rec.num_free_blocks for rec in t.steps], color=line.get_color(), **style)
    top.set(ylabel="busy slots / max_num_seqs" if normalize else "requests running", ylim=(0, None))
    bottom.set(ylabel="free KV blocks", xlabel="step")  # auto range: a big pool would flatten the line
    top.set_title(title or "Slot and memory utilization per step")
    fig.legend(*top.get_legend_handles_labels(), loc="lower center", fontsize=8, frameon=False,
               ncol=1 if len(traces) > 2 else len(traces))
    fig.tight_layout(rect=(0, 0.035 * (len(traces) if len(traces) > 2 else 1) + 0.02, 1, 1))
    return fig


# ---------------------------------------------------------------------------------------- stepping
def step_through(trace: Trace, views=("slots", "blocks"), step: int | None = None):
    """A slider over the steps redrawing `views` ("slots", "blocks", "memory") together, in Jupyter
    with ipywidgets; anywhere else (a script, a headless run, MINICB_STATIC_FIGURES=1) the static
    figure of `step` (default: the last step), as drawn by viz_widgets.step_figure."""
    from . import viz_widgets  # it imports this module: import it on first use

    if viz_widgets.widgets_available():
        return viz_widgets.slider(trace, views, step)
    return viz_widgets.step_figure(trace, step, views)
