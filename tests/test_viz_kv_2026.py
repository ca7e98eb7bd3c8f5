"""minicb.viz.kv_2026, notebook 21's figures: each draws the numbers it is given (bar heights, line
data), on the scales and with the marks it promises, and the module imports no torch."""

import subprocess
import sys

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from minicb.viz import kv_2026  # noqa: E402


def heights(ax):
    return [p.get_height() for p in ax.patches]


def test_bytes_per_token_draws_bytes_and_the_tokens_a_budget_holds():
    per_token = {
        "MLA": 70_272,
        "GQA": 327_680,
        "a very long label for multi-head attention": 2_621_440,
    }
    fig = kv_2026.bytes_per_token(per_token, 40e9, title="t")
    assert isinstance(fig, Figure) and len(fig.axes) == 2
    left, right = fig.axes
    assert heights(left) == pytest.approx([n / 1024 for n in per_token.values()])
    assert heights(right) == pytest.approx([40e9 / n for n in per_token.values()])
    assert left.get_yscale() == right.get_yscale() == "log"
    labels = [t.get_text() for t in left.get_xticklabels()]
    assert labels[:2] == ["MLA", "GQA"] and "\n" in labels[2]  # a long label is wrapped
    assert "40 GB" in right.get_title()


def test_decode_reads_draws_one_line_per_form_on_log_axes():
    lens = [1024, 4096, 16384]
    read = {"absorbed": [2**20, 4 * 2**20, 16 * 2**20], "expanded": [2**26, 2**28, 2**30]}
    macs = {"absorbed": [1e8, 4e8, 1.6e9], "expanded": [1e10, 4e10, 1.6e11]}
    fig = kv_2026.decode_reads(lens, read, macs)
    left, right = fig.axes
    assert [list(line.get_xdata()) for line in left.lines] == [lens, lens]
    assert [list(line.get_ydata()) for line in left.lines] == [[1, 4, 16], [64, 256, 1024]]  # MiB
    assert [list(line.get_ydata()) for line in right.lines] == [macs["absorbed"], macs["expanded"]]
    assert left.get_xscale() == "log" and left.get_yscale() == "log"
    assert len(kv_2026.decode_reads(lens, read).axes) == 1  # the work panel only when given


def test_tier_sweep_draws_share_and_ttft_against_the_blocks_added_and_marks_the_pool():
    sizes = [0, 48, 96, 192]
    share = {"tier": [0.1, 0.2, 0.4, 0.6], "pool": [0.1, 0.25, 0.45, 0.6]}
    ttft = {"p50": [13, 12, 8, 3], "mean": [19, 18, 10, 4]}
    fig = kv_2026.tier_sweep(sizes, share, ttft, pool_blocks=96)
    left, right = fig.axes
    curves = [line for line in left.lines if line.get_label() in share]
    assert [list(line.get_ydata()) for line in curves] == list(share.values())
    assert [list(line.get_ydata()) for line in right.lines if line.get_label() in ttft] == [
        [13, 12, 8, 3],
        [19, 18, 10, 4],
    ]
    assert left.get_ylim() == (0, 1)
    for ax in (left, right):  # the pool's size, as a vertical line
        assert any(list(line.get_xdata()) == [96, 96] for line in ax.lines)


def test_tier_traffic_draws_loads_up_and_offloads_down():
    fig = kv_2026.tier_traffic(
        [1, 2, 3], offloaded=[0, 2, 1], loaded=[0, 0, 3], marks={"turn 2": 2}, block_bytes=4096
    )
    ax = fig.axes[0]
    assert heights(ax) == [0, 0, 3, 0, -2, -1]  # the loads' bars, then the offloads' below zero
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["loaded back: 3 blocks (4 KiB each)", "copied to the tier: 3 blocks"]
    assert any(list(line.get_xdata()) == [1.5, 1.5] for line in ax.lines)  # turn 2 begins at 2
    assert any(t.get_text() == "turn 2" for t in ax.texts)


def test_the_module_imports_no_torch():
    code = "import sys, minicb.viz.kv_2026; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_group_pages_draws_held_given_back_and_not_yet_per_group():
    full = [[3], [3, 4], [3, 4, 9]]
    window = [[5], [5, 6], [None, 6, 7]]  # block 0 left the window after step 3
    fig = kv_2026.group_pages([1, 2, 3], [full, window], ["full", "window 4"], title="t")
    assert isinstance(fig, Figure) and len(fig.axes) == 2
    left, right = fig.axes
    grid = right.images[0].get_array().tolist()
    assert grid == [[2, 2, 1], [0, 2, 2], [0, 0, 2]]  # rows: logical blocks 0, 1, 2
    assert left.images[0].get_array().tolist() == [[2, 2, 2], [0, 2, 2], [0, 0, 2]]
    assert "at most 2 held" in right.get_title() and "at most 3 held" in left.get_title()
    assert {t.get_text() for t in right.texts} == {"5", "6", "7"}
