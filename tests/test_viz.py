"""minicb.viz: every picture draws from real simulator traces, and what it draws is what happened.

The block pictures rebuild the KV pool of every step from the trace (viz.block_views); the
strongest check here is that this rebuild agrees, step by step, with the block manager's own
free and cached counts recorded in the trace, under preemption, swapping and prefix sharing.
The drawing tests read back what a figure holds (image cells, rectangles, bar and line data) and
compare it with the trace, not only that a Figure came back.
"""

import ast
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from minicb import viz  # noqa: E402
from minicb.config import EngineConfig  # noqa: E402
from minicb.sim import SimRequest, simulate  # noqa: E402
from minicb.viz import figures, style, widgets  # noqa: E402

SYSTEM = list(range(500, 512))  # a 12-token shared prefix = 3 full blocks of 4
WHITE = (1.0, 1.0, 1.0, 1.0)


def scenario(name):
    """(SimResult, what it exercises) for the traces the notebooks draw."""
    burners = [SimRequest(8, n, request_id=r) for r, n in zip("ABCDEF", (4, 4, 10, 10, 4, 4))]
    pressure = [SimRequest(8, 40) for _ in range(4)]  # 4 x 12 blocks wanted, 24 blocks there
    small = dict(max_num_seqs=4, block_size=4, num_blocks=24)
    if name == "static":
        return simulate(burners, EngineConfig(max_num_seqs=4, batching="static"))
    if name == "continuous":
        return simulate(burners, EngineConfig(max_num_seqs=4))
    if name == "recompute":
        return simulate(pressure, EngineConfig(**small, preemption_mode="recompute"))
    if name == "swap":
        return simulate(pressure, EngineConfig(**small, preemption_mode="swap"))
    if name == "prefix":
        reqs = [
            SimRequest(14, 6 + 2 * i, arrival_step=i + 1, prompt_token_ids=SYSTEM + [i, i])
            for i in range(3)
        ]
        # all others done
        reqs.append(SimRequest(14, 4, arrival_step=14, prompt_token_ids=SYSTEM + [7, 7]))
        return simulate(reqs, EngineConfig(max_num_seqs=4, block_size=4, num_blocks=16))
    if name == "priority":
        reqs = [SimRequest(8, 30, priority=5) for _ in range(2)] + [
            SimRequest(8, 5, arrival_step=4, priority=0)
        ]
        return simulate(
            reqs,
            EngineConfig(max_num_seqs=2, block_size=4, num_blocks=32, scheduling_policy="priority"),
        )
    if name == "chunked":
        reqs = [SimRequest(40, 6), SimRequest(4, 10), SimRequest(30, 3, arrival_step=3)]
        return simulate(
            reqs,
            EngineConfig(max_num_seqs=3, block_size=8, num_blocks=40, max_num_batched_tokens=16),
        )
    raise KeyError(name)


SCENARIOS = ["static", "continuous", "recompute", "swap", "prefix", "priority", "chunked"]


@pytest.fixture(scope="module")
def runs():
    return {name: scenario(name) for name in SCENARIOS}


def cell(img, row, col):
    return tuple(float(c) for c in img[row, col])


def drawn_spans(ax):
    """request_timeline's bars read back: {row: [(phase, first step, last step), ...]}."""
    phase_of = {colour: phase for phase, colour in viz.charts.PHASES.items()}
    spans = {}
    for bar in ax.collections:
        (x0, y0), (x1, y1) = bar.get_paths()[0].vertices.min(0), bar.get_paths()[0].vertices.max(0)
        phase = phase_of[to_hex(bar.get_facecolor()[0], keep_alpha=False)]
        spans.setdefault(round((y0 + y1) / 2), []).append((phase, round(x0 + 0.5), round(x1 - 0.5)))
    return spans


