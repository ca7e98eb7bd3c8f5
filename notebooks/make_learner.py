"""Write learner notebooks from their worked solutions: `python notebooks/make_learner.py [NAME
...]`.

The worked solutions in `notebooks/solutions/` are the one source of each notebook. A learner's
copy is the same notebook with each exercise cell replaced by its starter: a solution cell whose
metadata holds `{"minicb": {"starter": "..."}}` becomes a code cell with that source. The note
that opens a solution ("> **Worked solutions.** ...") is dropped. Outputs are stripped in both.
Edit the solution, run this script, commit both; `tests/test_notebooks.py` fails when a learner
notebook differs from what this script writes.
"""

import copy
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOLUTIONS = HERE / "solutions"
SOLUTION_NOTE = "> **Worked solutions.**"


def _lines(text: str) -> list[str]:
    """Notebook JSON keeps a cell's source as a list of lines, each with its newline."""
    return text.splitlines(keepends=True)


def _strip(cell: dict) -> dict:
    if cell["cell_type"] == "code":
        cell["outputs"], cell["execution_count"] = [], None
    return cell


def learner_version(solution: dict) -> dict:
    """The learner's notebook (a JSON dict) for one worked-solution notebook."""
    nb = copy.deepcopy(solution)
    cells = []
    for cell in nb["cells"]:
        meta = cell.get("metadata", {})
        starter = meta.get("minicb", {}).get("starter")
        if starter is not None:
            cell["source"] = _lines(starter)
            meta.pop("minicb")
        cells.append(_strip(cell))
    first = "".join(cells[0]["source"])
    if SOLUTION_NOTE in first:
        first = first[: first.index(SOLUTION_NOTE)].rstrip("\n")
        cells[0]["source"] = _lines(first)
    nb["cells"] = cells
    return nb


def dump(nb: dict) -> str:
    """The notebook as Jupyter writes it (one-space indent, a final newline)."""
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def main(names: list[str]) -> int:
    """Rewrite the named notebooks (e.g. `03_scheduler`), or all of them when none is named."""
    paths = [SOLUTIONS / f"{n.removesuffix('.ipynb')}.ipynb" for n in names] or sorted(SOLUTIONS.glob("*.ipynb"))
    for path in paths:
        solution = json.loads(path.read_text())
        for cell in solution["cells"]:
            _strip(cell)
        path.write_text(dump(solution))
        (HERE / path.name).write_text(dump(learner_version(solution)))
        print(f"wrote {path.name} (learner) from solutions/{path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
