"""What an fp8 KV cache costs in accuracy, measured against the full-precision cache on the same
model.

`python -m minicb.bench.kv_fp8` runs the embedded SmolLM2-135M-Instruct (float32) on the first W1
prompts three times: cache in float32 (the reference), fp8 with vLLM's default scale 1.0, and fp8
with scales calculated from the first forward pass (`calculate_kv_scales`). Three measures, each of
the fp8 runs against the reference:

  attention error  relative error ||o_fp8 - o|| / ||o|| of every layer's attention output when both
                   engines are fed the same tokens; layer 0 sees identical inputs, so its error is
                   the rounding of K and V alone, later layers add what earlier layers passed on
  top-1 agreement  teacher forcing: the reference's greedy continuation is fed as a prompt to both
                   engines (prompt_logprobs), and at each output position the two most likely next
                   tokens are compared. Every position sees the same context, so errors do not
                   compound
  first divergence free running: the first position where the greedy outputs differ. After it the
                   two continuations condition on different text, so they almost never meet again

Notebook 14 draws and explains these numbers (minicb/viz/kv_fp8.py draws the figure).
"""

import argparse
from dataclasses import dataclass, field

import torch

from ..engine.llm import LLM
from ..model_executor.loader import LoadedModel, load_model
from ..sampling_params import SamplingParams
from .machine import cpu_model
from .w1 import w1_workload

VARIANTS = {  # name -> the EngineConfig fields of its cache
    "float32 (reference)": dict(kv_cache_dtype="auto"),
    "fp8, scale 1.0": dict(kv_cache_dtype="fp8"),
    "fp8, calculated scales": dict(kv_cache_dtype="fp8", calculate_kv_scales=True),
}


@dataclass
class VariantResult:
    name: str
    outputs: list[list[int]]  # free-running greedy tokens per prompt
    top1: list[list[int]]  # teacher-forced most likely token at each output position, per prompt
    # per layer (tokens, hidden)
    attn_out: list[torch.Tensor] = field(repr=False, default_factory=list)
    k_scales: list[float] = field(default_factory=list)  # per layer (fp8 only)
    v_scales: list[float] = field(default_factory=list)


@dataclass
class Fp8Report:
    prompts: list[list[int]]
    results: dict[str, VariantResult]

    @property
    def reference(self) -> VariantResult:
        return self.results["float32 (reference)"]

    def attention_errors(self, name: str) -> list[float]:
        """Per layer: ||o_fp8 - o_ref|| / ||o_ref|| over every token of the teacher-forced runs."""
        return [
            ((a - b).norm() / b.norm()).item()
            for a, b in zip(self.results[name].attn_out, self.reference.attn_out)
        ]

    def top1_agreement(self, name: str) -> float:
        """Fraction of output positions where both caches make the same token the most likely."""
        pairs = [
            (a, b)
            for got, ref in zip(self.results[name].top1, self.reference.top1)
            for a, b in zip(got, ref)
        ]
        return sum(a == b for a, b in pairs) / len(pairs)

    def first_divergence(self, name: str) -> list[int | None]:
        """Per prompt: the index of the first output token that differs from the reference (None:
        none)."""
        return [
            first_difference(got, ref)
            for got, ref in zip(self.results[name].outputs, self.reference.outputs)
        ]

    def table(self) -> str:
        lines = [
            f"{'KV cache':<24} {'attn err L0':>11} {'mean':>7} {'max':>7} {'top-1':>7}  "
            "first divergence"
        ]
        for name in self.results:
            errs = self.attention_errors(name)
            div = self.first_divergence(name)
            shown = ", ".join("-" if d is None else str(d) for d in div)
            lines.append(
                f"{name:<24} {errs[0]:>11.2e} {sum(errs) / len(errs):>7.2e} {max(errs):>7.2e} "
                f"{self.top1_agreement(name):>6.1%}  [{shown}]"
            )
        return "\n".join(lines)


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def run_variant(
    loaded: LoadedModel,
    name: str,
    prompts: list[list[int]],
    max_tokens: int,
    teacher: list[list[int]] | None,
    **cache,
) -> VariantResult:
    """Free-running greedy outputs first (the calculated scales come from this first forward), then
    the teacher-forced pass over `teacher` (prompt + reference continuation; None: this run's
    own). `cache`: EngineConfig fields (float32 unless they set dtype)."""
    llm = LLM.from_loaded(loaded, **({"dtype": "float32"} | cache))
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    teacher = teacher or [p + o for p, o in zip(prompts, outputs)]

    # per layer: every step's attention output
    captured = [[] for _ in llm.engine.runner.model.layers]
    hooks = [
        layer.self_attn.register_forward_hook(
            lambda mod, args, out, i=i: captured[i].append(out.clone())
        )
        for i, layer in enumerate(llm.engine.runner.model.layers)
    ]
    try:
        scored = llm.generate(
            teacher,
            SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1),
            use_tqdm=False,
        )
    finally:
        for h in hooks:
            h.remove()
    top1 = []
    for out, prompt in zip(scored, prompts):
        # entry j: the distribution of token j given tokens < j
        entries = out.prompt_logprobs[len(prompt) :]
        top1.append([next(t for t, lp in e.items() if lp.rank == 1) for e in entries])
    quant = llm.engine.kv_cache.quant
    return VariantResult(
        name,
        outputs,
        top1,
        [torch.cat(c) for c in captured],
        [q.k_scale.item() for q in quant if q is not None],
        [q.v_scale.item() for q in quant if q is not None],
    )


def measure(
    loaded: LoadedModel | None = None, num_prompts: int = 8, max_tokens: int = 48
) -> Fp8Report:
    """The three caches on the first `num_prompts` W1 prompts, `max_tokens` greedy tokens each."""
    loaded = loaded or load_model(None, torch.float32)
    prompts = w1_workload(loaded.tokenizer, num_prompts)[0]
    results, teacher = {}, None
    for (
        name,
        cache,
    ) in VARIANTS.items():  # the reference first: its continuation is everyone's teacher
        results[name] = run_variant(loaded, name, prompts, max_tokens, teacher, **cache)
        teacher = teacher or [p + o for p, o in zip(prompts, results[name].outputs)]
    return Fp8Report(prompts, results)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    report = measure(num_prompts=args.prompts, max_tokens=args.max_tokens)
    print(
        f"SmolLM2-135M-Instruct, float32, first {args.prompts} W1 prompts x {args.max_tokens} "
        f"greedy tokens, {cpu_model()}\n"
    )
    print(report.table())


if __name__ == "__main__":
    main()
