"""Every notebook and its worked solution runs top to bottom in a fresh kernel, graded by nbgrader.

Run with `python -m pytest -m notebooks` (the fast suite deselects them; CI runs them separately).
The notebooks form an nbgrader course (notebooks/course.py) laid out inside the checkout, where
they find minicb and figures/ as a learner's would. Each notebook is submitted twice and run by
`nbgrader autograde` from a fresh kernel:

- the worked solution, on this machine's own CPU kernel choice and all its cores: no cell may
  raise, every self-check prints PASS and never FAIL, and nbgrader gives every test cell full marks;
- the learner's copy with its exercises unfilled, on the OTHER kernel choice (MINICB_CPU_KERNELS=
  other: torch.matmul where this machine chose oneDNN, and the reverse) and one torch thread
  (MINICB_NUM_THREADS=1): no cell may raise, every self-check prints FAIL, and nbgrader gives no
  test cell a point.

So a notebook whose asserts hold with one kernel or thread count only fails in CI, without running
anything twice. At least one figure (image/png) must come out of each run. The structural checks
(outputs stripped in git, a solution for every notebook, learners' copies as nbgrader writes them,
no assert on a live timing) are fast and run in the default suite.
"""

import ast
import importlib.util
import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
LEARNER = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
SOLUTIONS = sorted((NOTEBOOK_DIR / "solutions").glob("*.ipynb"))
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


def course():
    """notebooks/course.py, the nbgrader course tool, imported from its file."""
    spec = importlib.util.spec_from_file_location("course", NOTEBOOK_DIR / "course.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def nbgrader_cells(path: Path) -> dict[str, dict]:
    """grade_id -> the nbgrader metadata of each cell that has it, with the cell's type."""
    cells = json.loads(path.read_text())["cells"]
    return {
        c["metadata"]["nbgrader"]["grade_id"]: c["metadata"]["nbgrader"] | {"type": c["cell_type"]}
        for c in cells
        if "nbgrader" in c.get("metadata", {})
    }


@pytest.mark.parametrize("path", SOLUTIONS, ids=_id)
def test_every_exercise_is_an_nbgrader_answer_with_a_graded_self_check(path):
    cells = nbgrader_cells(path).values()
    answers = [c for c in cells if c["solution"] and c["type"] == "code"]
    tests = [c for c in cells if c["grade"] and not c["solution"]]
    written = [c for c in cells if c["grade"] and c["solution"]]
    assert answers, f"{_id(path)} marks no exercise cell as an nbgrader answer"
    assert tests and all(c["points"] > 0 and c["locked"] and c["type"] == "code" for c in tests), (
        f"{_id(path)}: every self-check is a locked autograder test with points"
    )
    # A written answer is graded by hand (nbgrader's "manually graded answer"): a markdown cell.
    assert all(c["type"] == "markdown" and c["points"] > 0 for c in written), (
        f"{_id(path)}: written answers"
    )


def test_learner_copies_are_what_nbgrader_writes(tmp_path):
    """The solution is the source; the learner's copy must be exactly what nbgrader generates."""
    tool = course()
    names = [p.stem for p in SOLUTIONS]
    root = tool.init(tmp_path / "course", names)
    for name, released in tool.generate(root, names).items():
        assert json.loads((NOTEBOOK_DIR / f"{name}.ipynb").read_text()) == json.loads(
            released.read_text()
        ), (
            f"notebooks/{name}.ipynb differs from its solution: edit the solution, then run "
            f"python notebooks/course.py learners {name}"
        )


# What reads a clock: a name that holds a value computed from one is a live timing, and an assert on
# it fails on a busy or slow machine (style.md: timings are printed, never asserted). The taint
# follows the notebook in order: through assignments, and through the notebook's own functions. A
# figure measured once and stored in figures/, or a time computed by a cost model, is no timing of
# this run: such an assert says "stored" or "model" in a comment on its line.
CLOCK_CALLS = {
    "perf_counter",
    "perf_counter_ns",
    "monotonic",
    "process_time",
    "timeit",
    "best_time",
    "time_linear",
    "gemm_peaks",
}  # and time.time(), matched on its own
CLOCK_FIELDS = {
    "arrival_time",
    "first_scheduled_time",
    "first_token_time",
    "last_token_time",
    "finished_time",
}
# Keys of what minicb's load generator and benchmarks report, measured on the wall clock.
CLOCK_KEYS = {
    "tokens_per_s",
    "requests_per_s",
    "output_tokens_per_s",
    "tpot",
    "tpot_p50",
    "tpot_p99",
    "ttft",
    "ttft_p50",
    "ttft_p99",
    "wall",
    "wall_s",
    "seconds",
}


def _reads_a_clock(node, tainted: set[str]) -> bool:
    """Whether an expression reads a clock, or a variable that holds a value read from one. A name
    that a comprehension inside the expression binds is that comprehension's own; a string key picks
    one field of a record, which is a timing only if its key names one (CLOCK_KEYS)."""
    local = {
        t for c in ast.walk(node) if isinstance(c, ast.comprehension) for t in _assigned(c.target)
    }

    def reads(n) -> bool:
        if (
            isinstance(n, ast.Subscript)
            and isinstance(n.slice, ast.Constant)
            and isinstance(n.slice.value, str)
        ):
            return n.slice.value in CLOCK_KEYS
        if isinstance(n, ast.Name):
            return n.id not in local and (n.id in tainted or n.id in CLOCK_CALLS)
        if isinstance(n, ast.Attribute):
            is_time_time = (
                n.attr == "time" and isinstance(n.value, ast.Name) and n.value.id == "time"
            )
            if n.attr in CLOCK_CALLS or n.attr in CLOCK_FIELDS or is_time_time:
                return True
        return any(reads(child) for child in ast.iter_child_nodes(n))

    return reads(node)


def _assigned(node) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _timing_parts(value, tainted: set[str], returns: dict) -> list[bool] | bool:
    """Which parts of a value are timings: one flag per element of a tuple (a tuple display, or a
    call of a notebook function that returns one), or one flag for the whole value."""
    if isinstance(value, ast.Tuple):
        return [_timing_parts(e, tainted, returns) for e in value.elts]
    if (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Name)
        and value.func.id in returns
    ):
        return returns[value.func.id]
    return _reads_a_clock(value, tainted)


