"""CPU matmul kernels: oneDNN's pre-packed linear, and how fast each kernel runs on this machine.

Not part of the lesson: model.py is written with plain nn.Linear, and everything here is an
optional speed-up for float32 on a CPU, swapped in after the model is built.

Why pre-packing. A plain CPU matmul re-packs its weight into the kernel's blocked layout on every
call; for a decode batch of 1-64 rows that packing costs as much as the multiply itself, and it
streams the weights through memory twice per step. oneDNN (the CPU kernel library inside PyTorch)
can pack a weight once and then run `y = x W^T + b` on the packed copy. PyTorch exposes that through
two private operators, the ones its own compiler (torch.compile's CPU backend) emits:

    torch.ops.mkldnn._reorder_linear_weight(weight, batch_size=None) -> packed weight
    torch.ops.mkldnn._linear_pointwise(input, packed_weight, bias, attr, scalars, algorithm)
        attr="none": no fused activation after the matmul; scalars=[] and algorithm="" are that
        activation's arguments, unused here.

Private operators can change or vanish between PyTorch versions, so every use goes through
`onednn_linear_available()`, and without them the model keeps its nn.Linear (same results: only
the order of the sums differs).

Which kernel is faster depends on the machine. On a 2-core AMD EPYC with AVX-512 the packed GEMM
peaked at 454 GFLOP/s against 199 for torch.matmul; on one with AVX2 only, at 149 against 190, and
there torch.matmul wins some decode shapes at batch 1 while packing still wins others. So the
default ("auto") measures both on the model's own linear shapes at the decode batches that matter,
once per machine, keeps the faster per shape, and caches the choice beside the converted weights.
"""

import json
import os
import time

import torch
import torch.nn.functional as F
from torch import nn


