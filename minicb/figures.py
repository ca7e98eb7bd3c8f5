"""Regenerate the figures in figures/ that the README and the notebooks show.

Each entry of FIGURES is a name and a function returning a matplotlib Figure, so any figure
can be rebuilt alone (`python -m minicb figures --only NAME`). Model-free figures come from the
simulator and take a second; the demo's figures come from `python -m minicb demo` and the
benchmark's from `python -m minicb bench --workload w1`.
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # writes files; no screen needed

from .config import EngineConfig  # noqa: E402
from .sim import SimRequest, simulate  # noqa: E402
from .viz import slot_occupancy  # noqa: E402


def worked_example(batching: str):
    """The reading's example: 4 slots, outputs of 4, 4, 10, 10 tokens, two 4-token requests waiting."""
    reqs = [SimRequest(prompt_len=8, output_len=n, request_id=rid)
            for rid, n in zip("ABCDEF", (4, 4, 10, 10, 4, 4))]
    res = simulate(reqs, EngineConfig(max_num_seqs=4, batching=batching))
    return slot_occupancy(res.trace, title=f"{batching} batching: all six done after {res.num_steps} steps")


FIGURES = {
    "worked_example_static": lambda: worked_example("static"),
    "worked_example_continuous": lambda: worked_example("continuous"),
}


def add_arguments(parser):
    parser.add_argument("--out", default="figures", help="directory to write PNG files to")
    parser.add_argument("--only", nargs="*", choices=sorted(FIGURES), help="regenerate only these")


def main(args):
    import matplotlib.pyplot as plt

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.only or FIGURES:
        fig = FIGURES[name]()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        print(f"wrote {path}")