def _any_timing(parts) -> bool:
    return parts if isinstance(parts, bool) else any(_any_timing(p) for p in parts)


def live_timing_asserts(cells: list[str]) -> list[str]:
    """The asserts of a notebook (its code cells' sources, in order) that read a timing measured in
    this run. A name holds a timing from an assignment that reads a clock until one that does not;
    a function whose return value reads a clock returns a timing (element by element for a
    tuple)."""
    offending = []
    returns: dict[
        str, list[bool] | bool
    ] = {}  # the notebook's functions: which parts of what they return

    def assign(target, parts, tainted):
        if (
            isinstance(target, (ast.Tuple, ast.List))
            and isinstance(parts, list)
            and len(parts) == len(target.elts)
        ):
            for element, part in zip(target.elts, parts):
                assign(element, part, tainted)
        elif _any_timing(parts):
            tainted.update(_assigned(target))
        elif isinstance(target, (ast.Name, ast.Tuple, ast.List)):
            tainted.difference_update(_assigned(target))

    def visit(statements, tainted, source, lines) -> list:
        """Follow the statements in order, updating `tainted`; the timing parts of each `return`."""
        returned = []
        for node in statements:
            if isinstance(node, ast.FunctionDef):
                parts = visit(node.body, set(tainted), source, lines)
                lengths = {len(p) for p in parts if isinstance(p, list)}
                if len(lengths) == 1 and all(isinstance(p, list) for p in parts):
                    returns[node.name] = [
                        any(_any_timing(p[i]) for p in parts) for i in range(lengths.pop())
                    ]
                else:
                    returns[node.name] = any(_any_timing(p) for p in parts)
                (tainted.add if returns[node.name] is True else tainted.discard)(node.name)
                continue
            if isinstance(node, ast.Return) and node.value is not None:
                returned.append(_timing_parts(node.value, tainted, returns))
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                parts = _timing_parts(node.value, tainted, returns)
                for target in getattr(node, "targets", [getattr(node, "target", None)]):
                    assign(target, parts, tainted)
            elif isinstance(node, ast.AugAssign) and _reads_a_clock(node.value, tainted):
                tainted.update(_assigned(node.target))
            elif isinstance(node, ast.Assert) and _reads_a_clock(node.test, tainted):
                comment = " ".join(lines[node.lineno - 1 : node.end_lineno])
                if not re.search(r"#.*\b(stored|model)", comment):
                    offending.append(
                        f"assert {(ast.get_source_segment(source, node.test) or '')[:100]}"
                    )
            elif isinstance(node, (ast.For, ast.AsyncFor)):
                assign(node.target, _reads_a_clock(node.iter, tainted), tainted)
            for field in ("body", "orelse", "finalbody"):
                returned += visit(getattr(node, field, []), tainted, source, lines)
            for handler in getattr(node, "handlers", []):
                returned += visit(handler.body, tainted, source, lines)
        return returned

    tainted: set[str] = set()
    for source in cells:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue  # IPython magics: nothing to check
        visit(tree.body, tainted, source, source.splitlines())
    return offending


