"""Faster weights on a CPU: bfloat16 where the CPU multiplies it natively, and weight-only int8.

Not part of the lesson (model.py is written for any dtype); this is the other half of
cpu_kernels.py's speed-up. A decode step at small batch reads every weight once and does little
with it, so its time is the weights' bytes over the memory bandwidth; at large batch the multiply
itself counts. Two ways to pay fewer bytes and cheaper multiplies; which wins depends on the CPU:

  bfloat16   every weight and activation in 2 bytes. Half of float32's bytes, and on CPUs with
             native bf16 instructions (AVX512_BF16, AMX on Intel Xeon since Sapphire Rapids) a
             multiply several times float32's speed. Without them PyTorch converts in software and
             bfloat16 is slower than float32, so "auto" never picks it there.
  int8       weight-only quantization (vLLM's and llama.cpp's sense): each weight row (one output
             channel) stored as int8 with one scale, scale = max |w| / 127, and the activations kept
             in float32 or bfloat16. A quarter of float32's bytes; `_weight_int8pack_mm` (PyTorch's
             CPU kernel for it, also what torchao calls) converts the int8 to the activations'
             dtype as it multiplies. llama.cpp's Q8_0 is the same idea with a scale per 32 weights.

What it costs in accuracy is measured, not assumed: `python -m minicb.bench.precision` prints the
teacher-forced top-1 agreement with float32 on W1's prompts.

`dtype="auto"` (EngineConfig) resolves here: bfloat16 on CUDA; on a CPU, bfloat16 only if the CPU
has native bf16 AND the model's own linears, timed at the decode batches that matter, run faster in
it than in float32 (on the faster kernel for each, cpu_kernels.py). Measured once per machine and
kept beside the kernel choice.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .cpu_kernels import (
    BATCH_SIZES,
    KERNELS,
    machine_key,
    onednn_linear_available,
    read_machine_cache,
    time_linear,
    write_machine_cache,
)

# the activations' dtypes _weight_int8pack_mm takes
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def native_bf16() -> bool:
    """True when the CPU multiplies bfloat16 in hardware (x86: avx512_bf16 or amx_bf16; Arm: bf16),
    from /proc/cpuinfo's flags (Linux; elsewhere False, the safe answer)."""
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return False
    flags = {
        f
        for line in info.splitlines()
        if line.startswith(("flags", "Features"))
        for f in line.split(":", 1)[1].split()
    }
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def int8_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (int8 weight of the same shape, float32 scale per row),
    with weight ~= q * scale[:, None] and |q| <= 127."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    """y = x (q * scale)^T + b with q int8 (out_features, in_features) and one scale per output
    channel, in the activations' dtype; the weight is never expanded in memory."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize_int8(linear.weight)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale.to(linear.weight.dtype))
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:
        """The de-quantized weight (a copy), for inspection."""
        return self.qweight.to(self.scale.dtype) * self.scale[:, None]

    def forward(self, x):
        if int8_available() and x.dtype in KERNEL_DTYPES:
            y = torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scale)
        else:  # the same product, the weight de-quantized on the fly (float64: exact tests)
            y = F.linear(x, self.qweight.to(x.dtype)) * self.scale
        return y if self.bias is None else y + self.bias

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights"


def quantize_linears(model: nn.Module) -> nn.Module:
    """Every nn.Linear becomes an Int8Linear, in place. A tied LM head gets an int8 copy of the
    embedding table (the embedding itself stays as it was: a lookup reads one row per token, while
    the LM head reads the whole table at every step, a fifth of SmolLM2-135M's bytes)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, Int8Linear(child))
    return model


# ------------------------------------------------------------------------- dtype="auto" on a CPU
def linear_counts(hf_config) -> dict[tuple[int, int], int]:
    """(in_features, out_features) -> how many linears of that shape one forward pass runs, read
    from the model built on the meta device (no memory, no weights)."""
    from .model import CausalLM

    with torch.device("meta"):
        model = CausalLM(hf_config)
    shapes = [(m.in_features, m.out_features) for m in model.modules() if type(m) is nn.Linear]
    return {shape: shapes.count(shape) for shape in sorted(set(shapes))}


def time_dtype(counts: dict[tuple[int, int], int], dtype: torch.dtype) -> float:
    """Seconds of one pass through these linears at each of BATCH_SIZES, summed, each shape on the
    faster kernel in this dtype."""
    kernels = KERNELS if onednn_linear_available() else ("matmul",)
    total = 0.0
    for (i, o), n in counts.items():
        total += n * min(time_linear(i, o, k, BATCH_SIZES, dtype) for k in kernels)
    return total


def choose_cpu_dtype(hf_config, cache_file=None) -> tuple[str, dict]:
    """ "float32" or "bfloat16" for this model on this CPU, and the seconds it was chosen on
    ({} when bfloat16 was not a candidate). Cached in `cache_file` per machine and model shape."""
    if not native_bf16():
        return "float32", {}
    counts = linear_counts(hf_config)
    key = "dtype " + ",".join(f"{i}x{o}*{n}" for (i, o), n in sorted(counts.items()))
    cache = read_machine_cache(cache_file)
    known = cache.get(machine_key(), {})
    if key not in known:
        known[key] = {d: time_dtype(counts, getattr(torch, d)) for d in ("float32", "bfloat16")}
        print(
            "minicb: dtype='auto' timed the model's linears in float32 and bfloat16: "
            + ", ".join(f"{d} {1000 * s:.1f} ms" for d, s in known[key].items()),
            flush=True,
        )
        write_machine_cache(cache_file, cache | {machine_key(): known})
    seconds = known[key]
    return min(seconds, key=seconds.get), seconds


def resolve_dtype(dtype: str, device: str, hf_config, cache_file=None) -> str:
    """EngineConfig.dtype with "auto" replaced: bfloat16 on CUDA, choose_cpu_dtype on a CPU."""
    if dtype != "auto":
        return dtype
    if torch.device(device).type == "cuda":
        return "bfloat16"
    return choose_cpu_dtype(hf_config, cache_file)[0]
