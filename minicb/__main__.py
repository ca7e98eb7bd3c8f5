"""Command line: python -m minicb demo | generate | bench | serve | figures (each with --help)."""

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a five-year-old.",
    "Give me three tips for baking bread.",
    "What is 12 times 12?",
    "Name three planets of the solar system.",
    "Tell me a short story about a cat who learns to fly.",
    "How do trains stay on their tracks?",
    "Why is the sky blue?",
    "List four colours of the rainbow.",
    "Describe the game of chess in two sentences.",
    "What is a good name for a pet goldfish?",
]


def cmd_demo(args):
    from minicb import LLM, SamplingParams
    from minicb.engine.llm import chat_token_ids
    from minicb.model_executor.loader import load_model
    from minicb.viz import slot_occupancy

    print(
        "Loading the embedded SmolLM2-135M-Instruct (the first run converts the GGUF file, "
        "~20 s)..."
    )
    t0 = time.perf_counter()
    loaded = load_model(args.model)
    print(f"loaded {loaded} in {time.perf_counter() - t0:.1f} s")
    # Different answer lengths are what continuous batching is about: cap each one differently.
    max_tokens = (24, 64, 96, 80, 16, 32, 128, 72, 64, 40, 56, 24)
    params = [SamplingParams(max_tokens=m, temperature=0.0) for m in max_tokens]
    results = {}
    for mode in ("continuous", "static"):
        llm = LLM.from_loaded(loaded, batching=mode, max_num_seqs=args.max_num_seqs)
        prompts = [
            chat_token_ids(llm.get_tokenizer(), [{"role": "user", "content": p}])
            for p in DEMO_PROMPTS
        ]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        results[mode] = (outs, time.perf_counter() - t0, llm.engine.trace)
        if mode == "continuous":
            print(f"KV cache: {llm.engine.kv_cache}")
            for q, o in zip(DEMO_PROMPTS, outs):
                s = o.outputs[0]
                print(
                    f"\n\033[1m> {q}\033[0m\n{s.text.strip()}  [{len(s.token_ids)} tokens, "
                    f"{s.finish_reason}]"
                )
        del llm
    print(
        f"\nStatic vs continuous batching: same 12 prompts, same model, {args.max_num_seqs} slots"
    )
    print(f"{'mode':<12}{'steps':>7}{'time (s)':>10}{'tokens/s':>10}{'slot use':>10}")
    for mode, (outs, dt, trace) in results.items():
        ntok = sum(len(o.outputs[0].token_ids) for o in outs)
        print(
            f"{mode:<12}{len(trace):>7}{dt:>10.2f}{ntok / dt:>10.1f}"
            f"{trace.slot_utilization():>10.0%}"
        )
    same = all(
        a.outputs[0].token_ids == b.outputs[0].token_ids
        for a, b in zip(results["continuous"][0], results["static"][0])
    )
    print(f"identical outputs in both modes: {same}")
    out_dir = Path(args.figures_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for mode, (_, _, trace) in results.items():
        path = out_dir / f"demo_slots_{mode}.png"
        slot_occupancy(trace, title=f"demo, {mode} batching: slot occupancy").savefig(path, dpi=110)
        print(f"wrote {path}")


def cmd_generate(args):
    from minicb import LLM, SamplingParams
    from minicb.engine.detokenizer import text_delta
    from minicb.engine.llm import chat_token_ids

    # Validate before the model loads, so a bad value fails in a second, not after the load.
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    llm = LLM(args.model, speculative_config=args.speculative_config)
    prompts = [
        p if args.raw else chat_token_ids(llm.get_tokenizer(), [{"role": "user", "content": p}])
        for p in args.prompts
    ]
    if len(prompts) == 1:  # stream one answer to the terminal as it is generated
        shown = ""
        for out in llm.stream(prompts, params):
            # Print the growth of the decoded text, not token by token: a character may span tokens.
            delta = text_delta(shown, out.outputs[0].text, out.finished)
            sys.stdout.write(delta)
            sys.stdout.flush()
            shown += delta
        print()
        return
    for q, out in zip(args.prompts, llm.generate(prompts, params)):
        print(f"> {q}\n{out.outputs[0].text.strip()}\n")


def cmd_model_dir(args):
    # moves with $MINICB_CACHE / $XDG_CACHE_HOME
    from minicb.model_executor.loader import embedded_model_dir

    print(embedded_model_dir())


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m minicb", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "demo", help="answer a dozen chat prompts with the embedded model, static vs continuous"
    )
    p.add_argument(
        "--model",
        default=None,
        help="model dir or hub id (default: embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--max-num-seqs", type=int, default=8, help="slots (default 8: a few of 12 prompts wait)"
    )
    p.add_argument("--figures-dir", default="figures")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("generate", help="answer prompts from the shell (one prompt streams)")
    p.add_argument("prompts", nargs="+")
    p.add_argument("--model", default=None)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--raw", action="store_true", help="do not wrap prompts in the chat template")
    p.add_argument(
        "--speculative-config",
        type=json.loads,
        default=None,
        metavar="JSON",
        help='e.g. \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}\'',
    )
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "model-dir",
        help="print the embedded model's directory (config, tokenizer, weights), "
        "for tools that want a local tokenizer or model (lm-eval, guidellm)",
    )
    p.set_defaults(func=cmd_model_dir)

    # These three own their options: each module has add_arguments(parser) and main(args). Only the
    # chosen command's module is imported, so `generate` never loads the server or matplotlib.
    chosen = next(
        (a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")), None
    )
    for name, module_name, help_text in (
        (
            "bench",
            "minicb.bench.cli",
            "benchmark workloads w1 (CPU), w2 (GPU), w3 (scheduler overhead)",
        ),
        ("serve", "minicb.serve.cli", "OpenAI-compatible HTTP server with streaming"),
        ("figures", "minicb.viz.figures", "regenerate every figure in figures/"),
    ):
        p = sub.add_parser(name, help=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            p.description = module.__doc__
            module.add_arguments(p)
            p.set_defaults(func=module.main)

    args = parser.parse_args(argv)
    try:
        args.func(args)
    except ValueError as e:  # bad input: say what is wrong, no traceback
        parser.exit(2, f"error: {e}\n")


if __name__ == "__main__":
    main()
