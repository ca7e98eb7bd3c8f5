"""Step through a Trace: one figure per step, and an ipywidgets slider that redraws it.

`step_figure` stacks the chosen views of one step (the slot occupancy with the step framed, the
block grid of that step, the memory map with the step framed). `slider` wraps it in a play button
and a slider, with the step's StepRecord printed above the picture, so a learner can watch slots
fill and blocks change hands. `step_through` picks between them: without ipywidgets, or outside a
Jupyter kernel, it returns the static figure, so notebooks still run headless and render on GitHub.
"""

import os

import matplotlib.pyplot as plt

from ..trace import Trace
from .blocks import block_grid, memory_map
from .slots import slot_occupancy
from .style import step_record

VIEWS = ("slots", "blocks", "memory")


def step_figure(trace: Trace, step: int | None = None, views=("slots", "blocks")):
    """The chosen views of one step (default: the last) stacked in one Figure."""
    bad = [v for v in views if v not in VIEWS]
    if bad or not views:
        raise ValueError(f"unknown views {bad or list(views)}; choose from {VIEWS}")
    rec = step_record(trace, step)
    fig, axes = plt.subplots(len(views), 1, figsize=(12, 3.6 * len(views)), squeeze=False)
    plt.close(fig)  # shown when displayed, not again at the end of the cell
    for ax, view in zip(axes[:, 0], views):
        if view == "slots":
            slot_occupancy(trace, ax=ax, highlight_step=rec.step)
        elif view == "blocks":
            block_grid(trace, rec.step, ax=ax)
        else:
            memory_map(trace, ax=ax, highlight_step=rec.step)
    fig.tight_layout()
    return fig


def widgets_available() -> bool:
    """True inside a Jupyter kernel with ipywidgets installed, unless MINICB_STATIC_FIGURES is
    set."""
    if os.environ.get("MINICB_STATIC_FIGURES", "") not in ("", "0"):
        return False
    try:
        import ipywidgets  # noqa: F401
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel")  # a terminal IPython cannot show widgets


def slider(trace: Trace, views=("slots", "blocks"), step: int | None = None):
    """A VBox: play button + step slider, the StepRecord of the step, and its figure."""
    import ipywidgets as w
    from IPython.display import display

    step_figure(trace, step, views)  # fail here, not inside a callback, on a bad step or view
    first, last = trace.steps[0].step, trace.steps[-1].step
    play = w.Play(min=first, max=last, value=step or last, interval=600, description="play")
    pick = w.IntSlider(
        min=first, max=last, value=step or last, description="step", continuous_update=False
    )
    w.jslink((play, "value"), (pick, "value"))
    record = w.HTML()
    out = w.Output()

    def draw(change=None):
        rec = step_record(trace, pick.value)
        record.value = f"<pre style='font-size:11px;margin:0'>{rec!r}</pre>"
        with out:
            out.clear_output(wait=True)
            display(step_figure(trace, pick.value, views))

    pick.observe(draw, names="value")
    draw()
    return w.VBox([w.HBox([play, pick]), record, out])


def step_through(trace: Trace, views=("slots", "blocks"), step: int | None = None):
    """A slider over the steps redrawing `views` ("slots", "blocks", "memory") together, in Jupyter
    with ipywidgets; anywhere else (a script, a headless run, MINICB_STATIC_FIGURES=1) the static
    figure of `step` (default: the last step)."""
    if widgets_available():
        return slider(trace, views, step)
    return step_figure(trace, step, views)