def test_scenarios_exercise_what_they_claim(runs):
    assert any(rec.preempted for rec in runs["recompute"].trace)
    assert any(rec.swapped_out for rec in runs["swap"].trace) and any(
        rec.swapped_in for rec in runs["swap"].trace
    )
    assert any(rec.preempted for rec in runs["priority"].trace)
    assert max(rec.num_cached_blocks for rec in runs["prefix"].trace) > 0


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_view_returns_a_figure(runs, name):
    res = runs[name]
    t = res.trace
    mid = t.steps[len(t) // 2].step
    figs = [
        viz.slot_occupancy(t),
        viz.memory_map(t),
        viz.block_grid(t, mid),
        viz.block_grid(t, None),
        viz.utilization_curves({name: t, "again": t}),
        viz.request_timeline(res.requests),
        viz.request_timeline(res.requests, trace=t),
        viz.latency_distributions(
            {
                name: {
                    "TTFT": [r.ttft_steps for r in res.requests],
                    "latency": [r.latency_steps for r in res.requests],
                }
            }
        ),
        viz.compare_slot_occupancy({"a": t, "b": runs["continuous"].trace}),
        viz.step_through(t),
        viz.step_through(t, views=("slots", "blocks", "memory"), step=mid),
    ]
    assert all(isinstance(f, Figure) for f in figs)
    assert len(figs[-1].axes) == 3


def test_block_views_match_the_block_manager_every_step(runs):
    # After step k the pool holds the tables of every request that did not finish in step k; the
    # rebuilt free and cached sets must have exactly the sizes the block manager recorded.
    for name, res in runs.items():
        t = res.trace
        for rec, v in zip(t.steps, viz.block_views(t)):
            done = set(rec.finished)
            held_after = {b for b, rids in v.owners.items() if not set(rids) <= done}
            freed_full = {b for b in v.owners.keys() - held_after if v.filled[b] == t.block_size}
            assert t.num_blocks - len(held_after) == rec.num_free_blocks, (name, rec.step)
            assert len(v.cached | freed_full) == rec.num_cached_blocks, (name, rec.step)
            assert not v.cached & v.owners.keys()


def test_block_views_see_sharing_and_fill(runs):
    t = runs["prefix"].trace
    views = {v.step: v for v in viz.block_views(t)}
    # Request 0 computes the 3 prefix blocks in step 1; 1 and 2 arrive in steps 2 and 3 and share
    # them.
    assert sorted(len(r) for r in views[3].owners.values()) == [1, 1, 1, 3, 3, 3]
    shared = [b for b, r in views[3].owners.items() if len(r) == 3]
    assert all(views[3].filled[b] == 4 for b in shared)
    # Request 0 after step 1: 14 prompt tokens computed -> its 4th block holds 2 of 4 slots.
    own0 = t[0].block_tables["0"]
    assert [views[1].filled[b] for b in own0] == [4, 4, 4, 2]
    # Request 2 finishes in step 3 + 10 - 1 = 12; step 13 runs nothing and the three prefix blocks
    # wait free but cached; the late request (id 3, step 14) takes them back without computing them.
    assert len(t[12].rows) == 0 and len(views[13].cached) >= 3
    row = next(r for r in t[13].rows if r.request_id == "3")
    assert row.start == 12 and set(t[13].block_tables["3"][:3]) <= views[13].cached


def test_slot_occupancy_draws_each_row_once(runs):
    t = runs["chunked"].trace
    fig = viz.slot_occupancy(t)
    ax = fig.axes[0]
    rows = [r for s in t for r in s.rows]
    assert len(ax.texts) == len(rows)  # one label per (step, slot) cell
    hatched = [p for p in ax.patches if p.get_hatch()]
    assert len(hatched) == sum(r.is_prefill for r in rows)
    # chunked: prompts over several steps
    assert sum(r.is_prefill for r in rows) > len(t.request_ids())
    img = ax.images[0].get_array()
    assert img.shape[:2] == (t.max_num_seqs, len(t))
    busy = sum(
        1
        for i in range(img.shape[0])
        for j in range(img.shape[1])
        if tuple(img[i, j]) != (1, 1, 1, 1)
    )
    assert busy == len(rows)


@pytest.mark.parametrize("name", SCENARIOS)
def test_slot_occupancy_cells_hold_the_scheduled_request(runs, name):
    t = runs[name].trace
    ax = viz.slot_occupancy(t).axes[0]
    colors, img = style.trace_colors(t), ax.images[0].get_array()
    ran = {(rec.step, r.slot): r.request_id for rec in t for r in rec.rows}
    for j, rec in enumerate(t):
        for slot in range(t.max_num_seqs):
            rid = ran.get((rec.step, slot))
            assert cell(img, slot, j) == (tuple(colors[rid]) if rid else WHITE), (rec.step, slot)
    prefill = {(rec.step - 0.5, r.slot - 0.5) for rec in t for r in rec.rows if r.is_prefill}
    assert {tuple(p.get_xy()) for p in ax.patches if p.get_hatch()} == prefill
    for label in ax.texts:  # a label sits on a cell of its request (mid-stretch labels between two)
        x, slot = label.get_position()
        assert {ran.get((s, slot)) for s in {int(np.floor(x)), int(np.ceil(x))}} == {
            label.get_text()
        }


def test_slot_occupancy_static_leaves_slots_idle_until_the_batch_ends(runs):
    # A and B finish in step 4. Static: slots 0 and 1 idle in steps 5..10, E and F start in 11.
    # Continuous: E and F take those slots in step 5.
    static, cont = (
        viz.slot_occupancy(runs[n].trace).axes[0].images[0].get_array()
        for n in ("static", "continuous")
    )
    colors = style.trace_colors(runs["static"].trace)
    assert all(cell(static, s, j) == WHITE for s in (0, 1) for j in range(4, 10))
    assert cell(static, 0, 10) == tuple(colors["E"]) and cell(static, 1, 10) == tuple(colors["F"])
    assert cell(cont, 0, 4) == tuple(colors["E"]) and cell(cont, 1, 4) == tuple(colors["F"])
    assert static.shape[1] == 14 and cont.shape[1] == 10


@pytest.mark.parametrize("name", SCENARIOS)
def test_memory_map_colours_every_block_by_its_owner(runs, name):
    t = runs[name].trace
    ax = viz.memory_map(t).axes[0]
    img, colors, views = ax.images[0].get_array(), style.trace_colors(t), viz.block_views(t)
    for j, v in enumerate(views):
        for b in range(img.shape[0]):
            if b in v.owners:  # the owner's hue, pale while reserved and not yet written
                expected = (*colors[v.owners[b][0]][:3], 0.3 + 0.7 * v.filled[b] / t.block_size)
            else:
                expected = viz.CACHED if b in v.cached else WHITE
            assert cell(img, b, j) == pytest.approx(expected), (v.step, b)
    dots = {(v.step, b) for v in views for b, rids in v.owners.items() if len(rids) > 1}
    drawn = [line for line in ax.lines if line.get_marker() == "."]
    assert {(x, y) for line in drawn for x, y in zip(line.get_xdata(), line.get_ydata())} == dots
    for field, (marker, color, _) in viz.EVENTS.items():
        steps = [rec.step for rec in t if getattr(rec, field)]
        marks = [
            line for line in ax.lines if line.get_marker() == marker and line.get_color() == color
        ]
        assert [list(line.get_xdata()) for line in marks] == ([steps] if steps else [])


def test_memory_map_of_a_shared_prefix(runs):
    # Step 3 (column 2): blocks 0-2 hold the system prompt for requests 0, 1, 2 (dots); requests 1
    # and 2 hold 3 and 2 computed tokens of their own 4-token blocks 4 and 5.
    ax = viz.memory_map(runs["prefix"].trace).axes[0]
    img = ax.images[0].get_array()
    assert [float(img[b, 2, 3]) for b in (3, 4, 5)] == pytest.approx(
        [1.0, 0.3 + 0.7 * 3 / 4, 0.3 + 0.7 * 2 / 4]
    )
    dots = {(x, y) for x, y in zip(ax.lines[0].get_xdata(), ax.lines[0].get_ydata())}
    assert {b for s, b in dots if s == 3} == {0, 1, 2}


@pytest.mark.parametrize("name", SCENARIOS)
def test_block_grid_draws_fill_frames_and_cache(runs, name):
    t = runs[name].trace
    rec = t.steps[len(t) // 2]
    v = viz.block_views(t)[len(t) // 2]
    ax = viz.block_grid(t, rec.step, ncols=8).axes[0]
    colors, at = style.trace_colors(t), {}
    for (
        p
    ) in ax.patches:  # each box: pale backing and fill (held blocks only), then the frame on top
        at.setdefault(tuple(p.get_xy()), []).append(p)
    for (x, y), boxes in at.items():
        b, frame = int(y) * 8 + int(x), boxes[-1]
        assert frame.get_linewidth() == (2.5 if len(v.owners.get(b, ())) > 1 else 0.6), (
            rec.step,
            b,
        )
        assert tuple(frame.get_facecolor()) == (viz.CACHED if b in v.cached else (0, 0, 0, 0))
        if b in v.owners:
            fill = boxes[1]
            assert fill.get_width() == v.filled[b] / t.block_size
            assert tuple(fill.get_facecolor()) == tuple(colors[v.owners[b][0]])
        else:
            assert len(boxes) == 1
    assert {int(y) * 8 + int(x) for x, y in at} == set(range(len(at)))


def test_block_grid_labels_shared_blocks(runs):
    ax = viz.block_grid(runs["prefix"].trace, 3).axes[0]
    texts = [t.get_text() for t in ax.texts]
    assert texts.count("0+1+2\nref 3") == 3 and {"0", "1", "2"} <= set(texts)
    assert {f"#{b}" for b in range(16)} <= set(texts)
    assert ax.get_title() == "KV blocks in step 3: 6 held (3 shared), 0 free+cached, 10 free"


def test_timeline_phases_follow_the_trace(runs):
    res = runs["recompute"]
    victim = next(i for i, r in enumerate(res.requests) if r.num_preemptions)
    spans = drawn_spans(viz.request_timeline(res.requests, trace=res.trace).axes[0])[victim]
    states = [s for s, *_ in spans]
    assert states[0] == "prefill" and "paused" in states and states[-1] == "decode"
    r = res.requests[victim]
    ran = {rec.step for rec in res.trace for row in rec.rows if row.request_id == r.request_id}
    paused = {k for s, a, b in spans if s == "paused" for k in range(a, b + 1)}
    assert paused == set(range(r.first_token_step, r.finish_step + 1)) - ran
    # Without a trace the same request is drawn from its four step numbers only, and labelled.
    ax = viz.request_timeline(res.requests).axes[0]
    coarse = drawn_spans(ax)[victim]
    assert coarse[0] == ("prefill", 1, 1) and coarse[-1] == ("decode", 2, r.finish_step)
    assert f"preempted x{r.num_preemptions}" in [t.get_text() for t in ax.texts]


@pytest.mark.parametrize("name", SCENARIOS)
def test_timeline_bars_cover_every_step_of_every_request(runs, name):
    res = runs[name]
    spans = drawn_spans(viz.request_timeline(res.requests, trace=res.trace).axes[0])
    for i, r in enumerate(res.requests):
        ran = {
            rec.step: "prefill" if row.is_prefill else "decode"
            for rec in res.trace
            for row in rec.rows
            if row.request_id == r.request_id
        }
        expected = {
            s: ran.get(s, "waiting" if s < min(ran) else "paused")
            for s in range(max(r.arrival_step, 1), r.finish_step + 1)
        }
        assert {s: phase for phase, a, b in spans[i] for s in range(a, b + 1)} == expected, (
            r.request_id
        )


def test_timeline_accepts_dicts_and_shows_waiting():
    reqs = [
        dict(request_id="x", arrival_step=1, admitted_step=3, first_token_step=3, finish_step=6),
        dict(request_id="y", arrival_step=2, admitted_step=2, first_token_step=4, finish_step=4),
    ]
    ax = viz.request_timeline(reqs).axes[0]
    assert drawn_spans(ax) == {
        0: [("waiting", 1, 2), ("prefill", 3, 3), ("decode", 4, 6)],
        1: [("prefill", 2, 4)],
    }
    assert [t.get_text() for t in ax.get_yticklabels()] == ["x", "y"]


def test_latency_distributions_one_panel_per_metric():
    fig = viz.latency_distributions(
        {"fifo": {"TTFT": [3, 1, 2], "TPOT": [1.0, 1.0]}, "sjf": {"TTFT": [1, 1, 9]}}, unit="steps"
    )
    assert [ax.get_title() for ax in fig.axes] == ["TTFT", "TPOT"]
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels[0].startswith("fifo (p50 2") and labels[1].startswith("sjf (p50 1")
    fifo, sjf = fig.axes[0].lines  # a CDF: sorted samples, climbing 1/n at each
    assert list(fifo.get_xdata()) == [1, 1, 2, 3] and list(fifo.get_ydata()) == pytest.approx(
        [0, 1 / 3, 2 / 3, 1]
    )
    assert list(sjf.get_xdata()) == [1, 1, 1, 9] and len(fig.axes[1].lines) == 1


def test_curves_and_bars():
    f = viz.curves([1, 2, 4], {"a": [1, 2, 3], "b": [1, 1, 1]}, "batch", "throughput", logx=True)
    ax = f.axes[0]
    assert [(list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines] == [
        ([1, 2, 4], [1, 2, 3]),
        ([1, 2, 4], [1, 1, 1]),
    ]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "a",
        "b",
    ] and ax.get_xscale() == "log"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "4"]
    b = viz.bars(
        {"x": {"static": 500, "continuous": 500}, "y": {"static": 2750, "continuous": 650}}, "steps"
    )
    ax = b.axes[0]
    assert [t.get_text() for t in ax.texts] == ["500", "2750", "500", "650"]
    assert [p.get_height() for p in ax.patches] == [500, 2750, 500, 650]  # series by series
    assert [p.get_x() + p.get_width() / 2 for p in ax.patches] == pytest.approx(
        [-0.2, 0.8, 0.2, 1.2]
    )
    flat = viz.bars({"a": 3.5, "b": 1}, "KiB").axes[0]
    assert [p.get_height() for p in flat.patches] == [3.5, 1]
    assert [t.get_text() for t in flat.get_xticklabels()] == ["a", "b"]


def test_request_colors_distinct_and_never_grey():
    colors = list(viz.request_colors([str(i) for i in range(40)]).values())
    assert len(set(colors[:40])) == 40
    assert all(max(c[:3]) - min(c[:3]) > 0.05 for c in colors)  # grey is reserved for cached blocks


def test_same_request_same_colour_in_two_runs(runs):
    a = runs["static"].trace
    b = runs["continuous"].trace
    assert style.trace_colors(a) == style.trace_colors(b)
    # E runs in slot 0 from step 11 (static) and from step 5 (continuous): the same colour in both.
    static, cont = (viz.slot_occupancy(t).axes[0].images[0].get_array() for t in (a, b))
    assert cell(static, 0, 10) == cell(cont, 0, 4)


def test_step_views_validated(runs):
    t = runs["continuous"].trace
    with pytest.raises(ValueError, match="views"):
        viz.step_through(t, views=("slots", "nope"))
    with pytest.raises(ValueError, match="step 99"):
        viz.block_grid(t, 99)


def test_step_through_falls_back_without_widgets(runs, monkeypatch):
    t = runs["swap"].trace
    assert not widgets.widgets_available()  # pytest is not a Jupyter kernel
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # and without ipywidgets installed
    assert not widgets.widgets_available()
    fig = viz.step_through(t, step=5)
    assert isinstance(fig, Figure) and "step 5" in fig.axes[1].get_title()
    frames = [p for p in fig.axes[0].patches if p.get_linewidth() == 2 and not p.get_hatch()]
    assert [p.get_x() for p in frames] == [4.5]  # the slots panel frames step 5


def test_static_env_var_wins(monkeypatch):
    pytest.importorskip("ipywidgets")
    import IPython

    kernel = type("Shell", (), {"kernel": object()})()  # what a Jupyter kernel's shell looks like
    monkeypatch.setattr(IPython, "get_ipython", lambda: kernel)
    monkeypatch.delenv("MINICB_STATIC_FIGURES", raising=False)
    assert widgets.widgets_available()
    monkeypatch.setenv("MINICB_STATIC_FIGURES", "1")
    assert not widgets.widgets_available()
    assert isinstance(viz.step_through(scenario("continuous").trace), Figure)


def test_slider_redraws_each_step(runs):
    pytest.importorskip("ipywidgets")
    t = runs["prefix"].trace
    box = widgets.slider(t, ("slots", "blocks"), step=2)
    pick = box.children[0].children[1]
    record = box.children[1]
    assert "Step 2:" in record.value
    pick.value = 3
    assert "Step 3:" in record.value


def test_utilization_curves_counts_or_fractions(runs):
    t = runs["recompute"].trace
    top = viz.utilization_curves({"r": t}).axes[0]
    assert max(top.lines[0].get_ydata()) == 1.0  # 4 of 4 slots busy at the start
    assert list(top.lines[0].get_xdata()) == [rec.step for rec in t]
    counts = viz.utilization_curves({"r": t}, normalize=False).axes[0]
    assert list(counts.lines[0].get_ydata()) == [len(rec.rows) for rec in t]
    free = viz.utilization_curves({"r": t, "s": runs["swap"].trace}).axes[1]
    assert [list(line.get_ydata()) for line in free.lines] == [
        [rec.num_free_blocks for rec in run] for run in (t, runs["swap"].trace)
    ]


def test_compare_zooms_every_panel(runs):
    fig = viz.compare_slot_occupancy(
        {"s": runs["static"].trace, "c": runs["continuous"].trace}, steps=(3, 7)
    )
    panels = [ax for ax in fig.axes if ax.get_ylabel() == "slot"]
    assert len(panels) == 2 and all(ax.get_xlim() == (2.5, 7.5) for ax in panels)
    for ax, name in zip(panels, ("static", "continuous")):  # each panel is that run's own picture
        alone = viz.slot_occupancy(runs[name].trace).axes[0].images[0].get_array()
        assert np.array_equal(ax.images[0].get_array(), alone) and ax.get_title().startswith(
            name[0]
        )


def drawn_blocks(ax):
    """A fork_map panel read back: {kind: [(block id, first row, rows spanned), ...]} from its boxes
    and labels."""
    kind_of = {to_hex(color): kind for kind, (color, _) in viz.KINDS.items()}
    label_at = {tuple(np.round(t.get_position(), 3)): t.get_text() for t in ax.texts}
    drawn = {}
    for box in ax.patches:
        x, y = box.get_xy()
        label = label_at[tuple(np.round((x + 0.5, y + box.get_height() / 2), 3))]
        block = int(label.split()[0].removeprefix("#"))
        drawn.setdefault(kind_of[to_hex(box.get_facecolor())], []).append(
            (block, y, box.get_height())
        )
    return drawn


def test_parallel_sampling_figure_draws_what_the_block_manager_did():
    from minicb.viz import figures_blocks

    forked, separate, copies = figures_blocks.parallel_sampling_runs()
    step = figures_blocks.first_step_past_prompt(forked.trace, 200)
    rec = forked.trace[step - 1]
    fork_ax, separate_ax, bar_ax = figures.FIGURES["nb02_parallel_sampling"]().axes
    fork, sep = drawn_blocks(fork_ax), drawn_blocks(separate_ax)
    # The scheduler's own copies: the first decode step copies the shared partial block for 7 of the
    # 8 samples.
    made = [c for step_copies in copies.values() for c in step_copies]
    assert len(made) == 7 and copies[2] == made and len({src for src, _ in made}) == 1
    (src,) = {src for src, _ in made}
    table = rec.block_tables["0"]
    assert sorted(fork) == ["copied", "decode", "in place", "shared"]
    # each full prompt block once, across all 8 rows
    assert fork["shared"] == [(b, 0, 8) for b in table[:12]]
    assert sorted(b for b, *_ in fork["copied"]) == sorted(dst for _, dst in made)
    assert [b for b, *_ in fork["in place"]] == [src]  # the last writer kept the original
    assert len(fork["decode"]) == 8 and all(h == 1 for *_, h in fork["decode"] + fork["copied"])
    assert (
        sorted(sep) == ["decode", "private"]
        and len(sep["private"]) == 104
        and len(sep["decode"]) == 8
    )
    # Every block drawn once, and as many as the block manager counted as used in that step: 28
    # against 112.
    for ax_blocks, run, used in ((fork, forked, 28), (sep, separate, 112)):
        ids = [b for boxes in ax_blocks.values() for b, *_ in boxes]
        assert (
            len(ids)
            == len(set(ids))
            == run.trace.num_blocks - run.trace[step - 1].num_free_blocks
            == used
        )
    heights = {}
    for bar in bar_ax.patches:  # stacked: per kind, the forked bar then the separate one
        heights.setdefault(to_hex(bar.get_facecolor()), []).append(bar.get_height())
    assert {kind: heights[to_hex(c)] for kind, (c, _) in viz.KINDS.items()} == {
        "shared": [12, 0],
        "private": [0, 104],
        "copied": [7, 0],
        "in place": [1, 0],
        "decode": [8, 8],
    }


def test_a_prompt_that_fills_its_blocks_forks_without_copies():
    from minicb.viz import figures_blocks

    forked, separate, copies = figures_blocks.parallel_sampling_runs(
        n=4, prompt_len=192, output_len=4
    )
    # position 192 opens a new block for every sample: nothing to copy
    assert not any(copies.values())
    assert viz.count_kinds(viz.block_kinds(forked.trace, 2, 192)) == dict(
        shared=12, private=0, copied=0, **{"in place": 0}, decode=4
    )
    assert viz.count_kinds(viz.block_kinds(separate.trace, 2, 192)) == dict(
        shared=0, private=48, copied=0, **{"in place": 0}, decode=4
    )


def engine_core_protocol() -> tuple[dict[str, str], set[str]]:
    """From minicb/serve/engine_core.py's own code: {kind: the process that sends it} (the API side
    through RemoteEngine._send(kind, ...), the core through conn.send((kind, ...))), and the kinds
    the core's loop handles (`kind == "..."` in run_engine_core and _handle)."""
    path = Path(viz.__file__).parents[1] / "serve" / "engine_core.py"
    tree = ast.parse(path.read_text())
    sent, handled = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            first = node.args[0]
            if node.func.attr == "_send" and isinstance(first, ast.Constant):
                sent[first.value] = "api"
            elif (
                node.func.attr == "send"
                and getattr(node.func.value, "id", None) == "conn"
                and isinstance(first, ast.Tuple)
                and isinstance(first.elts[0], ast.Constant)
            ):
                sent[first.elts[0].value] = "core"
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef) and fn.name in ("run_engine_core", "_handle"):
            handled |= {
                c.comparators[0].value
                for c in ast.walk(fn)
                if isinstance(c, ast.Compare)
                and getattr(c.left, "id", None) == "kind"
                and isinstance(c.ops[0], ast.Eq)
            }
    return sent, handled


def test_engine_core_figure_draws_the_real_protocol_between_the_right_processes():
    from minicb.viz import processes

    fig = figures.FIGURES["nb10_engine_core"]()
    (ax,) = fig.axes
    boxes = {p.get_gid(): p for p in ax.patches if p.get_gid()}

    def inside(box, x, y=None):  # on the edge counts
        return box.get_x() - 1e-9 <= x <= box.get_x() + box.get_width() + 1e-9 and (
            y is None or box.get_y() <= y <= box.get_y() + box.get_height()
        )

    def side_of(x, y=None):
        """The process whose box holds x (and y, when given), or None."""
        found = [side for side in ("api", "core") if inside(boxes[f"process:{side}"], x, y)]
        return found[0] if len(found) == 1 else None

    api, core = boxes["process:api"], boxes["process:core"]
    # two boxes, side by side, the pipe between them
    assert api.get_x() + api.get_width() < core.get_x()
    # Every message: an arrow from its sender's box to the other box, as the code sends it.
    arrows = {
        t.get_gid().split(":", 1)[1]: t
        for t in ax.texts
        if (t.get_gid() or "").startswith("message:")
    }
    drawn = {}
    for kind, arrow in arrows.items():
        (tail_x, tail_y), (head_x, head_y) = arrow.xyann, arrow.xy
        sender, receiver = side_of(tail_x, tail_y), side_of(head_x, head_y)
        assert sender and receiver and sender != receiver and tail_y == head_y, kind
        drawn[kind] = sender
    sent, handled = engine_core_protocol()
    assert drawn == sent == {kind: sender for kind, sender, _ in processes.MESSAGES}
    assert sorted(drawn) == sorted(
        ["add", "abort", "stop", "shutdown", "ready", "step", "stats", "error"]
    )
    # the core handles every kind sent to it
    assert handled == {k for k, s in sent.items() if s == "api"}
    # no two arrows drawn over each other
    assert len({a.xy[1] for a in arrows.values()}) == len(arrows)
    labels = {t.get_gid(): t for t in ax.texts if t.get_gid()}
    for kind, arrow in arrows.items():  # its name sits on its arrow, in the pipe
        x, y = labels[f"label:{kind}"].get_position()
        assert (
            side_of(x) is None
            and 0 <= y - arrow.xy[1] < 0.3
            and labels[f"label:{kind}"].get_text() == kind
        )
    # Every part inside its own process's box and its own part box, top to bottom in the listed
    # order.
    for side, parts in (("api", processes.API_SIDE), ("core", processes.CORE_SIDE)):
        ys = []
        for name, _ in parts:
            x, y = labels[f"part:{side}:{name}"].get_position()
            assert side_of(x, y) == side and labels[f"part:{side}:{name}"].get_text() == name
            assert inside(boxes[f"box:{side}:{name}"], x, y)
            ys.append(y)
        assert ys == sorted(ys, reverse=True)
    # The parts named as code exist in minicb (Engine.add_samples -> `def add_samples`, Scheduler ->
    # `class Scheduler`).
    source = "\n".join(p.read_text() for p in Path(viz.__file__).parents[1].rglob("*.py"))
    for name, _ in processes.API_SIDE + processes.CORE_SIDE:
        for word in name.replace("+", " ").split():
            last = word.split(".")[-1]
            if (
                word[0].isupper() or "_" in word
            ) and word != "FastAPI":  # FastAPI: the web framework
                assert f"class {last}" in source or f"def {last}(" in source, word
    # With pids, each box names its process.
    titled = figures.FIGURES["nb10_engine_core"](api_pid=11, core_pid=22).axes[0].texts
    titles = {t.get_gid(): t.get_text() for t in titled if (t.get_gid() or "").startswith("title:")}
    assert titles == {
        "title:api": "API-server process (pid 11)",
        "title:core": "engine-core process (pid 22)",
    }


def test_every_registered_figure_draws(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    figures.add_arguments(parser)
    figures.main(parser.parse_args(["--out", str(tmp_path)]))
    written = sorted(p.stem for p in tmp_path.glob("*.png"))
    assert written == sorted(figures.FIGURES)
    assert all(p.stat().st_size > 10_000 for p in tmp_path.glob("*.png"))


def test_figures_count_kv_bytes_from_the_config():
    from minicb.worker.memory import DEFAULT_KV_CACHE_BYTES

    smollm2 = figures.CONFIGS["SmolLM2-135M"]  # 30 layers, 3 KV heads of 576 / 9 = 64, float32
    assert figures.kv_bytes(smollm2, "float32") == 2 * 30 * 3 * 64 * 4 == 46080
    assert figures.kv_bytes(figures.CONFIGS["Llama-2-7B"]) == figures.LLAMA2_7B[1]
    assert figures.CPU_KV_CACHE_BYTES == DEFAULT_KV_CACHE_BYTES
    assert "728 KV blocks of 16 tokens" in figures.requests_that_fit().axes[0].get_title()


def test_importing_viz_does_not_import_torch():
    code = "import sys, minicb.viz; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_viz_modules_import_no_cycle_and_no_private_names():
    package = Path(viz.__file__).parent
    imports = {}
    for path in package.glob("*.py"):
        tree = ast.parse(path.read_text())
        imports[path.stem] = {
            node.module or a.name
            for node in ast.walk(tree)  # `from .x import y` -> x
            if isinstance(node, ast.ImportFrom) and node.level == 1
            for a in node.names
        }
        reached = [
            a.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            for a in node.names
            if a.name.startswith("_")
        ]
        reached += [
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ]
        assert reached == [], (path.name, reached)

    def reaches(start, seen):
        for mod in imports.get(start, ()):
            if mod not in seen:
                seen.add(mod)
                reaches(mod, seen)
        return seen

    assert all(name not in reaches(name, set()) for name in imports), imports


def test_the_width_cost_figure_uses_the_engines_width_buckets():
    from minicb.viz.cuda_graphs import _powers
    from minicb.worker.cuda_graph import width_buckets

    assert all(_powers(n) == width_buckets(n) for n in range(1, 300))


PARTS_DRAWN = [
    ("host", "schedule"),
    ("host", "outputs"),
    ("device", "forward"),
    ("device", "sample"),
]


def test_engine_loop_timeline_draws_each_part_where_its_times_say():
    """Hand-made StepTimes (ms): the bars of each lane sit where the times put them, clipped to the
    window from the first shown step's forward pass to the last one's end."""
    from minicb.trace import RowRecord, StepRecord, StepTimes, Trace
    from minicb.viz.timeline import engine_loop_timeline

    def record(step, *ms):
        t = StepTimes(*(x / 1e3 for x in ms))
        rows = [RowRecord("a", 0, step, 1, False, True)]
        return StepRecord(step, rows, {}, 0, 0, 0, 1, 0, 1, 0, times=t)

    trace = Trace(1, 4, 16)
    # schedule, launch, device start, forward end, sample start, device end, outputs start, end
    trace.steps = [record(1, 0, 1, 1, 9, 9, 10, 10, 12), record(2, 12, 13, 13, 21, 21, 22, 22, 24)]
    fig = engine_loop_timeline({"sync": trace}, first=0, count=2)
    bars = {p.get_gid(): p for p in fig.axes[0].patches if p.get_gid()}
    drawn = {f"sync:{lane}:{part}:{s}" for s in (1, 2) for lane, part in PARTS_DRAWN}
    # step 1's schedule (0-1 ms) and step 2's outputs (22-24 ms) fall outside the window; no "wait":
    # sampling started when the forward pass ended
    assert set(bars) == drawn - {"sync:host:schedule:1", "sync:host:outputs:2"}
    forward = bars["sync:device:forward:2"]
    assert (forward.get_x(), forward.get_width()) == pytest.approx((12.0, 8.0))
    outputs = bars["sync:host:outputs:1"]
    assert (outputs.get_x(), outputs.get_width()) == pytest.approx((9.0, 2.0))
    with pytest.raises(ValueError, match="2 timed steps with rows"):
        engine_loop_timeline({"sync": trace}, first=1, count=2)
