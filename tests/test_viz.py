"""minicb.viz: every picture draws from real simulator traces, and what it draws is what happened.

The block pictures rebuild the KV pool of every step from the trace (viz.block_views); the
strongest check here is that this rebuild agrees, step by step, with the block manager's own
free and cached counts recorded in the trace, under preemption, swapping and prefix sharing.
"""

import sys

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from minicb import viz, viz_charts, viz_widgets  # noqa: E402
from minicb.config import EngineConfig  # noqa: E402
from minicb.sim import SimRequest, simulate  # noqa: E402

SYSTEM = list(range(500, 512))  # a 12-token shared prefix = 3 full blocks of 4


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
        reqs = [SimRequest(14, 6 + 2 * i, arrival_step=i + 1, prompt_token_ids=SYSTEM + [i, i])
                for i in range(3)]
        reqs.append(SimRequest(14, 4, arrival_step=14, prompt_token_ids=SYSTEM + [7, 7]))  # all others done
        return simulate(reqs, EngineConfig(max_num_seqs=4, block_size=4, num_blocks=16))
    if name == "priority":
        reqs = [SimRequest(8, 30, priority=5) for _ in range(2)] + [SimRequest(8, 5, arrival_step=4, priority=0)]
        return simulate(reqs, EngineConfig(max_num_seqs=2, block_size=4, num_blocks=32, scheduling_policy="priority"))
    if name == "chunked":
        reqs = [SimRequest(40, 6), SimRequest(4, 10), SimRequest(30, 3, arrival_step=3)]
        return simulate(reqs, EngineConfig(max_num_seqs=3, block_size=8, num_blocks=40, max_num_batched_tokens=16))
    raise KeyError(name)


SCENARIOS = ["static", "continuous", "recompute", "swap", "prefix", "priority", "chunked"]


@pytest.fixture(scope="module")
def runs():
    return {name: scenario(name) for name in SCENARIOS}


