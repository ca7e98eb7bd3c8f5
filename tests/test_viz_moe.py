"""The figures of notebook 20 (minicb/viz/moe.py): each draws what it is given, read back from the
figure's artists: the measured points and the formula, bytes and intensity, the experts x steps
image, one step's bars by rank, and max / mean per step."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from minicb import viz  # noqa: E402
from minicb.trace import RowRecord, StepRecord, Trace  # noqa: E402


def moe_trace():
    """Three hand-made steps of 2 MoE layers, 4 experts: step 2 ran nothing (no expert load)."""
    loads = {1: ((3, 1, 0, 2), (1, 1, 2, 2)), 2: None, 3: ((0, 4, 4, 0), (2, 2, 2, 2))}
    trace = Trace(2, 8, 4)
    for step, load in loads.items():
        rows = [RowRecord("a", 0, step, 3, False, True)] if load else []
        trace.steps.append(
            StepRecord(step, rows, {}, 0, 0, 0, 1, 0, 3 if load else 0, 0, expert_load=load)
        )
    return trace


def test_experts_touched_draws_the_measured_points_and_the_formula():
    from minicb.viz.moe import uniform_experts_touched

    assert uniform_experts_touched(8, 2, 1) == 2 and uniform_experts_touched(8, 8, 3) == 8
    fig = viz.experts_touched([1, 2, 4], [2, 3.5, 5], 8, 2, others={"mine": [2, 3, 4]})
    lines = {line.get_label(): line for line in fig.axes[0].lines}
    measured = lines["measured on the engine"]
    assert list(measured.get_xdata()) == [1, 2, 4] and list(measured.get_ydata()) == [2, 3.5, 5]
    assert list(lines["mine"].get_ydata()) == [2, 3, 4]
    formula = next(line for label, line in lines.items() if label.startswith("uniform"))
    xs, ys = formula.get_xdata(), formula.get_ydata()
    assert (xs[0], xs[-1]) == pytest.approx((1, 4))
    assert (ys[0], ys[-1]) == pytest.approx((2, 8 * (1 - 0.75**4)))


def test_moe_roofline_draws_bytes_and_intensity():
    batches = [1, 2, 4]
    weight_bytes = {"dense": [4e9, 4e9, 4e9], "moe": [4e9, 6e9, 9e9]}
    flops = {"dense": [2e9, 4e9, 8e9], "moe": [2e9, 4e9, 8e9]}
    left, right = viz.moe_roofline(batches, weight_bytes, flops, ridge=1.0).axes
    assert [list(line.get_ydata()) for line in left.lines] == [[4, 4, 4], [4, 6, 9]]
    moe = [line for line in right.lines if line.get_label() == "moe"][0]
    assert list(moe.get_ydata()) == pytest.approx([0.5, 4 / 6, 8 / 9])
    dense = [line for line in right.lines if line.get_label() == "dense"][0]
    assert list(dense.get_ydata()) == [0.5, 1.0, 2.0]
    ridge = [line for line in right.lines if list(line.get_ydata()) == [1.0, 1.0]]
    assert ridge and right.get_yscale() == "log"


def test_expert_load_map_is_experts_by_steps():
    fig = viz.expert_load_map(moe_trace(), layer=0, num_ranks=2, highlight_step=3)
    ax = fig.axes[0]
    image = ax.images[0].get_array()
    assert image.tolist() == [[3, 0, 0], [1, 0, 4], [0, 0, 4], [2, 0, 0]]  # step 2: no tokens
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]
    assert [line.get_ydata()[0] for line in ax.lines] == [1.5]  # between experts 1 and 2
    second = viz.expert_load_map(moe_trace(), layer=1).axes[0].images[0].get_array()
    assert second[:, 2].tolist() == [2, 2, 2, 2]
    with pytest.raises(ValueError, match="no expert load"):
        trace = moe_trace()
        for s in trace.steps:
            s.expert_load = None
        viz.expert_load_map(trace)


def test_expert_step_colours_experts_by_rank(monkeypatch):
    fig = viz.expert_step(moe_trace(), step=3, layer=0, num_ranks=2)
    ax = next(a for a in fig.axes if a.get_xlabel() == "expert")  # below the map and its colorbar
    bars = ax.patches
    assert [p.get_height() for p in bars] == [0, 4, 4, 0]
    assert len({to_hex(bars[0].get_facecolor()), to_hex(bars[1].get_facecolor())}) == 1
    assert to_hex(bars[1].get_facecolor()) != to_hex(bars[2].get_facecolor())
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["rank 0: 4", "rank 1: 4"]
    monkeypatch.setenv("MINICB_STATIC_FIGURES", "1")
    assert isinstance(viz.expert_step_through(moe_trace(), num_ranks=2), Figure)


def test_rank_load_draws_each_placement_and_max_over_mean():
    loads = {"contiguous": [[6, 2], [0, 0], [3, 3]], "rebalanced": [[4, 4], [0, 0], [2, 4]]}
    fig = viz.rank_load(loads)
    assert len(fig.axes) == 3
    assert [list(line.get_ydata()) for line in fig.axes[0].lines] == [[6, 0, 3], [2, 0, 3]]
    by_label = {line.get_label(): list(line.get_ydata()) for line in fig.axes[2].lines}
    assert by_label["contiguous: 1.29 over the run"] == pytest.approx([1.5, 1.0])  # (6 + 3) / 7
    assert by_label["rebalanced: 1.14 over the run"] == pytest.approx([1.0, 4 / 3])  # 8 / 7
    assert list(fig.axes[2].lines[0].get_xdata()) == [1, 3]  # the idle step 2 is left out
