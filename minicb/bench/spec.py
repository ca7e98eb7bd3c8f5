"""Speculative decoding side by side: the same requests with and without prompt-lookup drafts.

Workload C1, copy-heavy chat on the CPU (what prompt lookup is for):
  - the embedded SmolLM2-135M-Instruct, float32, CPU, greedy, EOS respected, max_tokens 256;
  - 16 requests: each of the 8 passages of COPY_PASSAGES (stories, a recipe, a notice, code) under
    two of the tasks of COPY_TASKS (repeat it, fix its spelling, number its sentences, quote it and
    comment): request i is task (i % 4) on passage (i // 2), as one user message in the chat
    template;
  - greedy decoding with speculation gives exactly the tokens without it, so both runs produce the
    same outputs (checked), and the difference is only steps and time.
C1 is served at 1, 4 and 16 slots (`max_num_seqs`): one request at a time is the latency-bound
regime, 16 at once the batch that a copy-heavy burst makes. W1 (bench/__init__.py) runs the same way
with and without drafts, at the default 64 slots: chat answers that seldom copy their prompt.

Each system runs `repeats` times, alternating (off, on, off, on, ...), on a fresh engine; the table
shows the faster run of each (the other is printed too). Decode steps are the steps with at least
one decode row; their ratio is what speculation saves in sequential weight reads.
"""

import os
import time

from ..engine.llm import chat_token_ids
from ..sampling_params import SamplingParams
from .machine import cpu_model

COPY_PASSAGES = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He wound the "
    "clockwork, trimmed the wick and wiped the salt from the great lens. Ships passing the "
    "headland never saw him, only the beam that swept the water twice a minute. In the morning he "
    "wrote the weather in a book that nobody read.",
    "Bread rises because yeast eats sugar and breathes out carbon dioxide. The gas is caught in a "
    "net of gluten, which stretches as the dough is kneaded and rested. Baking sets the net, and "
    "the bubbles become the holes of the crumb. Salt slows the yeast down, which is why it is "
    "added with care.",
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
    "    return total / len(values)\n\n\n"
    "def variance(values):\n    m = mean(values)\n"
    "    return sum((v - m) ** 2 for v in values) / len(values)\n",
    "Our meeting on Tuesday will start at ten in the small room on the second floor. Please bring "
    "the draft budget, the list of suppliers and your notes from the site visit. Lunch will be "
    "served at noon, and we should finish by three. If you cannot come, send your notes to Maria "
    "before Monday evening.",
    "The old train left the valley at six and climbed through pine woods to the pass. Passengers "
    "leaned out of the windows to watch the river shrink below them. At the top the driver stopped "
    "for water, and the children ran to the edge of the platform to throw snowballs at the engine.",
    "To make a simple tomato soup, soften an onion in olive oil, add two cloves of garlic and a "
    "tin of tomatoes, and pour in half a litre of stock. Let it simmer for twenty minutes, blend "
    "it until smooth, and season it with salt, pepper and a little sugar. Serve it hot with bread.",
    "class Counter:\n    def __init__(self):\n        self.counts = {}\n\n"
    "    def add(self, word):\n        self.counts[word] = self.counts.get(word, 0) + 1\n\n"
    "    def most_common(self):\n        return max(self.counts, key=self.counts.get)\n",
    "The museum opens at nine on weekdays and at ten on Sundays. Tickets cost twelve euros for "
    "adults and six for students, and children under ten enter for free. Large bags must be left "
    "in the cloakroom. Photographs are allowed, but please do not use a flash near the paintings.",
]
COPY_TASKS = [
    "Repeat the following text exactly, word for word:\n\n{p}",
    "Copy this text and fix any spelling mistakes:\n\n{p}",
    "Rewrite the following, keeping every sentence, but number the sentences:\n\n{p}",
    "Quote the text below in full, then say in one sentence what it is about:\n\n{p}",
]
# the k = 4, n-gram 3
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