def onednn_linear_available() -> bool:
    """True when this PyTorch has oneDNN and the two private linear operators."""
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    """An nn.Linear whose weight oneDNN packed once, at load time; dense activations in and out."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # (out_features, in_features) in oneDNN's blocked layout, an opaque "mkldnn" tensor
        self.register_buffer(
            "packed_weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        )
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:
        """The weight as a plain (out_features, in_features) tensor, unpacked (a copy) for
        inspection."""
        return self.packed_weight.to_dense()

    def forward(self, x):  # x: (num_tokens, in_features) -> (num_tokens, out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self):
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, packed for oneDNN"
        )


def prepack_for_cpu(model: nn.Module) -> nn.Module:
    """Float32 on a CPU: replace every nn.Linear by a PackedLinear, in place (2-3x faster small
    matmuls).

    A linear whose weight is shared with another module (the LM head of a model with tied
    embeddings) stays as it is: packing it would keep a second copy of the embedding table. Without
    the oneDNN operators, the model is returned unchanged.
    """
    if not onednn_linear_available():
        return model
    shared = {
        id(p)
        for m in model.modules()
        if not isinstance(m, nn.Linear)
        for p in m.parameters(recurse=False)
    }
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and id(child.weight) not in shared:
                setattr(module, name, PackedLinear(child))
    return model


# ---------------------------------------------------------------------- the right kernel per
# machine
BATCH_SIZES = (1, 16, 64)  # decode batches that matter: one stream, a busy server, a full W1 batch
# torch.matmul on the plain weight (F.linear), oneDNN on a packed one
KERNELS = ("matmul", "onednn")
TIME_PER_CASE_S = 0.05  # timing budget of one (shape, batch, kernel): at least 3 runs, best kept


def cpu_name() -> str:
    """The CPU's name and widest vector unit, from /proc/cpuinfo (Linux), for naming the machine."""
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        import platform

        return platform.processor() or "an unknown CPU"
    name = next(
        (
            line.split(":", 1)[1].strip()
            for line in info.splitlines()
            if line.startswith("model name")
        ),
        "a CPU",
    )
    flags = next(
        (line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")),
        [],
    )
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{name} ({vector}{', AMX' if 'amx_tile' in flags else ''})"


def best_time(fn, runs: int, budget_s: float = 0.0, max_runs: int = 1000) -> float:
    """The fastest of at least `runs` timed calls of fn() (after one warm-up), going on while the
    time spent is under `budget_s` (up to max_runs): the best run is the one least disturbed by the
    machine."""
    fn()  # warm up
    best, spent = float("inf"), 0.0
    for run in range(max(runs, 1) if budget_s <= 0 else max_runs):
        t = time.perf_counter()
        fn()
        took = time.perf_counter() - t
        best, spent = min(best, took), spent + took
        if run + 1 >= runs and spent > budget_s:
            break
    return best


def kernel_fn(kernel: str, weight: torch.Tensor):
    """x -> x W^T with `kernel` ("matmul" or "onednn") on this (out_features, in_features)
    weight."""
    if kernel == "matmul":
        return lambda x: F.linear(x, weight)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def time_linear(
    in_features: int, out_features: int, kernel: str, batch_sizes=BATCH_SIZES, dtype=torch.float32
) -> float:
    """Seconds for one product at each batch size, summed: the best of several runs per size."""
    fn = kernel_fn(kernel, torch.randn(out_features, in_features, dtype=dtype))
    total = 0.0
    for b in batch_sizes:
        x = torch.randn(b, in_features, dtype=dtype)
        total += best_time(lambda: fn(x), runs=3, budget_s=TIME_PER_CASE_S)
    return total


def shape_key(in_features: int, out_features: int, dtype=torch.float32) -> str:
    """How a shape is named in the choice and its cache: "576x1536", "576x1536 bfloat16"."""
    name = "" if dtype == torch.float32 else " " + str(dtype).removeprefix("torch.")
    return f"{in_features}x{out_features}{name}"


def model_dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def linear_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """The distinct (in_features, out_features) of the model's linears, LM head included."""
    return sorted(
        {(m.in_features, m.out_features) for m in model.modules() if type(m) is nn.Linear}
    )


def choose_kernels(shapes, timer=time_linear, dtype=torch.float32) -> dict[str, dict]:
    """For each shape "in x out": both kernels' summed times and the faster one (oneDNN only if it
    exists)."""
    kernels = KERNELS if onednn_linear_available() else ("matmul",)
    choice = {}
    for i, o in shapes:
        times = {k: timer(i, o, k, dtype=dtype) for k in kernels}
        choice[shape_key(i, o, dtype)] = {"kernel": min(times, key=times.get), "seconds": times}
    return choice


def machine_key() -> str:
    return f"{cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads"


def read_machine_cache(cache_file) -> dict:
    """The measurements kept in `cache_file` (JSON: machine key -> what was measured there); {} when
    there is none, or it is damaged (then everything is measured again)."""
    if cache_file is None or not os.path.exists(cache_file):
        return {}
    try:
        return json.loads(open(cache_file).read())
    except (OSError, ValueError):
        return {}


def write_machine_cache(cache_file, cache: dict) -> None:
    """Keep `cache` in `cache_file`; a read-only place is left alone (measured again next time)."""
    if cache_file is None:
        return
    try:
        os.makedirs(os.path.dirname(cache_file), exist_ok=True)
        with open(cache_file, "w") as f:
            json.dump(cache, f, indent=1)
    except OSError:
        pass


def cached_choice(model: nn.Module, cache_file=None, timer=time_linear) -> dict[str, dict]:
    """choose_kernels for the model's shapes, measured once per machine and kept in `cache_file`
    (JSON: machine key -> shape -> choice); None: measure without caching."""
    shapes, key, dtype = linear_shapes(model), machine_key(), model_dtype(model)
    cache = read_machine_cache(cache_file)
    known = cache.get(key, {})
    missing = [s for s in shapes if shape_key(*s, dtype) not in known]
    if missing:
        t = time.perf_counter()
        known |= choose_kernels(missing, timer, dtype)
        print(
            f"minicb: timed torch.matmul against oneDNN packed weights on {len(missing)} linear "
            f"shapes ({time.perf_counter() - t:.1f} s, once on this machine: {key})",
            flush=True,
        )
        write_machine_cache(cache_file, cache | {key: known})
    return {shape_key(i, o, dtype): known[shape_key(i, o, dtype)] for i, o in shapes}


def use_kernels(model: nn.Module, choice: dict[str, dict]) -> nn.Module:
    """Pack every linear whose shape chose oneDNN, in place. A tied LM head that chose it gets a
    packed copy of the embedding table (its bytes again: the price of the faster kernel)."""
    dtype = model_dtype(model)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is not nn.Linear:
                continue
            shape = shape_key(child.in_features, child.out_features, dtype)
            if choice.get(shape, {}).get("kernel") == "onednn":
                setattr(module, name, PackedLinear(child))
    return model


def describe(choice: dict[str, dict]) -> str:
    """One line: the kernel each shape runs on and by how much it won."""

    def one(shape, c):
        t = c["seconds"]
        return f"{shape} {c['kernel']}" + (
            f" ({max(t.values()) / min(t.values()):.2f}x)" if len(t) > 1 else ""
        )

    return ", ".join(one(shape, c) for shape, c in choice.items())


# the dtypes whose linears are timed and packed: float32, and bfloat16 where oneDNN has its kernels
PACKED_DTYPES = (torch.float32, torch.bfloat16)


def kernel_cache_file():
    """Where the machine's kernel and dtype choices are kept: beside the converted weights."""
    from .loader import cache_dir

    return cache_dir() / "cpu_kernels.json"


# "other": run every "auto" engine on the kernels this machine did NOT choose
KERNELS_ENV = "MINICB_CPU_KERNELS"


def other_choice(choice: dict[str, dict]) -> dict[str, dict]:
    """The same shapes on the kernel that lost: torch.matmul where oneDNN won, and the reverse.

    Float32 results may differ in the last bits between the two (each blocks the sums its own way),
    which is exactly what a test should not depend on: CI runs the learners' notebooks this way."""
    flipped = {}
    for shape, c in choice.items():
        losers = [k for k in c["seconds"] if k != c["kernel"]]
        flipped[shape] = c | {"kernel": losers[0] if losers else c["kernel"]}
    return flipped


def prepare_cpu_linears(model: nn.Module, mode, cache_file=None) -> tuple[nn.Module, dict]:
    """The engine's entry: mode True packs every untied linear, False none, "auto" measures
    (cached), "other" takes the kernel "auto" rejected. The environment variable
    MINICB_CPU_KERNELS=other turns every "auto" into "other" (a one-line switch to check that
    nothing depends on the machine's choice)."""
    if mode == "auto" and os.environ.get(KERNELS_ENV, "auto") == "other":
        mode = "other"
    if mode in ("auto", "other"):
        choice = cached_choice(model, cache_file)
        if mode == "other":
            choice = other_choice(choice)
        return use_kernels(model, choice), choice
    return (prepack_for_cpu(model) if mode else model), {}


def gemm_peaks(n: int = 2048, repeats: int = 10, dtype=torch.float32) -> dict[str, float]:
    """The machine's float32 matmul speed in GFLOP/s: the best of a few n x n GEMMs, for each kernel
    PyTorch offers on a CPU. `torch.matmul` calls the BLAS (MKL); "oneDNN packed" is the kernel
    PackedLinear calls. They can differ by 2x either way (MKL takes its AVX2 path on AMD CPUs while
    oneDNN uses AVX-512 where there is one), so the machine's peak is the larger of the two."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    kernels = {"torch.matmul": lambda: a @ b}
    if onednn_linear_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(b)
        kernels["oneDNN packed"] = lambda: torch.ops.mkldnn._linear_pointwise(
            a, packed, None, "none", [], ""
        )
    peaks = {}
    for name, gemm in kernels.items():
        peaks[name] = 2 * n**3 / best_time(gemm, runs=repeats) / 1e9
    return peaks
