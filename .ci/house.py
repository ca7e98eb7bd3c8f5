"""The house of minicb, drawn from its imports: `python .ci/house.py` prints it and checks its rules.

  - the engine (what a learner reads to understand one step) fits in ENGINE_LIMIT lines;
  - no file of minicb/ is over FILE_LIMIT lines;
  - the engine's modules import nothing from the surface (minicb.viz, minicb.serve, minicb.bench);
  - no import cycle among minicb's modules (module-level imports);
  - Scheduler.schedule() and every method it calls fit in METHOD_LIMIT lines;
  - the pure-Python core imports no torch (checked in a fresh interpreter by tests/test_house.py).
tests/test_house.py runs the same checks, so a change that breaks a rule fails the suite.
"""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "minicb"
ENGINE_LIMIT, FILE_LIMIT, METHOD_LIMIT = 2300, 300, 40
# One step, as data flows: config -> requests -> scheduler (+ blocks) -> runner -> model (+ attention,
# KV cache) -> sampler -> engine; the CUDA-graph decode is one way the runner can run the model. This is
# vLLM's engine core. Setting it up once (worker.py: weights, KV sizing, graphs; weights.py: HF names) is not
# a step, and speculative decoding's proposer and verifier (spec_decode, rejection_sampler) are optional
# features like penalties and logprobs: the engine layer counts them, not this list. What turns its tokens into a user's outputs (output_processor, outputs,
# detokenizer: vLLM runs them in its API-server process) and the optional per-request features
# (penalties, logprobs) are engine modules too, counted in the engine layer's total, not here.
ONE_STEP = ["config", "request", "sampling_params", "block_manager", "scheduler", "scheduler_output",
            "model_runner", "kv_cache", "attention", "model", "sampler", "cuda_graph", "engine"]
CORE = ["config", "request", "sampling_params", "block_manager", "scheduler", "scheduler_output", "limits", "trace", "sim"]
SURFACE = ("viz", "serve", "bench")


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name relative to minicb ("engine", "serve.app", ...)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(p for p in parts if p != "__init__") or "__init__"
        found[name] = path
    return found


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def imports(name: str, path: Path, top_level_only: bool = True) -> set[str]:
    """The minicb modules `name` imports (as names relative to minicb)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    package = name.split(".")[:-1] if path.name != "__init__.py" else name.split(".")
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from .x import y / from ..x import y
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + (node.module.split(".") if node.module else []))
            elif node.module and node.module.startswith("minicb"):
                module = node.module.removeprefix("minicb").lstrip(".")
            else:
                continue
            out.add(module)  # and `from .serve import app` imports the submodule serve.app:
            out.update(f"{module}.{a.name}".lstrip(".") for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name.removeprefix("minicb").lstrip(".") for a in node.names if a.name.startswith("minicb"))
    known = modules()
    return {m for m in out if m in known and m != name}


def engine_modules() -> list[str]:
    return [m for m in modules() if not m.startswith(SURFACE) and m not in ("__main__", "__init__")]


def surface_imports_in_engine() -> list[str]:
    found = modules()
    bad = []
    for m in engine_modules():
        for target in imports(m, found[m], top_level_only=False):
            if target.startswith(SURFACE):
                bad.append(f"{m} imports {target}")
    return bad


def import_cycles() -> list[list[str]]:
    found = modules()
    graph = {m: imports(m, p) for m, p in found.items()}
    cycles, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        for t in graph[m]:
            if state.get(t) == "open":
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t, stack + [t])
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m, [m])
    return cycles


def long_files() -> list[str]:
    return [f"{m} ({lines(p)} lines)" for m, p in modules().items() if lines(p) > FILE_LIMIT]


def schedule_methods() -> dict[str, int]:
    """Scheduler.schedule and every Scheduler method it calls, directly or not: name -> lines."""
    tree = ast.parse((PACKAGE / "scheduler.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Scheduler")
    methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
    seen, todo = {}, ["schedule"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        node = methods[name]
        seen[name] = node.end_lineno - node.lineno + 1
        for call in ast.walk(node):
            if (isinstance(call, ast.Attribute) and isinstance(call.value, ast.Name) and call.value.id == "self"
                    and call.attr in methods):
                todo.append(call.attr)
    return seen


def main() -> int:
    found = modules()
    step = sum(lines(found[m]) for m in ONE_STEP)
    engine = sum(lines(found[m]) for m in engine_modules())
    surface = sum(lines(p) for m, p in found.items() if m.startswith(SURFACE))
    print(f"one step (what a learner reads to follow a step): {step} lines in {len(ONE_STEP)} files "
          f"(limit {ENGINE_LIMIT}): {', '.join(ONE_STEP)}")
    print(f"the whole engine layer (plus trace, sim, metrics, loader, tiny models, CPU kernels): {engine} lines")
    print(f"the surface (viz, serve, bench): {surface} lines")
    long_methods = {k: v for k, v in schedule_methods().items() if v > METHOD_LIMIT}
    problems = (
        ([f"one step is {step} lines, over {ENGINE_LIMIT}"] if step > ENGINE_LIMIT else [])
        + [f"long file: {f}" for f in long_files()]
        + [f"engine imports the surface: {b}" for b in surface_imports_in_engine()]
        + [f"import cycle: {' -> '.join(c)}" for c in import_cycles()]
        + [f"Scheduler.{k} is {v} lines (limit {METHOD_LIMIT})" for k, v in long_methods.items()])
    for p in problems:
        print("PROBLEM:", p)
    print("the house is in order" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
