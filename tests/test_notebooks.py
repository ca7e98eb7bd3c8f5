"""Every notebook and its worked solution runs top to bottom in a fresh kernel.

Run with `python -m pytest -m notebooks` (the fast suite deselects them; CI runs them separately).
Each notebook executes with nbclient in its own folder, as a learner would open it: any error
fails the test, at least one figure (image/png) must come out, worked solutions must print PASS
and never FAIL, and learners' versions must print FAIL (not crash) while their exercises are empty.
The structural checks (outputs stripped in git, a solution for every notebook) are fast and run in
the default suite.
"""

import os
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
LEARNER = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
SOLUTIONS = sorted((NOTEBOOK_DIR / "solutions").glob("*.ipynb"))
CELL_TIMEOUT_S = 300
NOTEBOOK_BUDGET_S = 120  # "well under two minutes on a laptop CPU": a notebook over it fails


def _id(path: Path) -> str:
    return str(path.relative_to(NOTEBOOK_DIR))


def _outputs_text(nb) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                parts.append(out.get("text", ""))
            elif "text/plain" in out.get("data", {}):
                parts.append(out["data"]["text/plain"])
    return "\n".join(parts)


@pytest.mark.parametrize("path", LEARNER + SOLUTIONS, ids=_id)
def test_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, (
                f"{_id(path)} cell {i} has outputs: strip them before committing"
            )


def test_every_notebook_has_a_worked_solution():
    assert LEARNER, "no notebooks found"
    assert [p.name for p in LEARNER] == [p.name for p in SOLUTIONS]


@pytest.mark.parametrize("path", SOLUTIONS, ids=_id)
def test_learner_notebook_is_written_from_its_solution(path):
    """The solution is the source; the learner's copy must be exactly what make_learner.py
    writes."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("make_learner", NOTEBOOK_DIR / "make_learner.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    expected = make.dump(make.learner_version(json.loads(path.read_text())))
    assert (NOTEBOOK_DIR / path.name).read_text() == expected, (
        f"notebooks/{path.name} differs from its solution: edit the solution, then run python "
        "notebooks/make_learner.py"
    )
    starters = sum(
        "starter" in c.get("metadata", {}).get("minicb", {})
        for c in json.loads(path.read_text())["cells"]
    )
    assert starters >= 1, f"{_id(path)} marks no exercise cell with a starter"


@pytest.mark.notebooks
@pytest.mark.parametrize("path", LEARNER + SOLUTIONS, ids=_id)
def test_notebook_executes(path, monkeypatch):
    nbclient = pytest.importorskip("nbclient")
    # The kernel imports this checkout's minicb, and draws figures inline even where the test
    # process itself runs with a non-interactive backend (MPLBACKEND=Agg in CI).
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    )
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(path, as_version=4)
    t0 = time.perf_counter()
    nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(path.parent)}},
    ).execute()
    took = time.perf_counter() - t0
    # Printed, never asserted: a busy or slow machine takes longer (style.md), and the cell timeout
    # already stops a notebook that hangs. notebooks/README.md lists the measured times.
    over = (
        f" (over the {NOTEBOOK_BUDGET_S} s a notebook should take on an idle laptop)"
        if took > NOTEBOOK_BUDGET_S
        else ""
    )
    print(f"{_id(path)} executed in {took:.1f} s{over}")

    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert images, f"{_id(path)} produced no figure"
    text = _outputs_text(nb)
    if path.parent.name == "solutions":
        assert "PASS" in text and "FAIL" not in text, (
            f"{_id(path)}: every self-check must print PASS"
        )
    else:
        assert "FAIL" in text, f"{_id(path)}: an unfilled exercise's self-check must print FAIL"
