"""The picture of disaggregated serving (notebook 13): TTFT and TPOT against the offered rate, one
pool that does both (colocated replicas) beside a prefill pool and a decode pool. Numbers in, a
Figure out."""

import matplotlib.pyplot as plt


def colocated_vs_disaggregated(rates: list[float], runs: dict[str, list], slo=None):
    """Two panels over the offered rate, one line per setup and percentile: TTFT (left) and TPOT
    (right), in milliseconds. `runs`: setup name -> one capacity.RatePoint per rate. `slo`
    (capacity.SLO): its targets drawn as dashed lines."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    plt.close(fig)
    for k, (name, points) in enumerate(runs.items()):
        for metric, ax in (("ttft", axes[0]), ("tpot", axes[1])):
            for q, style in (("p50", "-"), ("p99", "--")):
                ax.plot(
                    rates,
                    [1e3 * getattr(p, f"{metric}_{q}") for p in points],
                    style,
                    marker="o",
                    markersize=3,
                    color=f"C{k}",
                    label=f"{name}, {q}",
                )
    for metric, ax in (("TTFT", axes[0]), ("TPOT", axes[1])):
        if slo is not None:
            ax.axhline(
                1e3 * getattr(slo, metric.lower()),
                color="k",
                lw=1,
                ls=":",
                label=f"{metric} target",
            )
        ax.set(
            xlabel="offered rate (requests/s)",
            ylabel=f"{metric} (ms)",
            title=f"{metric} as the load grows",
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
