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
    assert sum(house.lines(found[m]) for m in house.ONE_STEP) <= house.ENGINE_LIMIT


def test_no_file_is_too_long():
    assert house.long_files() == []


def test_the_engine_imports_nothing_from_the_surface():
    assert house.surface_imports_in_engine() == []


def test_no_import_cycles():
    assert house.import_cycles() == []


def test_schedule_and_what_it_calls_fit_in_a_screen():
    methods = house.schedule_methods()
    assert {"schedule", "_schedule_running", "_schedule_swapped", "_schedule_waiting"} <= set(methods)
    assert {k: v for k, v in methods.items() if v > house.METHOD_LIMIT} == {}


def test_the_checks_can_fail(tmp_path, monkeypatch):
    # A file over the limit and an engine module importing the server must be reported.
    pkg = tmp_path / "minicb"
    (pkg / "serve").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "serve" / "__init__.py").write_text("")
    (pkg / "serve" / "app.py").write_text("from ..engine import x\n")
    (pkg / "engine.py").write_text("from .serve import app\n" + "x = 1\n" * 400)
    monkeypatch.setattr(house, "PACKAGE", pkg)
    assert house.long_files() == ["engine (401 lines)"]
    assert "engine imports serve.app" in house.surface_imports_in_engine()
    assert house.import_cycles() == [["engine", "serve.app", "engine"]]


def run_python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def test_the_core_imports_no_torch():
    # conftest.py imports torch in this process, so the check needs a fresh interpreter.
    core = ", ".join(f"minicb.{m}" for m in house.CORE)
    out = run_python(f"import sys, {core}; print('torch' in sys.modules, 'numpy' in sys.modules)")
    assert out.split() == ["False", "False"]


def test_generate_loads_neither_the_server_nor_matplotlib():
    code = ("import sys; from minicb.__main__ import main\n"
            "try:\n    main(['generate', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('fastapi', 'uvicorn', 'matplotlib', 'minicb.serve.app') if m in sys.modules))")
    assert run_python(code).strip().splitlines()[-1] == "[]"
