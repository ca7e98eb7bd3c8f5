"""Charts of requests and of numbers.

  request_timeline        one bar per request: waiting, prefill, decode, and 'paused' after a
                          preemption or swap (the request's life as a user sees it: TTFT, latency)
  latency_distributions   CDFs of per-request latencies (TTFT, TPOT, ...) for several runs
  curves, bars            lines y(x) and labelled bars for the notebooks' back-of-envelope models
                          (throughput against batch size, bytes per token, waste against block size)

Like every viz function they return a closed matplotlib Figure, or draw into `ax` when given one.
"""

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

from ..metrics import percentile
from ..trace import Trace
from .style import new_axes

PHASES = {"waiting": "#d4d4d4", "prefill": "#f28e2b", "decode": "#4e79a7", "paused": "#e15759"}


def _field(r, name):
    """A request's field whether it is a SimRequestResult-like object or a plain dict."""
    return r.get(name) if isinstance(r, dict) else getattr(r, name, None)


def _running_states(trace: Trace | None) -> dict[str, dict[int, str]] | None:
    """request id -> {step: "prefill" | "decode"} for every step it ran (None without a trace)."""
    if trace is None:
        return None
    states: dict[str, dict[int, str]] = {}
    for rec in trace.steps:
        for row in rec.rows:
            states.setdefault(row.request_id, {})[rec.step] = (
                "prefill" if row.is_prefill else "decode"
            )
    return states


def _phases(r, i, states):
    """(request id, [(state, first step, last step), ...]) of one request."""
    rid = str(_field(r, "request_id") if _field(r, "request_id") is not None else i)
    arrive, admit, first, finish = (
        _field(r, k) for k in ("arrival_step", "admitted_step", "first_token_step", "finish_step")
    )
    arrive = max(arrive or 1, 1)
    if states is None:  # from the four step numbers alone
        spans = [("waiting", arrive, (admit or finish or arrive) - 1)]
        if admit is not None and first is not None:
            spans += [("prefill", admit, first), ("decode", first + 1, finish or first)]
        return rid, [s for s in spans if s[2] >= s[1]]
    running = states.get(rid, {})
    spans, end = [], finish or max(running, default=arrive)
    first_run = min(running, default=end + 1)
    for step in range(arrive, end + 1):  # run-length encode the request's state in every step
        state = running.get(step) or ("waiting" if step < first_run else "paused")
        if spans and spans[-1][0] == state:
            spans[-1] = (state, spans[-1][1], step)
        else:
            spans.append((state, step, step))
    return rid, spans


def request_timeline(requests, title: str | None = None, ax=None, trace: Trace | None = None):
    """One bar per request (SimResult.requests or dicts with arrival_step, admitted_step,
    first_token_step, finish_step). With `trace`, the bar follows the request step by step and
    shows the steps it sat out after a preemption or swap ('paused')."""
    fig, ax, own = new_axes(ax, (10, 1.2 + 0.3 * min(len(requests), 40)))
    states = _running_states(trace)
    labels, used = [], set()
    for i, r in enumerate(requests):
        rid, spans = _phases(r, i, states)
        labels.append(rid)
        for state, a, b in spans:  # steps a..b: a bar from a - 0.5 to b + 0.5, centred on the steps
            used.add(state)
            ax.broken_barh(
                [(a - 0.5, b - a + 1)],
                (i - 0.4, 0.8),
                facecolors=PHASES[state],
                hatch="//" if state == "paused" else None,
                edgecolor="white",
                linewidth=0.3,
            )
        if (_field(r, "num_preemptions") or 0) and states is None and spans:
            ax.text(
                spans[-1][2] + 1,
                i,
                f"preempted x{_field(r, 'num_preemptions')}",
                va="center",
                fontsize=7,
            )
    ax.set_yticks(range(len(labels)), labels if len(labels) <= 40 else [""] * len(labels))
    ax.set_ylim(len(labels) - 0.5, -0.5)
    ax.set(xlabel="step", ylabel="request")
    ax.legend(
        handles=[Patch(facecolor=c, label=k) for k, c in PHASES.items() if k in used],
        loc="upper left",
        bbox_to_anchor=(1.01, 1),
        fontsize=8,
        frameon=False,
    )
    ax.set_title(title or "Request timeline")
    if own:
        fig.tight_layout()
    return fig


def latency_distributions(
    samples: dict[str, dict[str, list[float]]], title: str | None = None, unit: str = "steps"
):
    """{run label: {metric: values}} -> one panel of CDFs per metric (TTFT, TPOT, ...), p50/p99 in
    the legend."""
    metrics = list(dict.fromkeys(m for per_run in samples.values() for m in per_run))
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.8 * len(metrics), 3.6), squeeze=False)
    plt.close(fig)
    for ax, metric in zip(axes[0], metrics):
        for label, per_run in samples.items():
            xs = sorted(x for x in per_run.get(metric, ()) if x is not None)
            if xs:  # the CDF starts at 0 on the smallest sample and climbs 1/n at each one
                ax.step(
                    [xs[0], *xs],
                    np.arange(len(xs) + 1) / len(xs),
                    where="post",
                    label=f"{label} (p50 {percentile(xs, 50):.3g}, p99 {percentile(xs, 99):.3g})",
                )
        ax.set(
            xlabel=f"{metric} ({unit})",
            ylabel="fraction of samples <= x",
            ylim=(0, 1.02),
            title=metric,
        )
        ax.legend(fontsize=8, loc="lower right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def curves(
    x,
    ys: dict[str, list[float]],
    xlabel: str,
    ylabel: str,
    title: str | None = None,
    ax=None,
    logx: bool = False,
    logy: bool = False,
):
    """Lines y(x), one per label: for the notebooks' models (throughput vs batch size, waste vs
    block size)."""
    fig, ax, own = new_axes(ax, (7, 4))
    for label, y in ys.items():
        ax.plot(x, y, marker="o", markersize=3.5, label=label)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title or "")
    ax.set_xscale("log" if logx else "linear", **({"base": 2} if logx else {}))
    if logx and len(x) <= 12:
        ax.set_xticks(list(x), [f"{v:g}" for v in x])  # 16, not 2^4
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if own:
        fig.tight_layout()
    return fig


def bars(
    values: dict[str, float] | dict[str, dict[str, float]],
    ylabel: str,
    title: str | None = None,
    ax=None,
    fmt: str = "{:.4g}",
    logy: bool = False,
):
    """Bars with their values written on top; a dict of dicts gives groups ({group: {series:
    v}})."""
    groups = {k: (v if isinstance(v, dict) else {"": v}) for k, v in values.items()}
    series = list(dict.fromkeys(s for g in groups.values() for s in g))
    fig, ax, own = new_axes(
        ax, (min(11, max(5, 1 + len(groups) * (1.2 + 0.6 * (len(series) - 1)))), 4)
    )
    width = 0.8 / len(series)  # the series of a group side by side within 0.8 of the group's slot
    for j, s in enumerate(series):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(groups))]
        ys = [g.get(s, 0) for g in groups.values()]
        drawn = ax.bar(xs, ys, width, label=s or None)
        ax.bar_label(drawn, [fmt.format(y) for y in ys], fontsize=8)
    ax.set_xticks(range(len(groups)), list(groups))
    ax.set(ylabel=ylabel, title=title or "")
    if logy:
        ax.set_yscale("log")
    ax.margins(y=0.12)
    if len(series) > 1:
        ax.legend(fontsize=8)
    if own:
        fig.tight_layout()
    return fig
