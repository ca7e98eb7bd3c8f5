"""The house of minicb, drawn from its imports: `python .ci/house.py` prints it by room and checks
its rules.

  - each room imports only from its own floor or the floors below it (FLOORS), and nothing imports
    in a circle (module-level imports);
  - the engine's rooms import nothing from the surface (viz, serve, bench) nor from reference/;
  - one step (what a learner reads to follow one step of the engine) fits in ONE_STEP_LIMIT lines,
    counted as a reader reads them (READER_LINES: statements, comments and docstrings, not the
    lines a formatter folds one statement into, nor blank lines);
  - no file is over FILE_LIMIT reader lines, unless LONGER_FILES raises its limit and says why;
  - every line of the engine's rooms is at most MAX_LINE characters, and ruff finds nothing
    (`ruff check` and `ruff format --check`, configured in pyproject.toml);
  - Scheduler.schedule() and every method it calls fit in METHOD_LIMIT reader lines;
  - the pure-Python core imports no torch (checked in a fresh interpreter by tests/test_house.py).
tests/test_house.py runs the same checks, so a change that breaks a rule fails the suite.
"""

import ast
import io
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "minicb"
# ONE_STEP_LIMIT: 2300 physical lines of up to 120 characters before the rooms (2026-11-26); the
# same text, wrapped at 100 characters and counted in reader lines, is about 2315.
# 2450 since 2026-11-27: the scheduler's time budget and seat passing (issue 37) added ~50.
# 2460 since 2026-11-27: structured outputs (issue 33) added 28 to one step in vLLM V1's own places:
# a request's grammar and its waiting state, the engine holding it until its grammar is
# compiled and advancing it after sampling, the mask before sampling (the rest sits in
# structured_output/, outside one step). 2470: swap_out of a block copied on write in the same step
# (a bug that beam search's fuzzing found) swaps out the copy's source and cancels the copy (+9).
# 2555: async scheduling (issue 32) added 85 in vLLM V1's places: a request's output placeholders,
# the placeholder token a row feeds, the scheduler's two hooks that AsyncScheduler fills (its own
# file, core/async_scheduler.py, with the batch queue in engine/batch_queue.py, outside one step),
# and a step split into schedule / execute / process with the times of each. 2690: the runner takes
# a step's placeholder tokens from the step before on the device and leaves its own there (+30; the
# rest sits in worker/executor.py), and a speculative row is ONE decode row of 1 + k queries (+105):
# the metadata of such rows, the padded decode over right-aligned query slots, the graphs of uniform
# verify batches (vLLM V1's uniform decode). 2725: tenant fairness (issue 34) adds a request's
# tenant and the scheduler's hooks into core/fairness.py's Virtual Token Counter (+24), and the
# prefix cache's hit counts at first admission (vLLM V1's num_cached_tokens and PrefixCacheStats,
# +8). 2760: the engine loop on a real GPU (issue 32) needs host-to-device copies that do not wait
# for the device (to_device, vLLM's async_tensor_h2d, in each place a step copies a list), the
# heap frozen once the engine is built (vLLM V1's freeze_gc_heap) and vLLM's output_kind (+32).
# 2930 (2026-11-27, a later session): the engine loop measured on an H100 (issue 32) launches a
# step on the engine's own thread on CUDA (vLLM V1's way; the device thread stays for a CPU and for
# a step that waits for processing), records when a step's work is queued (StepTimes.queued), keeps
# the last steps' times for the benches, and asks whether a request's blocks already cover its step
# before can_allocate and allocate (most decode steps need no block) (+20).
# 3080 (2026-11-27, a later session): KV cache groups (issue 39, vLLM V1's hybrid KV cache
# manager) give a request a block table per group of layers, all from one pool: the block
# manager's books per group with the window's freeing and its prefix-hit rule (+90), the runner's
# and the graphs' metadata per group (+45), the cache tensors shared by the j-th layer of every
# group (+8) (the grouping rule and its numbers sit in core/kv_cache_groups.py, outside one step).
# 3135, the same day: Gemma 3 (text), the model whose local and global layers the groups are for
# (+55): Gemma's RMSNorm (gain 1 + w, in float32), its norms after attention and around the MLP, a
# RoPE table per layer type, the embedding scale, the logit cap and the refusals of what it lacks.
# 3137 (2026-11-27, a later session): gpt-oss, the model whose 1:1 windowed and full layers the
# groups are for (+5): its attention sinks, one parameter per layer handed to every attention path
# (the sinks' math, the router, the experts and their checkpoint layout sit in attention_sinks.py
# and gpt_oss.py, outside one step). 3142: a model with one RoPE table looks it up as before, twice
# a step, not once per layer (+5; notebooks 07 and 08 count a decode step's operators).
# 3160 (2026-11-28): faster weights on a CPU (issue 35) add two EngineConfig fields, dtype "auto"
# resolved when the engine is built and int8 weights swapped in by the worker (+17; the timing, the
# int8 linear and the choice sit in model_executor/cpu_precision.py, outside one step).
# 3170 (2026-11-28): flash pages for sliding windows and sinks (issue 39) give each KV cache group
# its own pages, cut to its window (+11; the window's cut and the sink's share of the combine sit in
# model_executor/paged_flash.py, outside one step).
ONE_STEP_LIMIT, FILE_LIMIT, METHOD_LIMIT, MAX_LINE = 3170, 300, 40, 100
# A file may be longer where splitting it would cut one idea in two: its limit and the reason.
LONGER_FILES = {
    "serve.engine_loop": (
        325,
        "the one thread that owns an engine: its bounds, aborts, stalls and isolation, and the "
        "liveness (failure, load) a data-parallel server routes by, and (2026-11-28, +5) which "
        "outputs its streams are handed (vLLM's stream interval)",
    ),
    "core.block_manager": (
        425,
        "one set of books, checked together by check_invariants: the free queue, the prefix "
        "cache's hash chain, fork and copy-on-write, V0's swap space, the CPU tier's hooks "
        "(a copy on eviction, a load on a hit), covers(), the decode step's fast path, and "
        "(since 2026-11-27, +90) a table per KV cache group from the one pool, a window's blocks "
        "freed as it moves and its prefix-hit rule",
    ),
    "core.scheduler": (
        430,
        "schedule() and update() are one loop read together: admission (seats passed fairly), "
        "the token and time budgets, preemption and the bookkeeping after the step, with the two "
        "hooks where AsyncScheduler counts a step before it has run, where the Virtual Token "
        "Counter charges tenants, the prefix cache's hit counts (the CPU tier's among them), and "
        "the decode's fast path past can_allocate",
    ),
}
# The floors, lowest first: a module imports from its own floor or the ones below, never above.
# Floor 0 is shared data; the engine's rooms follow one step's data flow (vLLM V1's rooms); the
# simulator and the notebooks' references sit on the engine's core; the surface sits on everything.
FLOORS = [
    (
        "shared data",
        ["config", "structured_outputs_params", "sampling_params", "metrics", "trace", "outputs"],
    ),
    ("the core: requests, scheduler, blocks (pure Python)", ["core"]),
    (
        "sampling, structured outputs, speculative decoding, the model",
        ["sample", "structured_output", "spec_decode", "model_executor"],
    ),
    ("the worker: runner, KV cache, graphs, memory", ["worker"]),
    ("the engine loop and the offline LLM", ["engine"]),
    ("the simulator and the notebooks' references", ["sim", "reference"]),
    (
        "the surface: figures, server, benchmarks, CLI",
        ["viz", "serve", "bench", "__main__", "__init__"],
    ),
]
ENGINE_ROOMS = (
    "config",
    "structured_outputs_params",
    "sampling_params",
    "metrics",
    "trace",
    "outputs",
    "core",
    "sample",
    "structured_output",
    "spec_decode",
    "model_executor",
    "worker",
    "engine",
)
# One step, as data flows: config -> requests -> scheduler (+ blocks) -> runner -> model (+
# attention, KV cache) -> sampler -> engine; the CUDA-graph decode is one way the runner can run the
# model. This is vLLM's engine core. Setting it up once (the worker: weights, KV sizing, graphs) is
# not a step; the optional features (penalties, logprobs, speculative decoding) and output
# processing are counted with the engine's rooms, not here.
ONE_STEP = [
    "config",
    "core.request",
    "sampling_params",
    "core.block_manager",
    "core.scheduler",
    "core.scheduler_output",
    "worker.model_runner",
    "worker.kv_cache",
    "model_executor.attention",
    "model_executor.model",
    "sample.sampler",
    "worker.cuda_graph",
    "engine.llm_engine",
]
CORE = [
    "config",
    "sampling_params",
    "metrics",
    "trace",
    "core.request",
    "core.block_manager",
    "core.scheduler",
    "core.scheduler_output",
    "core.limits",
    "sim",
]
SURFACE = ("viz", "serve", "bench")


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name relative to minicb ("core.scheduler", "serve.app",
    ...)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(p for p in parts if p != "__init__") or "__init__"
        found[name] = path
    return found


