"""Faster weights on a CPU, priced: what bfloat16 and int8 weights cost in accuracy against float32,
and the floors of W1 for the precision that ran.

    python -m minicb.bench.precision      # every precision this CPU offers: speed and accuracy

Accuracy is measured as notebook 14 measures the fp8 KV cache (kv_fp8.py): on the first W1 prompts,
the float32 engine's greedy continuation is fed to both engines as a prompt and, at every output
position, their most likely next tokens are compared (teacher-forced top-1 agreement: every position
sees the same context, so errors do not compound); and free running, the first position where the
greedy outputs part (after it the texts differ, so the runs almost never meet again).
"""

import argparse

import torch

from .floor import kernel_floor, time_linear_passes, workload_floor, workload_passes
from .kv_fp8 import first_difference, run_variant

# name -> EngineConfig fields; "auto" resolves to one of the first two (cpu_precision.py)
PRECISIONS = {
    "float32": dict(dtype="float32"),
    "bfloat16": dict(dtype="bfloat16"),
    "int8 weights, float32 activations": dict(dtype="float32", quantization="int8"),
    "int8 weights, bfloat16 activations": dict(dtype="bfloat16", quantization="int8"),
}
ACCURACY_PROMPTS, ACCURACY_TOKENS = 8, 48  # notebook 14's: the first 8 W1 prompts, 48 tokens each


def precision_name(dtype: str, quantization: str | None = None) -> str:
    if quantization == "int8":
        return f"int8 weights, {dtype} activations"
    return dtype


def bytes_per_weight(dtype: str, quantization: str | None = None) -> float:
    """Bytes a forward pass reads per weight: int8 reads one (its scales are one per row)."""
    return 1 if quantization == "int8" else torch.empty(0, dtype=getattr(torch, dtype)).itemsize


def accuracy(loaded, names, num_prompts=ACCURACY_PROMPTS, max_tokens=ACCURACY_TOKENS) -> dict:
    """name -> {"top1": teacher-forced agreement with float32, "first_divergence": per prompt}, for
    each precision name in `names` (PRECISIONS' keys) other than float32."""
    from .w1 import w1_workload

    prompts = w1_workload(loaded.tokenizer, num_prompts)[0]
    ref = run_variant(loaded, "float32", prompts, max_tokens, None, **PRECISIONS["float32"])
    teacher = [p + o for p, o in zip(prompts, ref.outputs)]
    out = {}
    for name in names:
        if name == "float32":
            continue
        got = run_variant(loaded, name, prompts, max_tokens, teacher, **PRECISIONS[name])
        pairs = [(a, b) for g, r in zip(got.top1, ref.top1) for a, b in zip(g, r)]
        out[name] = dict(
            top1=sum(a == b for a, b in pairs) / len(pairs),
            positions=len(pairs),
            first_divergence=[first_difference(g, r) for g, r in zip(got.outputs, ref.outputs)],
        )
    return out


def linears_as_minicb_runs_them(loaded, mode="auto", dtype="float32", quantization=None):
    """The model on the CPU in `dtype` with each linear as the engine runs it: int8 if quantized,
    else on the kernel chosen for it for this `prepack_cpu_weights` mode (cpu_kernels.py)."""
    from ..model_executor.cpu_kernels import PACKED_DTYPES, kernel_cache_file, prepare_cpu_linears
    from ..model_executor.cpu_precision import quantize_linears
    from ..model_executor.model import CausalLM

    torch_dtype = getattr(torch, dtype)
    model = CausalLM.from_hf(loaded.hf_config, loaded.state_dict, torch_dtype, "cpu")
    if quantization == "int8":
        model = quantize_linears(model)
    if mode and torch_dtype in PACKED_DTYPES:
        model = prepare_cpu_linears(model, mode, kernel_cache_file())[0]
    return model


def precision_floor(loaded, prompt_lens, outs, precision, peak_flops, bandwidth, mode) -> dict:
    """The machine's floor and the kernels' floor (floor.py) of W1 for one precision: its bytes per
    weight, its GEMM peak, its linears as the engine runs them."""
    dtype, quantization = precision
    floor = workload_floor(
        loaded, prompt_lens, outs, peak_flops, bandwidth, bytes_per_weight(dtype, quantization)
    )
    linears = linears_as_minicb_runs_them(loaded, mode, dtype, quantization)
    floor["kernels"] = kernel_floor(
        workload_passes(prompt_lens, outs), time_linear_passes(linears), max(outs)
    )
    return floor | {"precision": precision_name(dtype, quantization)}


def available_precisions() -> list[str]:
    """The precisions worth timing here: bfloat16 only on CPUs that multiply it natively, int8
    where PyTorch has its kernel."""
    from ..model_executor.cpu_precision import int8_available, native_bf16

    names = ["float32"] + (["bfloat16"] if native_bf16() else [])
    if int8_available():
        names += [n for n, f in PRECISIONS.items() if "quantization" in f and f["dtype"] in names]
    return names


def decode_times(loaded, names, batches=(1, 16, 64)) -> dict:
    """name -> {batch: ms of one pass through the model's linears as the engine runs them}."""
    out = {}
    for name in names:
        fields = PRECISIONS[name]
        model = linears_as_minicb_runs_them(
            loaded, "auto", fields["dtype"], fields.get("quantization")
        )
        times = time_linear_passes(model, rows=batches)
        out[name] = {b: 1000 * (times["layers"][b] + times["lm_head"][b]) for b in batches}
    return out


def main(argv=None) -> None:
    from ..model_executor.loader import load_model
    from .machine import cpu_model

    parser = argparse.ArgumentParser(prog="python -m minicb.bench.precision", description=__doc__)
    parser.add_argument("--prompts", type=int, default=ACCURACY_PROMPTS)
    parser.add_argument("--max-tokens", type=int, default=ACCURACY_TOKENS)
    args = parser.parse_args(argv)
    loaded = load_model(None, torch.float32)
    names = available_precisions()
    times, acc = decode_times(loaded, names), accuracy(loaded, names, args.prompts, args.max_tokens)
    print(f"SmolLM2-135M-Instruct on {torch.get_num_threads()} threads of {cpu_model()}")
    print(
        f"{'precision':<36}{'linears ms at batch 1':>22}{'16':>8}{'64':>8}{'top-1':>8}  "
        "first divergence"
    )
    for name in names:
        t, a = times[name], acc.get(name)
        top1 = f"{a['top1']:.1%}" if a else "(ref)"
        div = ", ".join("-" if d is None else str(d) for d in a["first_divergence"]) if a else ""
        print(f"{name:<36}{t[1]:>22.2f}{t[16]:>8.2f}{t[64]:>8.2f}{top1:>8}  {div}")


if __name__ == "__main__":
    main()
