"""`python -m minicb bench --workload w1|w2|w3|spec|loop|precision|all`: run the workloads defined
in minicb/bench/__init__.py."""

import json

from .w3 import W3_SIZES, w3_table


def add_arguments(parser) -> None:
    """Options of `python -m minicb bench`."""
    parser.add_argument(
        "--workload",
        choices=["w1", "w2", "w3", "spec", "loop", "precision", "all"],
        default="w3",
        help="w1: CPU chat side by side; w2: GPU offline (needs CUDA); w3: scheduler overhead; "
        "spec: speculative decoding on and off, on C1 (copy-heavy) and W1; loop: the engine "
        "loop, sync against async scheduling, on W1 and W3's shape; precision: float32, "
        "bfloat16 and int8 weights on this CPU, speed and accuracy",
    )
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=list(W3_SIZES),
        help="W3: numbers of running requests (default: 64 128 256 512)",
    )
    parser.add_argument("--steps", type=int, default=200, help="W3: timed steps per size")
    parser.add_argument(
        "--competitors",
        nargs="+",
        default=None,
        help=(
            "W1: a subset of hf_static hf_continuous minicb_static minicb_continuous_16 "
            "minicb_continuous (the default: all five), and of the opt-in minicb_auto (dtype "
            "'auto'), minicb_int8 (int8 weights) and llamacpp (llama.cpp's llama-server at the "
            "best setting of a sweep; needs one, see minicb/bench/llamacpp.py)"
        ),
    )
    parser.add_argument(
        "--cooldown",
        type=float,
        default=20.0,
        help="W1: idle seconds before each competitor after the first, so that none runs on a "
        "machine still slowed by the previous one (default 20)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="W2: model dir or hub id (default Qwen3-0.6B from the HF cache)",
    )
    parser.add_argument(
        "--figures-dir", default="figures", help="W1: where the comparison figure goes"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="spec, loop: runs of each system, alternating (default 2)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "auto"],
        help="spec: the engine's dtype (default float32; 'auto' as in EngineConfig)",
    )
    parser.add_argument(
        "--spec-workloads",
        nargs="+",
        default=["c1", "w1"],
        choices=["c1", "w1"],
        help="spec: which workloads (default both)",
    )
    parser.add_argument(
        "--c1-slots",
        type=int,
        nargs="+",
        default=[1, 4, 16],
        help="spec: C1's numbers of slots (default 1 4 16)",
    )
    parser.add_argument("--json", default=None, help="write the results to this JSON file")


def _w2(args) -> dict:
    import torch

    if not torch.cuda.is_available():
        print(
            "W2 skipped: it needs a CUDA GPU and torch.cuda.is_available() is False on this machine"
        )
        return {"skipped": "no CUDA GPU"}
    from .w2 import run_w2

    rows = [run_w2(args.model, use_cuda_graph=graphs) for graphs in (False, True)]
    for r in rows:
        print(r)
    print(
        "CUDA graphs speed-up on W2: "
        f"{rows[1]['output_tokens_per_s'] / rows[0]['output_tokens_per_s']:.2f}x"
    )
    return {"w2": rows}


def _w1(args) -> dict:
    from pathlib import Path

    from .w1 import COMPETITORS, run_w1
    from .w1_report import print_w1, w1_figure

    report = run_w1(competitors=args.competitors or COMPETITORS, cooldown_s=args.cooldown)
    for r in report["results"]:
        r.pop("trace", None)
    print_w1(report)
    Path(args.figures_dir).mkdir(parents=True, exist_ok=True)
    # the standard five keep their figure; a run against llama.cpp gets its own
    name = "bench_w1_llamacpp.png" if "llamacpp" in (args.competitors or ()) else "bench_w1.png"
    path = Path(args.figures_dir) / name
    w1_figure(report).savefig(path, dpi=110, bbox_inches="tight")
    print(f"wrote {path}")
    return {"w1": report}


def main(args) -> None:
    """Entry point of `python -m minicb bench`."""
    results = {}
    if args.workload in ("w3", "all"):
        results["w3"] = w3_table(sizes=args.sizes, steps=args.steps)
    if args.workload in ("w2", "all"):
        results |= _w2(args)
    if args.workload in ("w1", "all"):
        results |= _w1(args)
    if args.workload in ("spec", "all"):
        from .spec import print_spec, run_spec_bench

        results["spec"] = run_spec_bench(
            workloads=args.spec_workloads,
            repeats=args.repeats,
            c1_slots=args.c1_slots,
            dtype=args.dtype,
        )
        print_spec(results["spec"])
    if args.workload in ("loop", "all"):
        from .loop import print_loop, run_loop_bench

        results["loop"] = run_loop_bench(repeats=args.repeats)
        print_loop(results["loop"])
    if args.workload == "precision":
        from .precision import main as precision_main

        precision_main([])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