def room_of(module: str) -> str:
    return module.split(".")[0]


def floor_of(module: str) -> int:
    room = room_of(module)
    return next(i for i, (_, rooms) in enumerate(FLOORS) if room in rooms)


def reader_line_numbers(source: str) -> list[int]:
    """The lines a reader reads: one per statement however a formatter folds it (the line it ends
    on), plus every comment line and every line of a docstring; blank lines do not count."""
    counted = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.NEWLINE, tokenize.COMMENT):
            counted.append(tok.start[0])  # the end of a statement, or a comment
        elif tok.type == tokenize.STRING and tok.start[0] != tok.end[0]:
            counted += range(tok.start[0] + 1, tok.end[0] + 1)  # a docstring's other lines
    return counted


def reader_lines(path: Path) -> int:
    return len(reader_line_numbers(path.read_text()))


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
            out.update(
                a.name.removeprefix("minicb").lstrip(".")
                for a in node.names
                if a.name.startswith("minicb")
            )
    known = modules()
    return {m for m in out if m in known and m != name}


def engine_modules() -> list[str]:
    return [m for m in modules() if room_of(m) in ENGINE_ROOMS]


def surface_imports_in_engine() -> list[str]:
    """Imports (lazy ones included) from an engine room into the surface or the notebooks'
    references."""
    found = modules()
    bad = []
    for m in engine_modules():
        for target in imports(m, found[m], top_level_only=False):
            if target.startswith(SURFACE + ("reference",)):
                bad.append(f"{m} imports {target}")
    return bad