def test_scenarios_exercise_what_they_claim(runs):
    assert any(rec.preempted for rec in runs["recompute"].trace)
    assert any(rec.swapped_out for rec in runs["swap"].trace) and any(rec.swapped_in for rec in runs["swap"].trace)
    assert any(rec.preempted for rec in runs["priority"].trace)
    assert max(rec.num_cached_blocks for rec in runs["prefix"].trace) > 0


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_view_returns_a_figure(runs, name):
    res = runs[name]
    t = res.trace
    mid = t.steps[len(t) // 2].step
    figs = [viz.slot_occupancy(t), viz.memory_map(t), viz.block_grid(t, mid), viz.block_grid(t, None),
            viz.utilization_curves({name: t, "again": t}), viz.request_timeline(res.requests),
            viz.request_timeline(res.requests, trace=t),
            viz.latency_distributions({name: {"TTFT": [r.ttft_steps for r in res.requests],
                                              "latency": [r.latency_steps for r in res.requests]}}),
            viz.compare_slot_occupancy({"a": t, "b": runs["continuous"].trace}),
            viz.step_through(t), viz.step_through(t, views=("slots", "blocks", "memory"), step=mid)]
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
    # Request 0 computes the 3 prefix blocks in step 1; 1 and 2 arrive in steps 2 and 3 and share them.
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
    assert sum(r.is_prefill for r in rows) > len(t.request_ids())  # chunked: prompts over several steps
    img = ax.images[0].get_array()
    assert img.shape[:2] == (t.max_num_seqs, len(t))
    busy = sum(1 for i in range(img.shape[0]) for j in range(img.shape[1]) if tuple(img[i, j]) != (1, 1, 1, 1))
    assert busy == len(rows)


def test_timeline_phases_follow_the_trace(runs):
    res = runs["recompute"]
    victim = next(i for i, r in enumerate(res.requests) if r.num_preemptions)
    rid, spans = viz_charts._phases(res.requests[victim], victim, viz_charts._running_states(res.trace))
    states = [s for s, *_ in spans]
    assert states[0] == "prefill" and "paused" in states and states[-1] == "decode"
    ran = {rec.step for rec in res.trace for row in rec.rows if row.request_id == rid}
    paused = {k for s, a, b in spans if s == "paused" for k in range(a, b + 1)}
    r = res.requests[victim]
    assert paused == set(range(r.first_token_step, r.finish_step + 1)) - ran
    # Without a trace the same request is drawn from its four step numbers only.
    _, coarse = viz_charts._phases(r, victim, None)
    assert coarse[0] == ("prefill", 1, 1) and coarse[-1] == ("decode", 2, r.finish_step)


def test_timeline_accepts_dicts_and_shows_waiting():
    reqs = [dict(request_id="x", arrival_step=1, admitted_step=3, first_token_step=3, finish_step=6),
            dict(request_id="y", arrival_step=2, admitted_step=2, first_token_step=4, finish_step=4)]
    assert viz_charts._phases(reqs[0], 0, None)[1] == [("waiting", 1, 2), ("prefill", 3, 3), ("decode", 4, 6)]
    assert viz_charts._phases(reqs[1], 1, None)[1] == [("prefill", 2, 4)]
    fig = viz.request_timeline(reqs)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["x", "y"]


def test_latency_distributions_one_panel_per_metric():
    fig = viz.latency_distributions({"fifo": {"TTFT": [1, 2, 3], "TPOT": [1.0, 1.0]},
                                     "sjf": {"TTFT": [1, 1, 9]}}, unit="steps")
    assert [ax.get_title() for ax in fig.axes] == ["TTFT", "TPOT"]
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels[0].startswith("fifo (p50 2") and labels[1].startswith("sjf (p50 1")


def test_curves_and_bars():
    f = viz.curves([1, 2, 4], {"a": [1, 2, 3], "b": [1, 1, 1]}, "batch", "throughput", logx=True)
    assert len(f.axes[0].lines) == 2
    b = viz.bars({"x": {"static": 500, "continuous": 500}, "y": {"static": 2750, "continuous": 650}}, "steps")
    assert [t.get_text() for t in b.axes[0].texts] == ["500", "2750", "500", "650"]


def test_request_colors_distinct_and_never_grey():
    colors = list(viz.request_colors([str(i) for i in range(40)]).values())
    assert len(set(colors[:40])) == 40
    assert all(max(c[:3]) - min(c[:3]) > 0.05 for c in colors)  # grey is reserved for cached blocks


def test_same_request_same_colour_in_two_runs(runs):
    a = runs["static"].trace
    b = runs["continuous"].trace
    assert viz._colors(a) == viz._colors(b)


def test_step_views_validated(runs):
    t = runs["continuous"].trace
    with pytest.raises(ValueError, match="views"):
        viz.step_through(t, views=("slots", "nope"))
    with pytest.raises(ValueError, match="step 99"):
        viz.block_grid(t, 99)


def test_step_through_falls_back_without_widgets(runs, monkeypatch):
    t = runs["swap"].trace
    assert not viz_widgets.widgets_available()  # pytest is not a Jupyter kernel
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # and without ipywidgets installed
    assert not viz_widgets.widgets_available()
    fig = viz.step_through(t, step=5)
    assert isinstance(fig, Figure) and "step 5" in fig.axes[1].get_title()


def test_static_env_var_wins(monkeypatch):
    monkeypatch.setattr(viz_widgets, "widgets_available", lambda: False)
    monkeypatch.setenv("MINICB_STATIC_FIGURES", "1")
    t = scenario("continuous").trace
    assert isinstance(viz.step_through(t), Figure)


def test_slider_redraws_each_step(runs):
    pytest.importorskip("ipywidgets")
    t = runs["prefix"].trace
    box = viz_widgets.slider(t, ("slots", "blocks"), step=2)
    pick = box.children[0].children[1]
    record = box.children[1]
    assert "Step 2:" in record.value
    pick.value = 3
    assert "Step 3:" in record.value


def test_utilization_curves_counts_or_fractions(runs):
    t = runs["recompute"].trace
    top = viz.utilization_curves({"r": t}).axes[0]
    assert max(top.lines[0].get_ydata()) == 1.0  # 4 of 4 slots busy at the start
    counts = viz.utilization_curves({"r": t}, normalize=False).axes[0]
    assert list(counts.lines[0].get_ydata()) == [len(rec.rows) for rec in t]
    free = viz.utilization_curves({"r": t}).axes[1]
    assert list(free.lines[0].get_ydata()) == [rec.num_free_blocks for rec in t]


def test_compare_zooms_every_panel(runs):
    fig = viz.compare_slot_occupancy({"s": runs["static"].trace, "c": runs["continuous"].trace}, steps=(3, 7))
    panels = [ax for ax in fig.axes if ax.get_ylabel() == "slot"]
    assert len(panels) == 2 and all(ax.get_xlim() == (2.5, 7.5) for ax in panels)


def test_every_registered_figure_draws(tmp_path):
    import argparse

    from minicb import figures

    parser = argparse.ArgumentParser()
    figures.add_arguments(parser)
    figures.main(parser.parse_args(["--out", str(tmp_path)]))
    written = sorted(p.stem for p in tmp_path.glob("*.png"))
    assert written == sorted(figures.FIGURES)
    assert all(p.stat().st_size > 10_000 for p in tmp_path.glob("*.png"))
