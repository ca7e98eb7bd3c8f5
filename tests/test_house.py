"""The house rules of .ci/house.py, as tests: the engine stands apart from its surface, fits in a
learner's afternoon, and its pure-Python core imports no torch."""

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("house", ROOT / ".ci" / "house.py")
house = importlib.util.module_from_spec(spec)
spec.loader.exec_module(house)


def test_one_step_fits_the_limit():
    found = house.modules()
    assert sum(house.reader_lines(found[m]) for m in house.ONE_STEP) <= house.ONE_STEP_LIMIT


def test_no_file_is_too_long():
    assert house.long_files() == []


def test_the_engine_imports_nothing_from_the_surface():
    assert house.surface_imports_in_engine() == []


def test_every_import_points_down_and_none_in_a_circle():
    assert house.upward_imports() == []
    assert house.import_cycles() == []


def test_every_engine_line_fits_and_ruff_is_clean():
    assert house.long_lines() == []
    assert house.ruff_findings() == []


def test_every_module_has_a_room_on_a_floor():
    rooms = {room for _, rs in house.FLOORS for room in rs}
    assert {house.room_of(m) for m in house.modules()} <= rooms


def test_schedule_and_what_it_calls_fit_in_a_screen():
    methods = house.schedule_methods()
    assert {"schedule", "_schedule_running", "_schedule_swapped", "_schedule_waiting"} <= set(
        methods
    )
    assert {k: v for k, v in methods.items() if v > house.METHOD_LIMIT} == {}


def test_reader_lines_count_statements_not_the_lines_a_formatter_folds():
    source = (
        'def f(x):\n    """One.\n\n    Two."""\n    # why\n'
        "    return g(\n        x,\n        1,\n    )\n"
    )
    # the def, the docstring's 3 lines, the comment, the return folded over 4 lines: 6 (blank: 0)
    assert house.reader_line_numbers(source) == [1, 3, 4, 4, 5, 9]


def test_the_checks_can_fail(tmp_path, monkeypatch):
    # A file over the limit, an engine module importing the server and a long line must be reported.
    pkg = tmp_path / "minicb"
    (pkg / "serve").mkdir(parents=True)
    (pkg / "core").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "serve" / "__init__.py").write_text("")
    (pkg / "core" / "__init__.py").write_text("")
    (pkg / "serve" / "app.py").write_text("from ..core import scheduler\n")
    limit = house.LONGER_FILES["core.scheduler"][0]
    (pkg / "core" / "scheduler.py").write_text(
        "from ..serve import app\n" + "x = 1\n" * limit + "y = '" + "z" * 120 + "'\n"
    )
    monkeypatch.setattr(house, "PACKAGE", pkg)
    monkeypatch.setattr(house, "ROOT", tmp_path)
    assert house.long_files() == [f"core.scheduler ({limit + 2} reader lines, limit {limit})"]
    assert "core.scheduler imports serve.app" in house.surface_imports_in_engine()
    assert "core.scheduler (floor 1) imports serve.app (floor 6)" in house.upward_imports()
    assert house.import_cycles() == [["core.scheduler", "serve.app", "core.scheduler"]]
    assert house.long_lines() == [f"minicb/core/scheduler.py:{limit + 2} (126 characters)"]


def run_python(code: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout


def test_the_core_imports_no_torch():
    # conftest.py imports torch in this process, so the check needs a fresh interpreter.
    core = ", ".join(f"minicb.{m}" for m in house.CORE)
    out = run_python(f"import sys, {core}; print('torch' in sys.modules, 'numpy' in sys.modules)")
    assert out.split() == ["False", "False"]


def test_generate_loads_neither_the_server_nor_matplotlib():
    code = (
        "import sys; from minicb.__main__ import main\n"
        "try:\n    main(['generate', '--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('fastapi', 'uvicorn', 'matplotlib', 'minicb.serve.app')"
        " if m in sys.modules))"
    )
    assert run_python(code).strip().splitlines()[-1] == "[]"
