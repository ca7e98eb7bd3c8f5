"""Pictures of an fp8 KV cache (notebook 14): where the fp8 grid puts its numbers, what a scale
moves, and what the rounding costs a real model. Plain lists in, a matplotlib Figure out (no torch
here)."""

import matplotlib.pyplot as plt

from .style import new_axes


def fp8_grid(values: list[float], max_normal: float = 448.0, min_normal: float = 2.0**-6, ax=None):
    """The positive float8_e4m3fn values on a log axis, and the gap between neighbours relative to
    the value: the same ~6-12% everywhere in the normal range, growing in the subnormals below
    `min_normal`."""
    fig, ax, own = new_axes(ax, (9, 3.6))
    xs = sorted(v for v in values if v > 0)
    gaps = [(b - a) / a for a, b in zip(xs, xs[1:])]
    ax.plot(xs[:-1], gaps, ".", markersize=4)
    ax.axvspan(
        xs[0], min_normal, color="tab:red", alpha=0.08, label=f"subnormal (< 2^-6 = {min_normal:g})"
    )
    ax.axvline(max_normal, color="k", lw=1)
    ax.text(max_normal, max(gaps) * 0.9, f" largest: {max_normal:g}", ha="right", fontsize=8)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="fp8 value (positive half)",
        ylabel="gap to the next value / value",
        title=f"float8_e4m3fn: {len(xs)} positive values from {xs[0]:g} to {xs[-1]:g}",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    if own:
        fig.tight_layout()
    return fig


def scale_sweep(
    scales: list[float], errors: dict[str, list[float]], marks: dict[str, float], ax=None
):
    """Relative round-trip error of a tensor against the scale it is stored with (log-log): flat
    while the values sit in the normal range, up where the largest are clipped (scale too small) or
    the smallest fall into the subnormals (scale too large). `marks`: scales to draw as vertical
    lines."""
    fig, ax, own = new_axes(ax, (8, 4))
    for label, errs in errors.items():
        ax.plot(scales, errs, marker="o", markersize=3, label=label)
    for i, (label, s) in enumerate(marks.items()):
        ax.axvline(s, color=f"C{i + len(errors)}", ls="--", lw=1, label=label)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="scale (stored = value / scale)",
        ylabel="||round trip - x|| / ||x||",
        title="What the scale moves: the window of representable values, not their precision",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if own:
        fig.tight_layout()
    return fig


def fp8_accuracy(
    layer_errors: dict[str, list[float]],
    top1: dict[str, float],
    divergence: dict[str, list[int | None]],
    max_tokens: int,
):
    """Three panels, one colour per fp8 variant: per-layer relative error of the attention output
    (same tokens fed), teacher-forced top-1 agreement, and where free-running greedy output first
    differs from the full-precision cache's (prompts that never differ drawn at max_tokens)."""
    fig, axes = plt.subplots(1, 3, figsize=(14, 4), gridspec_kw={"width_ratios": [2.2, 1, 1.6]})
    plt.close(fig)
    names = list(layer_errors)
    for i, name in enumerate(names):
        errs = layer_errors[name]
        axes[0].plot(range(len(errs)), errs, marker="o", markersize=3, color=f"C{i}", label=name)
    axes[0].set(
        xlabel="layer",
        ylabel="||o_fp8 - o|| / ||o||",
        title="attention output error, same tokens fed",
    )
    axes[0].grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    drawn = axes[1].bar(
        range(len(names)),
        [100 * top1[n] for n in names],
        color=[f"C{i}" for i in range(len(names))],
    )
    axes[1].bar_label(drawn, [f"{100 * top1[n]:.1f}%" for n in names], fontsize=8)
    axes[1].set(
        xticks=range(len(names)),
        xticklabels=[n.replace(", ", "\n") for n in names],
        ylim=(0, 105),
        ylabel="% positions",
        title="teacher-forced top-1 agreement",
    )
    for i, name in enumerate(names):
        firsts = divergence[name]
        xs = [max_tokens if d is None else d for d in firsts]
        # a little apart, not on top
        ys = [i + 0.1 * (j - len(xs) / 2) / len(xs) for j in range(len(xs))]
        axes[2].scatter(xs, ys, color=f"C{i}", marker="o", label=name)
        never = [(x, y) for x, y, d in zip(xs, ys, firsts) if d is None]
        axes[2].scatter(
            [x for x, _ in never], [y for _, y in never], facecolors="none", edgecolors="k", s=90
        )
    axes[2].axvline(max_tokens, color="k", lw=1)
    axes[2].set(
        yticks=range(len(names)),
        yticklabels=[n.replace(", ", "\n") for n in names],
        xlim=(-1, max_tokens + 3),
        xlabel=f"first differing output token (ringed at {max_tokens}: none)",
        title="free-running greedy",
    )
    axes[2].grid(alpha=0.3, axis="x")
    fig.tight_layout()
    return fig