def test_the_timing_lint_finds_a_live_timing_and_spares_the_rest():
    cells = [
        "import time\ndef run(n):\n    t = time.perf_counter()\n    outs = work(n)\n"
        "    return outs, n / (time.perf_counter() - t)",
        "(outs1, one), (outs8, many) = run(1), run(8)\nratio = many / one",
        "assert ratio > 2",
        "assert outs1 == outs8[:1]",
        "steps = simulate(reqs).num_steps\nassert steps == 12",
        "assert load['tokens_per_s'] > 0 and load['done'] == 8",
        "assert stored['eager_ms'] > 1  # stored: figures/gpu_h200_2026-11-26.jsonl",
        "ratio = 3\nassert ratio > 2",
    ]
    assert live_timing_asserts(cells) == [
        "assert ratio > 2",
        "assert load['tokens_per_s'] > 0 and load['done'] == 8",
    ]


@pytest.mark.parametrize("path", LEARNER + SOLUTIONS, ids=_id)
def test_no_assert_on_a_live_timing(path):
    cells = [
        "".join(c["source"])
        for c in json.loads(path.read_text())["cells"]
        if c["cell_type"] == "code"
    ]
    offending = live_timing_asserts(cells)
    assert not offending, f"{_id(path)} asserts on a timing measured in this run: {offending}"


# ---------------------------------------------------------------------- executed and graded
RUNS = {  # student -> (the copy submitted, the environment its kernel runs in)
    "solutions": (NOTEBOOK_DIR / "solutions", {}),
    "learner": (NOTEBOOK_DIR, {"MINICB_CPU_KERNELS": "other", "MINICB_NUM_THREADS": "1"}),
}


@pytest.fixture(scope="session")
def graded_course():
    """An nbgrader course inside the checkout (build/ is ignored by git), every notebook
    generated."""
    tool = course()
    root = ROOT / "build" / f"nbgrader-course-{os.getpid()}"
    shutil.rmtree(root, ignore_errors=True)
    names = [p.stem for p in SOLUTIONS]
    tool.init(root, names)
    tool.generate(root, names)
    yield tool, root
    shutil.rmtree(root, ignore_errors=True)


def scores(root: Path, name: str, student: str) -> dict[str, tuple[float, float]]:
    """grade_id -> (auto score, max score) of each test cell, from the course's gradebook."""
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{root / 'gradebook.db'}") as gradebook:
        notebook = gradebook.find_submission_notebook(name, name, student)
        return {
            g.name: (g.auto_score, g.max_score)
            for g in notebook.grades
            if g.cell.cell_type == "code"
        }


@pytest.mark.notebooks
@pytest.mark.timeout(
    2400
)  # a whole notebook on one thread of a busy machine; cells time out at 600 s
@pytest.mark.parametrize(
    "student, name",
    [(s, p.stem) for s in RUNS for p in SOLUTIONS],
    ids=[f"{s}/{p.stem}" for s in RUNS for p in SOLUTIONS],
)
def test_notebook_executes_and_autogrades(graded_course, student, name, monkeypatch):
    tool, root = graded_course
    folder, env = RUNS[student]
    submitted = root / "submitted" / student / name
    submitted.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(folder / f"{name}.ipynb", submitted / f"{name}.ipynb")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # The kernel imports this checkout's minicb, and draws figures inline even where the test
    # process itself runs with a non-interactive backend (MPLBACKEND=Agg in CI).
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    )
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    t0 = time.perf_counter()
    result = tool.api(root).autograde(name, student, force=True, create=True)
    took = time.perf_counter() - t0
    assert result["success"], (
        f"nbgrader autograde {name} ({student}) failed:\n{result['log']}\n{result['error']}"
    )
    # Printed, never asserted: a busy or slow machine takes longer (style.md). notebooks/README.md
    # lists the measured times.
    over = (
        f" (over the {NOTEBOOK_BUDGET_S} s a notebook should take on an idle laptop)"
        if took > NOTEBOOK_BUDGET_S
        else ""
    )
    print(
        f"{student}/{name} executed and graded in {took:.1f} s{over} "
        f"with {env or 'the machine defaults'}"
    )

    nb = nbformat.read(root / "autograded" / student / name / f"{name}.ipynb", as_version=4)
    errors = [
        (i, o.get("ename"), o.get("evalue"))
        for i, c in enumerate(nb.cells)
        for o in c.get("outputs", [])
        if o.get("output_type") == "error"
    ]
    assert not errors, f"{student}/{name}: cells raised {errors}"
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert images, f"{student}/{name} produced no figure"
    text = _outputs_text(nb)
    graded = scores(root, name, student)
    assert graded, f"{name}: nbgrader found no test cell"
    if student == "solutions":
        assert "PASS" in text and "FAIL" not in text, f"{name}: every self-check must print PASS"
        assert all(score == most for score, most in graded.values()), (
            f"{name}: not full marks: {graded}"
        )
    else:
        assert "FAIL" in text, f"{name}: an unfilled exercise's self-check must print FAIL"
        assert all(score == 0 for score, _ in graded.values()), (
            f"{name}: points for empty exercises: {graded}"
        )