def upward_imports() -> list[str]:
    """Imports (lazy ones included) from a module into a room on a higher floor."""
    found = modules()
    bad = []
    for m, path in found.items():
        for target in imports(m, path, top_level_only=False):
            if floor_of(target) > floor_of(m):
                bad.append(f"{m} (floor {floor_of(m)}) imports {target} (floor {floor_of(target)})")
    return bad


def import_cycles() -> list[list[str]]:
    found = modules()
    graph = {m: imports(m, p) for m, p in found.items()}
    cycles, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        for t in graph[m]:
            if state.get(t) == "open":
                cycles.append(stack[stack.index(t) :] + [t])
            elif t not in state:
                visit(t, stack + [t])
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m, [m])
    return cycles


def long_files() -> list[str]:
    out = []
    for m, p in modules().items():
        limit = LONGER_FILES.get(m, (FILE_LIMIT, ""))[0]
        if reader_lines(p) > limit:
            out.append(f"{m} ({reader_lines(p)} reader lines, limit {limit})")
    return out


def long_lines() -> list[str]:
    """Lines of the engine's rooms over MAX_LINE characters."""
    found = modules()
    out = []
    for m in engine_modules():
        for number, line in enumerate(found[m].read_text().splitlines(), 1):
            if len(line) > MAX_LINE:
                out.append(f"{found[m].relative_to(ROOT)}:{number} ({len(line)} characters)")
    return out


def ruff_findings() -> list[str]:
    """What `ruff check` and `ruff format --check` report on the repository (ruff pinned in
    requirements)."""
    ruff = shutil.which("ruff")
    if ruff is None:
        return ["ruff is not installed (pip install -r requirements.txt)"]
    out = []
    check = ["check", "--quiet", "--output-format", "concise", "."]
    for args in (check, ["format", "--check", "--quiet", "--output-format", "concise", "."]):
        result = subprocess.run([ruff, *args], cwd=ROOT, capture_output=True, text=True)
        if result.returncode != 0:
            lines = (result.stdout + result.stderr).splitlines()
            out += [f"ruff {args[0]}: {line}" for line in lines if line.strip()]
    return out


def schedule_methods() -> dict[str, int]:
    """Scheduler.schedule and every Scheduler method it calls, directly or not: name -> reader
    lines."""
    source = (PACKAGE / "core" / "scheduler.py").read_text()
    counted = reader_line_numbers(source)
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Scheduler")
    methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
    seen, todo = {}, ["schedule"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        node = methods[name]
        seen[name] = sum(node.lineno <= line <= node.end_lineno for line in counted)
        for call in ast.walk(node):
            is_own_method = (
                isinstance(call, ast.Attribute)
                and isinstance(call.value, ast.Name)
                and call.value.id == "self"
                and call.attr in methods
            )
            if is_own_method:
                todo.append(call.attr)
    return seen


def draw() -> None:
    """The house by floor and room: each room's files and their reader lines."""
    found = modules()
    for i, (floor, rooms) in reversed(list(enumerate(FLOORS))):
        print(f"floor {i}: {floor}")
        for room in rooms:
            files = {m: reader_lines(p) for m, p in found.items() if room_of(m) == room}
            if not files:
                continue
            names = ", ".join(
                f"{m.removeprefix(room + '.')} {n}" for m, n in files.items() if m != room
            )
            where = f"minicb/{room}/" if (PACKAGE / room).is_dir() else f"minicb/{room}.py"
            print(f"  {where:<26} {sum(files.values()):>5} lines  {names}")


def main() -> int:
    found = modules()
    draw()
    step = sum(reader_lines(found[m]) for m in ONE_STEP)
    engine = sum(reader_lines(found[m]) for m in engine_modules())
    print(
        f"\none step (what a learner reads to follow a step): {step} reader lines in "
        f"{len(ONE_STEP)} files "
        f"(limit {ONE_STEP_LIMIT}): {', '.join(ONE_STEP)}"
    )
    print(f"the engine's rooms: {engine} reader lines")
    long_methods = {k: v for k, v in schedule_methods().items() if v > METHOD_LIMIT}
    problems = (
        (
            [f"one step is {step} reader lines, over {ONE_STEP_LIMIT}"]
            if step > ONE_STEP_LIMIT
            else []
        )
        + [f"long file: {f}" for f in long_files()]
        + [f"engine imports the surface or reference/: {b}" for b in surface_imports_in_engine()]
        + [f"import upward: {b}" for b in upward_imports()]
        + [f"import cycle: {' -> '.join(c)}" for c in import_cycles()]
        + [f"line over {MAX_LINE} characters: {f}" for f in long_lines()]
        + ruff_findings()
        + [f"Scheduler.{k} is {v} lines (limit {METHOD_LIMIT})" for k, v in long_methods.items()]
    )
    for p in problems:
        print("PROBLEM:", p)
    print("the house is in order" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