def copy_workload(tokenizer, num_requests: int = 16) -> tuple[list[list[int]], list[int]]:
    """C1's prompts (chat-templated token ids) and max_tokens."""
    messages = [
        COPY_TASKS[i % len(COPY_TASKS)].format(p=COPY_PASSAGES[(i // 2) % len(COPY_PASSAGES)])
        for i in range(num_requests)
    ]
    return [chat_token_ids(tokenizer, [{"role": "user", "content": m}]) for m in messages], [
        256
    ] * num_requests


def run_once(
    loaded,
    prompts,
    max_tokens,
    ignore_eos: bool,
    speculative_config=None,
    max_num_seqs=None,
    dtype: str = "float32",
) -> dict:
    """One run on a fresh engine: wall time, tokens, steps, decode steps, the outputs and the
    drafts' counters."""
    from ..engine.llm import LLM

    llm = LLM.from_loaded(
        loaded, speculative_config=speculative_config, max_num_seqs=max_num_seqs, dtype=dtype
    )
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=ignore_eos) for n in max_tokens
    ]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    trace, stats = llm.engine.trace, llm.engine.runner.spec_stats
    tokens = [o.outputs[0].token_ids for o in outs]
    return dict(
        speculation=speculative_config is not None,
        wall_s=wall,
        output_tokens=sum(map(len, tokens)),
        throughput=sum(map(len, tokens)) / wall,
        steps=len(trace),
        decode_steps=sum(1 for s in trace if s.num_decode_rows),
        tokens=tokens,
        dtype=llm.engine.config.dtype,  # what "auto" resolved to
        drafts=stats.num_draft_tokens,
        accepted=stats.num_accepted_tokens,
        acceptance_rate=stats.acceptance_rate,
        mean_acceptance_length=stats.mean_acceptance_length,
    )


def compare(
    loaded,
    prompts,
    max_tokens,
    ignore_eos: bool,
    repeats: int = 2,
    cooldown_s: float = 5.0,
    speculative_config=SPEC,
    max_num_seqs=None,
    dtype: str = "float32",
) -> dict:
    """Runs off and on, alternating, `repeats` times each; the faster run of each, and their
    ratios."""
    runs = {False: [], True: []}
    for i in range(repeats):
        for spec in (False, True):
            if i or spec:
                time.sleep(cooldown_s)
            runs[spec].append(
                run_once(
                    loaded,
                    prompts,
                    max_tokens,
                    ignore_eos,
                    speculative_config if spec else None,
                    max_num_seqs,
                    dtype,
                )
            )
    off, on = (min(runs[s], key=lambda r: r["wall_s"]) for s in (False, True))
    same = sum(a == b for a, b in zip(on["tokens"], off["tokens"])) / len(off["tokens"])
    if same < 1 and on["dtype"] == "float32":
        raise AssertionError(
            "greedy outputs differ with speculation: it must change nothing but the steps"
        )  # (in bfloat16 a verifying row's shapes round differently: a near tie may flip)
    for r in off, on:
        r["all_walls"] = [x["wall_s"] for x in runs[r["speculation"]]]
        r.pop("tokens")
    return dict(
        off=off,
        on=on,
        same_outputs=same,
        step_ratio=off["decode_steps"] / on["decode_steps"],
        speedup=on["throughput"] / off["throughput"],
    )


C1_SLOTS = (1, 4, 16)


def run_spec_bench(
    workloads=("c1", "w1"),
    repeats: int = 2,
    cooldown_s: float = 5.0,
    c1_slots=C1_SLOTS,
    dtype: str = "float32",
) -> dict:
    """C1 (at each of `c1_slots`) and W1, each without and with prompt-lookup speculation (k = 4,
    n-gram 3), in this process, in `dtype` ("auto": bfloat16 where the CPU multiplies it natively
    and it is faster, cpu_precision.py)."""
    import torch

    from ..model_executor.loader import load_model
    from .w1 import w1_workload

    torch.set_num_threads(os.cpu_count())
    loaded = load_model(None)
    report = dict(
        machine=f"{os.cpu_count()} cores of {cpu_model()}, torch {torch.__version__}",
        speculative_config=SPEC,
        results={},
    )
    for name in workloads:
        prompts, max_tokens = (copy_workload if name == "c1" else w1_workload)(loaded.tokenizer)
        for slots in c1_slots if name == "c1" else (None,):
            res = compare(
                loaded,
                prompts,
                max_tokens,
                ignore_eos=name == "w1",
                repeats=repeats,
                cooldown_s=cooldown_s,
                max_num_seqs=slots,
                dtype=dtype,
            )
            report["dtype"] = res["on"]["dtype"]
            report["results"][f"{name}@{slots or 64}"] = res | dict(
                num_requests=len(prompts), slots=slots or 64
            )
    return report


def print_spec(report: dict, print_fn=print) -> None:
    dtype = report.get("dtype", "float32")
    print_fn(
        f"\nSpeculative decoding, {report['speculative_config']}, on {report['machine']}, {dtype}"
    )
    print_fn(
        f"{'work@slots':10} {'drafts':7} {'tok/s':>7} {'wall s':>7} {'runs (s)':>14} {'steps':>6} "
        f"{'decode':>7} {'accepted':>9} {'tokens/verify':>13}"
    )
    for name, res in report["results"].items():
        for key in ("off", "on"):
            r = res[key]
            runs = " ".join(f"{w:.1f}" for w in r["all_walls"])
            extra = (
                f"{r['acceptance_rate']:>9.0%} {r['mean_acceptance_length']:>13.2f}"
                if key == "on"
                else ""
            )
            print_fn(
                f"{name:10} {key:7} {r['throughput']:>7.1f} {r['wall_s']:>7.2f} {runs:>14} "
                f"{r['steps']:>6} {r['decode_steps']:>7} {extra}"
            )
        print_fn(
            f"{name:10} {res['step_ratio']:.2f}x fewer decode steps, {res['speedup']:.2f}x the "
            f"throughput ({res['on']['output_tokens']} output tokens of {res['num_requests']} "
            f"requests; {res.get('same_outputs', 1):.0%} of them the same with and without)"
        )
