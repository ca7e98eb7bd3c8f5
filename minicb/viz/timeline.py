"""The engine loop in time: what the host (the engine's thread) and the device did, step by step.

engine_loop_timeline draws, for each trace given (synchronous steps, async scheduling), two lanes
on one time axis, in milliseconds from the first step shown:

  host     schedule + inputs (before a step is launched), then update + outputs (after its tokens
           are back: detokenization, stop strings, the RequestOutputs)
  device   the forward pass, then sampling; hatched where a step's sampling waits for the step
           before it to be processed (async scheduling only)

from each step's StepTimes (trace.py). Synchronous steps leave the device idle while the host works;
async scheduling puts step N+1's host work and step N's outputs beside step N+1's forward pass.
Every bar is an artist with a gid "<label>:<lane>:<part>:<step>" so a test can read the picture
back.
"""

import matplotlib.pyplot as plt

from ..trace import Trace

PARTS = {  # part: (lane, colour, the StepTimes fields it spans)
    "schedule": ("host", "tab:blue", ("schedule_start", "launch")),
    "outputs": ("host", "tab:orange", ("outputs_start", "outputs_end")),
    "forward": ("device", "tab:green", ("device_start", "forward_end")),
    "wait": ("device", "white", ("forward_end", "sample_start")),
    "sample": ("device", "tab:red", ("sample_start", "device_end")),
}
LANES = ("host", "device")


def timed_steps(trace: Trace) -> list:
    """The records of the steps that ran rows, with their times, in the order they ran."""
    return sorted((s for s in trace if s.rows and s.times is not None), key=lambda s: s.step)


def engine_loop_timeline(traces: dict[str, Trace], first: int = 2, count: int = 6):
    """One panel per trace ({label: trace}), each with a host lane and a device lane, over the time
    from the forward pass of the `first` step that ran rows to the end of `count` steps later; every
    step's parts that fall in that window are drawn (clipped to it). Returns the Figure."""
    fig, axes = plt.subplots(len(traces), 1, figsize=(11, 1.6 + 1.3 * len(traces)), squeeze=False)
    plt.close(fig)
    for ax, (label, trace) in zip(axes[:, 0], traces.items()):
        steps = timed_steps(trace)
        if len(steps) < first + count:
            raise ValueError(
                f"{label}: {len(steps)} timed steps with rows; asked for {first}..{first + count}"
            )
        shown = steps[first : first + count]
        t0, t1 = shown[0].times.device_start, shown[-1].times.device_end
        for rec in steps:
            for part, (lane, colour, (a, b)) in PARTS.items():
                start = max(getattr(rec.times, a), t0)
                end = min(getattr(rec.times, b), t1)
                if end <= start:
                    continue
                bar = ax.barh(
                    LANES.index(lane),
                    1e3 * (end - start),
                    left=1e3 * (start - t0),
                    height=0.6,
                    color=colour,
                    edgecolor="black" if part == "wait" else colour,
                    hatch="//" if part == "wait" else None,
                    linewidth=0.5,
                )
                bar.patches[0].set_gid(f"{label}:{lane}:{part}:{rec.step}")
            if t0 <= rec.times.device_start < t1:
                middle = (rec.times.device_start + min(rec.times.forward_end, t1)) / 2
                ax.text(1e3 * (middle - t0), 1, str(rec.step), fontsize=8, ha="center", va="center")
        ax.set_yticks(range(len(LANES)), LANES)
        ax.set_ylim(1.6, -0.6)
        ax.set_xlim(0, 1e3 * (t1 - t0))
        ax.set_title(
            f"{label}: steps {shown[0].step}..{shown[-1].step} in {1e3 * (t1 - t0):.0f} ms",
            fontsize=10,
        )
        ax.set_xlabel("ms from the forward pass of the first step shown")
    handles = [
        plt.Rectangle(
            (0, 0), 1, 1, facecolor=c, edgecolor="black", hatch="//" if p == "wait" else None
        )
        for p, (_, c, _) in PARTS.items()
    ]
    labels = ["schedule + inputs", "update + outputs", "forward", "sampling waits", "sampling"]
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig
