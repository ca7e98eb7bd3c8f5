"""The course as an nbgrader course: the learners' copies, and a course directory for a lab.

The worked solutions in `notebooks/solutions/` are the one source of each notebook. They carry
nbgrader's cell metadata (https://nbgrader.readthedocs.io, "Developing assignments"):

- an exercise cell is an *autograded answer*: the starter a learner gets, then the worked answer
  between `### BEGIN SOLUTION` and `### END SOLUTION`, which nbgrader removes;
- the self-check after it is an *autograder test* with points: it prints PASS, or FAIL on stderr,
  and nbgrader gives no points to a test cell that writes to stderr or raises;
- the cell that defines `self_check` is *read-only*.

Two commands, both run nbgrader itself (no copy of its logic here):

    python notebooks/course.py learners [NAME ...]   # rewrite notebooks/NAME.ipynb from its solution
    python notebooks/course.py init DIR              # lay out DIR as an nbgrader course for a lab

`learners` builds a throw-away course, runs `nbgrader generate_assignment` on each solution and
copies the released notebook over the learner's copy; tests/test_notebooks.py fails when a
committed learner copy differs from what nbgrader writes. `init` writes DIR/nbgrader_config.py and
DIR/source/NAME/NAME.ipynb for every notebook; notebooks/README.md lists the commands that follow
(generate, release, collect, autograde, feedback).
"""

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOLUTIONS = HERE / "solutions"

# What replaces a worked answer in the learner's copy: nothing. The starter above the solution
# region (a `None` to fill in, a function body of `...`) is what the learner completes.
CONFIG = '''\
# nbgrader's configuration for the minicb course (written by `python notebooks/course.py init`).
c = get_config()  # noqa: F821 (nbgrader defines it)
c.CourseDirectory.root = {root!r}
c.CourseDirectory.course_id = "minicb"
# An exercise cell keeps its starter; the worked answer below it is removed, and nothing replaces it.
c.ClearSolutions.code_stub = {{"python": ""}}
c.ClearSolutions.text_stub = ""  # a written answer keeps its prompt ("*Your answer:*") and nothing else
# The notebooks load a model and time things: a cell may take minutes on a busy laptop.
c.Execute.timeout = 600
c.Execute.interrupt_on_timeout = False
'''


def names(requested: list[str]) -> list[str]:
    """The notebooks' names (e.g. "03_scheduler"): those requested, or all of them."""
    found = sorted(p.stem for p in SOLUTIONS.glob("*.ipynb"))
    chosen = [n.removesuffix(".ipynb") for n in requested] or found
    unknown = sorted(set(chosen) - set(found))
    if unknown:
        raise SystemExit(f"no such notebook in notebooks/solutions/: {', '.join(unknown)}")
    return chosen


def init(root: Path, notebooks: list[str]) -> Path:
    """Lay out `root` as an nbgrader course: its config, and one assignment per notebook in source/."""
    root = Path(root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    (root / "nbgrader_config.py").write_text(CONFIG.format(root=str(root)))
    for name in notebooks:
        assignment = root / "source" / name
        assignment.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(SOLUTIONS / f"{name}.ipynb", assignment / f"{name}.ipynb")
    return root


def api(root: Path):
    """nbgrader's Python API on the course in `root` (as the `nbgrader` command would run there)."""
    from nbgrader.apps import NbGraderAPI
    from traitlets.config import Config

    config = Config()
    exec(compile((root / "nbgrader_config.py").read_text(), "nbgrader_config.py", "exec"),
         {"get_config": lambda: config})
    config.CourseDirectory.db_url = f"sqlite:///{root / 'gradebook.db'}"
    return NbGraderAPI(config=config)


def generate(root: Path, notebooks: list[str]) -> dict[str, Path]:
    """`nbgrader generate_assignment` for each notebook; returns the released copy of each."""
    grader = api(root)
    released = {}
    for name in notebooks:
        result = grader.generate_assignment(name, force=True, create=True)
        if not result["success"]:
            raise RuntimeError(f"nbgrader generate_assignment {name} failed:\n{result['log']}\n{result['error']}")
        released[name] = root / "release" / name / f"{name}.ipynb"
    return released


def write_learners(notebooks: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = init(Path(tmp) / "course", notebooks)
        for name, path in generate(root, notebooks).items():
            shutil.copyfile(path, HERE / f"{name}.ipynb")
            print(f"wrote notebooks/{name}.ipynb (nbgrader generate_assignment of solutions/{name}.ipynb)")


def main(argv: list[str]) -> int:
    if len(argv) >= 1 and argv[0] == "learners":
        write_learners(names(argv[1:]))
        return 0
    if len(argv) == 2 and argv[0] == "init":
        root = init(Path(argv[1]), names([]))
        print(f"an nbgrader course in {root}: cd there, then see notebooks/README.md (Grading with nbgrader)")
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
