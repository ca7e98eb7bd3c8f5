"""oneDNN pre-packing (minicb/model_executor/cpu_kernels.py): same results, an inspectable weight,
no duplicated tied embedding, and a model that still runs when the private operators are missing."""

import json
import time

import pytest
import torch
from torch import nn

from minicb.model_executor import cpu_kernels
from minicb.model_executor.loader import load_model, save_tiny_model
from minicb.model_executor.model import CausalLM


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    path = save_tiny_model(
        tmp_path_factory.mktemp("tied"), arch="llama", seed=2, tie_word_embeddings=True
    )
    return load_model(path, dtype=torch.float32)


def build(loaded):
    return CausalLM.from_hf(loaded.hf_config, loaded.state_dict, torch.float32, "cpu")


needs_onednn = pytest.mark.skipif(
    not cpu_kernels.onednn_linear_available(),
    reason="this PyTorch lacks oneDNN's private linear operators",
)


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


# ---------------------------------------------------------------------- the kernel chosen per
# machine
def slowed(which: str, real=cpu_kernels.kernel_fn):
    """kernel_fn with `which` made 2 ms slower per call: the choice must then take the other one."""

    def fn(kernel, weight):
        f = real(kernel, weight)
        if kernel != which:
            return f
        return lambda x: (time.sleep(0.002), f(x))[1]

    return fn


@needs_onednn
@pytest.mark.parametrize("slow, fast", [("onednn", "matmul"), ("matmul", "onednn")])
def test_the_choice_takes_the_faster_kernel(monkeypatch, slow, fast):
    monkeypatch.setattr(cpu_kernels, "TIME_PER_CASE_S", 0.005)
    monkeypatch.setattr(cpu_kernels, "kernel_fn", slowed(slow))
    choice = cpu_kernels.choose_kernels([(32, 64), (64, 16)])
    assert [c["kernel"] for c in choice.values()] == [fast, fast]
    # 3 batch sizes
    assert all(c["seconds"][slow] > c["seconds"][fast] + 3 * 0.002 for c in choice.values())


@needs_onednn
def test_the_chosen_kernels_are_used_and_a_tied_head_is_packed_as_a_copy(tied):
    model = build(tied)
    attn = model.layers[0].self_attn
    qkv, o = (
        f"{attn.qkv_proj.in_features}x{attn.qkv_proj.out_features}",
        f"{attn.o_proj.in_features}x{attn.o_proj.out_features}",
    )
    head = f"{model.lm_head.in_features}x{model.lm_head.out_features}"
    assert o not in (qkv, head)  # (the tiny model's qkv and LM head may share a shape: both packed)
    x = torch.randn(3, model.config.hidden_size)
    before = model.lm_head(x)
    cpu_kernels.use_kernels(
        model, {qkv: {"kernel": "onednn"}, o: {"kernel": "matmul"}, head: {"kernel": "onednn"}}
    )
    assert type(model.layers[1].self_attn.qkv_proj) is cpu_kernels.PackedLinear
    assert type(model.layers[1].self_attn.o_proj) is nn.Linear
    assert type(model.lm_head) is cpu_kernels.PackedLinear  # the embedding keeps its own table
    assert (
        type(model.embed_tokens) is nn.Embedding
        and model.embed_tokens.weight.shape[0] == model.config.vocab_size
    )
    assert torch.allclose(model.lm_head(x), before, atol=1e-5)


def test_the_choice_is_measured_once_per_machine_and_cached(tied, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cpu_kernels, "TIME_PER_CASE_S", 0.001)
    cache, timed = tmp_path / "kernels.json", []
    timer = lambda i, o, k, dtype=None: timed.append((i, o, k)) or {"matmul": 1.0, "onednn": 2.0}[k]
    model = build(tied)
    first = cpu_kernels.cached_choice(model, str(cache), timer)
    assert set(first) == {f"{i}x{o}" for i, o in cpu_kernels.linear_shapes(model)}
    assert all(c["kernel"] == "matmul" for c in first.values()) and timed
    assert "once on this machine" in capsys.readouterr().out
    timed.clear()
    # read back, not timed
    assert cpu_kernels.cached_choice(build(tied), str(cache), timer) == first and not timed
    assert cpu_kernels.machine_key() in json.loads(cache.read_text())
    cache.write_text("{ not json")  # a damaged cache is measured again
    assert cpu_kernels.cached_choice(build(tied), str(cache), timer) == first and timed
