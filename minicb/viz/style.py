"""What every picture shares: request colours, a fresh closed figure, and the step axis.

A request keeps its colour in every picture (`trace_colors` sorts the ids, so two runs that
schedule the same requests differently still agree); grey is kept for blocks that are free but
still cache a prefix. Time runs left to right in steps, one column per step, and the step a slider
is on is framed with `frame_step`.
"""

import matplotlib.pyplot as plt

from ..trace import StepRecord, Trace

CACHED = (0.82, 0.82, 0.82, 1.0)  # free block that still holds a reusable prefix
IDLE = (1.0, 1.0, 1.0, 1.0)  # an empty slot or a free block: white, so the busy cells stand out


def request_colors(request_ids: list[str]) -> dict[str, tuple]:
    """A colour per request, in the order given: strong hues first, no greys (grey means
    'cached')."""
    tab10, t20b, t20c = (plt.get_cmap(n) for n in ("tab10", "tab20b", "tab20c"))
    palette = (
        [tab10(i) for i in range(10) if i != 7]
        + [t20b(4 * h + s) for s in range(4) for h in range(5)]
        + [t20c(4 * h + s) for s in range(4) for h in range(4)]
    )
    return {rid: palette[i % len(palette)] for i, rid in enumerate(request_ids)}


def trace_colors(trace: Trace) -> dict[str, tuple]:
    """request_colors of every request in the trace, numeric ids in numeric order ("2" before
    "10")."""
    ids = trace.request_ids()
    return request_colors(sorted(ids, key=lambda r: (0, int(r), "") if r.isdigit() else (1, 0, r)))


def new_axes(ax, figsize):
    """(fig, ax, created): a new figure unless the caller passed an axes to draw into. It is closed
    at once: a notebook shows it when it is displayed, not a second time at the end of the cell, and
    a loop that draws many does not pile up open figures."""
    if ax is not None:
        return ax.figure, ax, False
    fig, ax = plt.subplots(figsize=figsize)
    plt.close(fig)
    return fig, ax, True


def step_record(trace: Trace, step: int | None) -> StepRecord:
    """The record of `step` (None: the last one), or a ValueError naming the steps there are."""
    if not trace.steps:
        raise ValueError("the trace has no steps")
    if step is None:
        return trace.steps[-1]
    for rec in trace.steps:
        if rec.step == step:
            return rec
    raise ValueError(
        f"step {step} is not in the trace (steps {trace.steps[0].step}..{trace.steps[-1].step})"
    )


def steps_extent(trace: Trace, rows: int) -> tuple[float, float, float, float]:
    """imshow extent that centres column j on step number j+first and row i on i (row 0 on top)."""
    first, last = (trace.steps[0].step, trace.steps[-1].step) if trace.steps else (1, 1)
    return (first - 0.5, last + 0.5, rows - 0.5, -0.5)


def frame_step(ax, step: int | None):
    """Frame the column of `step` (nothing when None): where a slider stands on a steps x rows
    picture."""
    if step is not None:
        ax.axvspan(
            step - 0.5, step + 0.5, facecolor="none", edgecolor="black", linewidth=2, zorder=5
        )
