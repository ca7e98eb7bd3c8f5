"""Pictures of a mixture of experts in the batch (notebook 20): how many experts a batch touches,
what a decode step reads, where the step's tokens went, and how evenly the ranks of expert
parallelism share them.

  experts_touched   experts that got at least one token, measured, against E(1 - (1 - k/E)^B)
  moe_roofline      weight bytes a decode step reads and its arithmetic intensity against the batch,
                    for a dense model and a mixture of experts (plain numbers in)
  expert_load_map   experts x steps: the tokens each expert got in each step, from a Trace
  expert_step       one step: its tokens per expert, coloured by the rank that holds the expert
  expert_step_through  a slider over the steps (ipywidgets), or the static figure headless
  rank_load         tokens per rank per step under one or more placements, and max / mean

No torch: traces and lists of numbers in, closed Figures out.
"""

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

from ..trace import Trace
from .style import frame_step, new_axes, step_record
from .widgets import widgets_available


def uniform_experts_touched(num_experts: int, top_k: int, batch: int) -> float:
    """Experts expected to get at least one of `batch` tokens when each token picks top_k distinct
    experts uniformly at random: each expert is missed by a token with probability 1 - k / E."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def experts_touched(
    batch_sizes: list[int],
    measured: list[float],
    num_experts: int,
    top_k: int,
    others: dict[str, list[float]] | None = None,
    title: str | None = None,
    ax=None,
):
    """Experts that got at least one token against the batch size: `measured` (one value per batch
    size), the uniform formula E(1 - (1 - k/E)^B), and any `others` (label -> values)."""
    fig, ax, own = new_axes(ax, (7, 4.2))
    fine = np.unique(np.geomspace(min(batch_sizes), max(batch_sizes), 200))
    formula = [uniform_experts_touched(num_experts, top_k, b) for b in fine]
    ax.plot(fine, formula, color="k", lw=1.2, label=f"uniform: E(1 - (1 - k/E)^B), E={num_experts}")
    ax.plot(batch_sizes, measured, "o", color="C3", ms=6, label="measured on the engine")
    for i, (label, values) in enumerate((others or {}).items()):
        ax.plot(batch_sizes, values, "x--", color=f"C{i}", lw=1, label=label)
    ax.axhline(num_experts, color="0.5", ls=":", lw=1)
    ax.text(
        max(batch_sizes),
        num_experts,
        f"all {num_experts} experts",
        ha="right",
        va="bottom",
        fontsize=8,
    )
    ax.plot(
        fine,
        [min(top_k * b, num_experts) for b in fine],
        color="0.6",
        lw=1,
        ls="--",
        label="k x B (no two tokens share an expert)",
    )
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(batch_sizes), [str(b) for b in batch_sizes])
    ax.set(
        xlabel="tokens in the step (B decode rows)",
        ylabel="experts with >= 1 token",
        ylim=(0, num_experts * 1.12),
        title=title or f"Experts a batch touches: top-{top_k} of {num_experts}",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    if own:
        fig.tight_layout()
    return fig


def moe_roofline(
    batch_sizes: list[int],
    weight_bytes: dict[str, list[float]],
    flops: dict[str, list[float]],
    ridge: float | None = None,
    title: str | None = None,
):
    """Two panels against the batch: the weight bytes one decode step reads (label -> bytes per
    batch size), and its arithmetic intensity, flops / bytes (label -> FLOPs per batch size, the
    same labels), with the device's ridge point (FLOP per byte) where compute starts to bound."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    plt.close(fig)
    for i, (label, values) in enumerate(weight_bytes.items()):
        left.plot(batch_sizes, [v / 1e9 for v in values], "o-", ms=3, color=f"C{i}", label=label)
        intensity = [f / v for f, v in zip(flops[label], values)]
        right.plot(batch_sizes, intensity, "o-", ms=3, color=f"C{i}", label=label)
        if ridge is not None:
            # the first batch of the grid at or above the ridge point
            above = next((b for b, x in zip(batch_sizes, intensity) if x >= ridge), None)
            if above is not None:
                right.axvline(above, color=f"C{i}", ls=":", lw=1)
    left.set(ylabel="GB of weights read per decode step", ylim=(0, None))
    right.set(ylabel="FLOPs per byte of weights", yscale="log")
    if ridge is not None:
        right.axhline(ridge, color="k", lw=1, ls="--")
        right.text(
            batch_sizes[0], ridge, f"ridge point: {ridge:.0f} FLOP/byte", va="bottom", fontsize=8
        )
    ticks = batch_sizes[:: max(1, len(batch_sizes) // 7)]
    for ax, name in ((left, "Weight bytes read"), (right, "Arithmetic intensity")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [f"{b:g}" for b in ticks])  # 16, not 2^4
        ax.set(xlabel="batch size B (decode rows)", title=name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def _load_matrix(trace: Trace, layer: int) -> np.ndarray:
    """(num_experts, steps) tokens per expert; steps without a record (none ran) stay 0."""
    loads = [s.expert_load[layer] for s in trace.steps if s.expert_load is not None]
    if not loads:
        raise ValueError("the trace records no expert load: not a mixture-of-experts run")
    grid = np.zeros((len(loads[0]), len(trace.steps)))
    for j, s in enumerate(trace.steps):
        if s.expert_load is not None:
            grid[:, j] = s.expert_load[layer]
    return grid


def expert_load_map(
    trace: Trace,
    layer: int = 0,
    num_ranks: int | None = None,
    highlight_step: int | None = None,
    title: str | None = None,
    ax=None,
):
    """Experts x steps, each cell the tokens the step routed to that expert in MoE layer `layer`.
    `num_ranks` draws the contiguous split of expert parallelism (E / N experts a rank)."""
    grid = _load_matrix(trace, layer)
    num_experts, n = grid.shape
    fig, ax, own = new_axes(ax, (min(16, 4 + 0.12 * n), min(9, 1.8 + 0.14 * num_experts)))
    first = trace.steps[0].step
    extent = (first - 0.5, first + n - 0.5, num_experts - 0.5, -0.5)
    image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis", extent=extent)
    fig.colorbar(image, ax=ax, label="tokens routed", pad=0.01)
    for r in range(1, num_ranks or 1):
        ax.axhline(r * num_experts / num_ranks - 0.5, color="white", lw=1.2)
    if num_ranks:
        per_rank = num_experts // num_ranks
        ax.set_yticks(
            [r * per_rank + (per_rank - 1) / 2 for r in range(num_ranks)],
            [f"rank {r}" for r in range(num_ranks)],
        )
    frame_step(ax, highlight_step)
    ax.set(
        xlabel="step",
        ylabel="expert" if not num_ranks else f"experts, {num_experts // num_ranks} per rank",
        title=title or f"Tokens per expert, MoE layer {layer}",
    )
    if own:
        fig.tight_layout()
    return fig


def expert_step(trace: Trace, step: int | None = None, layer: int = 0, num_ranks: int = 1):
    """The map with `step` framed, over that step's tokens per expert as bars coloured by the rank
    that holds the expert (contiguous split), with each rank's total."""
    rec = step_record(trace, step)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 7), height_ratios=(1.3, 1))
    plt.close(fig)
    expert_load_map(trace, layer, num_ranks, highlight_step=rec.step, ax=top)
    load = rec.expert_load[layer] if rec.expert_load is not None else ()
    per_rank = max(1, len(load) // num_ranks)
    colors = [f"C{e // per_rank}" for e in range(len(load))]
    bottom.bar(range(len(load)), load, color=colors)
    totals = [sum(load[r * per_rank : (r + 1) * per_rank]) for r in range(num_ranks)]
    mean = sum(totals) / num_ranks if totals else 0
    ratio = f", max / mean {max(totals) / mean:.2f}" if mean else ""
    handles = [Patch(color=f"C{r}", label=f"rank {r}: {totals[r]}") for r in range(num_ranks)]
    bottom.legend(handles=handles, fontsize=8, loc="upper right")
    bottom.set(
        xlabel="expert",
        ylabel="tokens routed",
        title=f"Step {rec.step}: {rec.num_batched_tokens} tokens, tokens per rank{ratio}",
    )
    fig.tight_layout()
    return fig


def expert_step_through(trace: Trace, layer: int = 0, num_ranks: int = 1, step: int | None = None):
    """A slider over the steps redrawing expert_step, in Jupyter with ipywidgets; anywhere else the
    static figure of `step` (default: the last step)."""
    if not widgets_available():
        return expert_step(trace, step, layer, num_ranks)
    import ipywidgets as w
    from IPython.display import display

    first, last = trace.steps[0].step, trace.steps[-1].step
    pick = w.IntSlider(min=first, max=last, value=step or last, description="step")
    out = w.Output()

    def draw(change=None):
        with out:
            out.clear_output(wait=True)
            display(expert_step(trace, pick.value, layer, num_ranks))

    pick.observe(draw, names="value")
    draw()
    return w.VBox([pick, out])


def rank_load(
    loads: dict[str, list[list[float]]], steps: list[int] | None = None, title: str | None = None
):
    """Tokens per rank per step under each placement (label -> per step, a list of one load per
    rank), one panel each, and a last panel with max / mean per step: how much longer each step
    takes than it would with its work spread evenly. Steps with no tokens are left out of the
    ratio."""
    labels = list(loads)
    fig, axes = plt.subplots(len(labels) + 1, 1, figsize=(11, 2.6 * (len(labels) + 1)), sharex=True)
    plt.close(fig)
    for ax, label in zip(axes, labels):
        per_step = np.array(loads[label], dtype=float)  # (steps, ranks)
        xs = steps or list(range(1, len(per_step) + 1))
        for r in range(per_step.shape[1]):
            ax.plot(xs, per_step[:, r], lw=1.2, color=f"C{r}", label=f"rank {r}")
        ax.set(ylabel="tokens", title=label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=per_step.shape[1], loc="upper right")
    ratio_ax = axes[-1]
    for i, label in enumerate(labels):
        per_step = np.array(loads[label], dtype=float)
        xs = np.array(steps or list(range(1, len(per_step) + 1)))
        busy = per_step.sum(axis=1) > 0
        ratio = per_step[busy].max(axis=1) / per_step[busy].mean(axis=1)
        overall = per_step[busy].max(axis=1).sum() / per_step[busy].mean(axis=1).sum()
        ratio_ax.plot(
            xs[busy], ratio, lw=1.2, color=f"C{i + 4}", label=f"{label}: {overall:.2f} over the run"
        )
    ratio_ax.axhline(1, color="k", lw=0.8, ls="--")
    ratio_ax.set(xlabel="step", ylabel="max / mean", title="Load imbalance per step (1 = even)")
    ratio_ax.set_ylim(bottom=0.9)
    ratio_ax.grid(alpha=0.3)
    ratio_ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
