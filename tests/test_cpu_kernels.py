"""oneDNN pre-packing (minicb/cpu_kernels.py): same results, an inspectable weight, no duplicated
tied embedding, and a model that still runs when the private operators are missing."""

import pytest
import torch
from torch import nn

from minicb import cpu_kernels
from minicb.loader import load_model, save_tiny_model
from minicb.model import CausalLM


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("tied"), arch="llama", seed=2, tie_word_embeddings=True)
    return load_model(path, dtype=torch.float32)


def build(loaded):
    return CausalLM.from_hf(loaded.hf_config, loaded.state_dict, torch.float32, "cpu")


needs_onednn = pytest.mark.skipif(not cpu_kernels.onednn_linear_available(),
                                  reason="this PyTorch lacks oneDNN's private linear operators")


@needs_onednn
def test_packed_linear_keeps_an_inspectable_weight_and_the_same_product():
    linear = nn.Linear(16, 8)
    packed = cpu_kernels.PackedLinear(linear)
    assert torch.equal(packed.weight, linear.weight)  # unpacked for a learner to look at
    x = torch.randn(5, 16)
    assert torch.allclose(packed(x), linear(x), atol=1e-5)


@needs_onednn
def test_tied_embeddings_are_not_packed_twice(tied):
    model = cpu_kernels.prepack_for_cpu(build(tied))
    assert type(model.layers[0].mlp.down_proj) is cpu_kernels.PackedLinear
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.embed_tokens.weight


def test_without_the_operators_the_model_is_unchanged(tied, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "onednn_linear_available", lambda: False)
    model = build(tied)
    before = {name: type(m) for name, m in model.named_modules()}
    assert cpu_kernels.prepack_for_cpu(model) is model
    assert {name: type(m) for name, m in model.named_modules()} == before
    peaks = cpu_kernels.gemm_peaks(n=64, repeats=1)
    assert list(peaks) == ["torch.matmul"]  # only the kernels that exist are measured


def test_gemm_peaks_time_real_work():
    # A peak is 2 n^3 FLOPs over the best time: timing a matmul of 8x the work must not look faster
    # than the small one by more than the machine could explain, and every kernel must be finite.
    small, large = cpu_kernels.gemm_peaks(n=64, repeats=3), cpu_kernels.gemm_peaks(n=256, repeats=3)
    for name in small:
        assert 0 < small[name] < float("inf") and 0 < large[name] < float("inf")
        assert large[name] < 1e5, "more than 100 TFLOP/s on a CPU: the timing is wrong"
