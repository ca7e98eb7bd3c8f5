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
"""

import time

import torch
from torch import nn


def onednn_linear_available() -> bool:
    """True when this PyTorch has oneDNN and the two private linear operators."""
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """An nn.Linear whose weight oneDNN packed once, at load time; dense activations in and out."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # (out_features, in_features) in oneDNN's blocked layout, an opaque "mkldnn" tensor
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach()))
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:
        """The weight as a plain (out_features, in_features) tensor, unpacked (a copy) for inspection."""
        return self.packed_weight.to_dense()

    def forward(self, x):  # x: (num_tokens, in_features) -> (num_tokens, out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for oneDNN"


def prepack_for_cpu(model: nn.Module) -> nn.Module:
    """Float32 on a CPU: replace every nn.Linear by a PackedLinear, in place (2-3x faster small matmuls).

    A linear whose weight is shared with another module (the LM head of a model with tied
    embeddings) stays as it is: packing it would keep a second copy of the embedding table.
    Without the oneDNN operators, the model is returned unchanged.
    """
    if not onednn_linear_available():
        return model
    shared = {id(p) for m in model.modules() if not isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and id(child.weight) not in shared:
                setattr(module, name, PackedLinear(child))
    return model


def gemm_peaks(n: int = 2048, repeats: int = 10) -> dict[str, float]:
    """The machine's float32 matmul speed in GFLOP/s: the best of a few n x n GEMMs, for each kernel
    PyTorch offers on a CPU. `torch.matmul` calls the BLAS (MKL); "oneDNN packed" is the kernel
    PackedLinear calls. They can differ by 2x either way (MKL takes its AVX2 path on AMD CPUs while
    oneDNN uses AVX-512 where there is one), so the machine's peak is the larger of the two."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    kernels = {"torch.matmul": lambda: a @ b}
    if onednn_linear_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(b)
        kernels["oneDNN packed"] = lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")
    peaks = {}
    for name, gemm in kernels.items():
        gemm()  # warm up
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            gemm()
            best = min(best, time.perf_counter() - t)
        peaks[name] = 2 * n**3 / best / 1e9
    return peaks
