"""Parallel sampling drawn from a trace: the blocks that n samples of one prompt share, the ones
copied on write, and the ones decoding opened, beside n separate requests with the same prompt.

  block_kinds   every request's block table in one step, each block named by what it is (KINDS)
  fork_map      two block-table maps (one row per request, one column per logical block; a block
                held by several rows is drawn once across them) and a bar chart of the blocks by
                kind

The samples fork after the prompt's prefill and share all its blocks (BlockManager.fork). Full
blocks are never written again and stay shared; the first samples to write into the shared, partly
filled last block get a copy of it (BlockManager.copy_on_write), and the last one writes into the
original. The trace is enough to tell them apart: a copy is a private block at an index where the
request held a shared block before; the original is a private block that was shared before.
"""

import matplotlib.pyplot as plt
from matplotlib.patches import Patch, Rectangle

from ..config import cdiv
from ..trace import Trace
from .style import step_record

KINDS = {  # kind -> (colour, legend label)
    "shared": ("#4e79a7", "prompt block, shared (stored once)"),
    "private": ("#a0cbe8", "prompt block, one request's own"),
    "copied": ("#f28e2b", "partial prompt block, copied on write"),
    "in place": ("#edc948", "partial prompt block, the original (written in place)"),
    "decode": ("#59a14f", "block opened by decoding"),
}


def block_kinds(trace: Trace, step: int, prompt_len: int) -> dict[str, list[tuple[int, str]]]:
    """request id -> [(block id, kind), ...] along its block table in `step`, for requests whose
    prompt has `prompt_len` tokens. For a run without preemption (a swap or recompute changes every
    block id of a request, which these rules would not recognise)."""
    # held_before: (request, index) -> blocks
    bs, held_before, shared_before = (trace.block_size, {}, set())
    for earlier in trace.steps:
        if earlier.step >= step:
            break
        for rid, table in earlier.block_tables.items():
            for i, b in enumerate(table):
                held_before.setdefault((rid, i), set()).add(b)
        shared_before |= _shared(earlier)
    rec = step_record(trace, step)
    shared_now = _shared(rec)
    # the index of the partly filled prompt block
    partial = prompt_len // bs if prompt_len % bs else None
    kinds = {}
    for rid, table in rec.block_tables.items():
        row = []
        for i, b in enumerate(table):
            if i >= cdiv(prompt_len, bs):
                kind = "decode"
            elif b in shared_now:
                kind = "shared"
            elif i == partial and b in shared_before:
                kind = "in place"
            elif (
                i == partial and held_before.get((rid, i), set()) & shared_before
            ):  # it held a shared one here
                kind = "copied"
            else:
                kind = "private"
            row.append((b, kind))
        kinds[rid] = row
    return kinds


def _shared(rec) -> set[int]:
    """Blocks held by more than one block table in this step record."""
    holders = {}
    for table in rec.block_tables.values():
        for b in table:
            holders[b] = holders.get(b, 0) + 1
    return {b for b, n in holders.items() if n > 1}


def _draw_tables(ax, kinds: dict[str, list[tuple[int, str]]], title: str):
    """One row per request, one column per logical block; a block held by consecutive rows is one
    box."""
    rids = list(kinds)
    ncols = max(len(row) for row in kinds.values())
    for i in range(ncols):
        runs = []  # [block id, kind, first row, last row]: consecutive rows holding the same block
        for r, rid in enumerate(rids):
            if i < len(kinds[rid]):
                b, kind = kinds[rid][i]
                if runs and runs[-1][0] == b and runs[-1][3] == r - 1:
                    runs[-1][3] = r
                else:
                    runs.append([b, kind, r, r])
        for b, kind, r0, r1 in runs:
            height = r1 - r0 + 1
            ax.add_patch(
                Rectangle(
                    (i, r0), 1, height, facecolor=KINDS[kind][0], edgecolor="white", linewidth=1.2
                )
            )
            label = f"#{b}" + (f"\nref {height}" if height > 1 else "")
            ax.text(
                i + 0.5,
                r0 + height / 2,
                label,
                ha="center",
                va="center",
                fontsize=6.5,
                rotation=90 if height > 1 else 0,
                color="white" if kind == "shared" else "black",
            )
    ax.set_xlim(0, ncols)
    ax.set_ylim(len(rids), 0)
    ax.set_xticks([i + 0.5 for i in range(ncols)], [str(i) for i in range(ncols)], fontsize=7)
    ax.set_yticks([r + 0.5 for r in range(len(rids))], rids, fontsize=8)
    ax.tick_params(length=0)
    ax.set_frame_on(False)
    ax.set(xlabel="logical block (index in the block table)", ylabel="request")
    ax.set_title(title, fontsize=10)


def count_kinds(kinds: dict[str, list[tuple[int, str]]]) -> dict[str, int]:
    """Physical blocks of each kind (a shared block counted once), in the order of KINDS."""
    seen = {}
    for row in kinds.values():
        seen.update(row)
    return {k: sum(1 for kind in seen.values() if kind == k) for k in KINDS}


def fork_map(forked: Trace, separate: Trace, step: int, prompt_len: int, title: str | None = None):
    """The block tables of n samples of one prompt (`forked`) and of n separate requests with the
    same prompt (`separate`) in `step`, side by side, and a bar of each run's blocks stacked by
    kind."""
    runs = {
        "forked": block_kinds(forked, step, prompt_len),
        "separate": block_kinds(separate, step, prompt_len),
    }
    counts = {name: count_kinds(kinds) for name, kinds in runs.items()}
    totals = [sum(c.values()) for c in counts.values()]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5), gridspec_kw={"width_ratios": [1, 1, 0.42]})
    plt.close(fig)  # shown when displayed, not again at the end of the cell
    n, m = len(runs["forked"]), len(runs["separate"])
    for ax, (name, kinds), total in zip(axes, runs.items(), totals):
        what = (
            f"{n} samples of one prompt (n={n})"
            if name == "forked"
            else f"{m} separate requests, same prompt"
        )
        parts = " + ".join(f"{c} {kind}" for kind, c in counts[name].items() if c)
        _draw_tables(ax, kinds, f"{what}:\n{parts} = {total} blocks")
    bar_ax, bottoms = axes[2], [0] * len(runs)
    for kind, (color, _) in KINDS.items():
        heights = [c[kind] for c in counts.values()]
        drawn = bar_ax.bar(
            [f"n={n}\nforked", f"{m}\nseparate"], heights, 0.6, bottom=bottoms, color=color
        )
        # the small ones are in the titles
        shown = [str(h) if h >= 0.05 * max(totals) else "" for h in heights]
        bar_ax.bar_label(drawn, shown, label_type="center", fontsize=8)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    for x, total in enumerate(totals):
        bar_ax.text(x, total, str(total), ha="center", va="bottom", fontsize=9, fontweight="bold")
    bar_ax.margins(y=0.08)
    bar_ax.set(ylabel="KV blocks held", title="blocks by kind")
    fig.legend(
        handles=[Patch(facecolor=c, label=label) for c, label in KINDS.values()],
        loc="lower center",
        ncol=len(KINDS),
        fontsize=8,
        frameon=False,
    )
    fig.suptitle(
        title
        or f"Step {step}: the blocks of {n} samples and of {m} separate requests "
        f"({prompt_len}-token prompt, blocks of {forked.block_size} tokens)"
    )
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig
