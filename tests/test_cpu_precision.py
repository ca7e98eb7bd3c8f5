"""Faster weights on a CPU (model_executor/cpu_precision.py): int8 weights that are exactly what
they claim to be, dtype "auto" chosen by measuring, and the refusals."""

import pytest
import torch
from reference import greedy_reference
from torch import nn

from minicb import LLM, SamplingParams
from minicb.config import EngineConfig
from minicb.model_executor import cpu_precision
from minicb.model_executor.cpu_precision import Int8Linear, quantize_int8, quantize_linears
from minicb.model_executor.loader import load_model, make_tiny_model, save_tiny_model

PROMPTS = [[5, 9, 2, 77], [3] * 11, list(range(2, 40))]
MAX_TOKENS = [12, 7, 20]


def test_int8_rows_are_scaled_and_rounded_to_within_half_a_step():
    w = torch.randn(48, 32, dtype=torch.float64) * torch.linspace(0.01, 3, 48)[:, None]
    w[5] = 0  # an all-zero row
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert (q.abs().amax(dim=1)[torch.arange(48) != 5] == 127).all()  # each row uses its range
    err = (q.double() * scale.double()[:, None] - w).abs()
    assert (err <= scale.double()[:, None] / 2 + 1e-12).all()
    assert (q[5] == 0).all()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_int8_linear_multiplies_by_its_dequantized_weight(dtype, tol, monkeypatch):
    """PyTorch's int8 kernel and the fallback give x (q * scale)^T + b (relative tolerance: bfloat16
    keeps 8 bits of mantissa, float32 sums in a different order)."""
    lin = nn.Linear(64, 96).to(dtype)
    x = torch.randn(16, 64, dtype=dtype)
    int8 = Int8Linear(lin)
    expect = (x.double() @ int8.weight.double().T + lin.bias.double()).to(dtype)
    scale = expect.abs().max().item()
    assert (int8(x) - expect).abs().max().item() <= tol * scale
    monkeypatch.setattr(cpu_precision, "int8_available", lambda: False)
    assert (int8(x) - expect).abs().max().item() <= tol * scale


def test_quantize_linears_covers_every_linear_and_copies_a_tied_head():
    hf = make_tiny_model("llama", seed=0, dtype=torch.float32, tie_word_embeddings=True)
    from minicb.model_executor.model import CausalLM

    loaded_sd = {k: v for k, v in hf.state_dict().items()}
    model = CausalLM.from_hf(hf.config, loaded_sd, torch.float32, "cpu")
    embedding = model.embed_tokens.weight.detach().clone()
    quantize_linears(model)
    assert not [m for m in model.modules() if type(m) is nn.Linear]
    assert isinstance(model.lm_head, Int8Linear)
    assert torch.equal(model.embed_tokens.weight, embedding)  # the lookup keeps its float rows
    assert (model.lm_head.weight - embedding).abs().max() <= embedding.abs().max() / 254 + 1e-7


def test_int8_engine_is_the_dequantized_model_token_for_token(tmp_path):
    """float64 activations run the fallback, so the engine with int8 weights must give exactly the
    greedy tokens of transformers running the same model with every linear's weight replaced by
    its de-quantized int8 copy."""
    path = save_tiny_model(tmp_path, arch="qwen2", seed=3)
    loaded = load_model(path, dtype=torch.float64)
    hf = make_tiny_model("qwen2", seed=3, dtype=torch.float64)
    with torch.no_grad():
        for m in hf.modules():
            if type(m) is nn.Linear:
                q, scale = quantize_int8(m.weight)
                m.weight.copy_(q.double() * scale.double()[:, None])
    refs = greedy_reference(hf, PROMPTS, MAX_TOKENS)
    llm = LLM.from_loaded(loaded, dtype="float64", quantization="int8")
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == refs
    # and the int8 model is not the float one here (prompt 0's tokens part), so the equality
    # above could not hold for an engine that forgot to quantize
    plain = LLM.from_loaded(loaded, dtype="float64")
    unquantized = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    assert isinstance(llm.engine.runner.model.lm_head, Int8Linear)
    assert unquantized != got


def test_dtype_auto_times_float32_against_bfloat16_once_and_keeps_the_faster(tmp_path, monkeypatch):
    config = make_tiny_model("llama", seed=0).config
    timed = []

    def fake(counts, dtype):
        timed.append(dtype)
        return {torch.float32: 2.0, torch.bfloat16: 1.0}[dtype]

    monkeypatch.setattr(cpu_precision, "time_dtype", fake)
    monkeypatch.setattr(cpu_precision, "native_bf16", lambda: True)
    cache = tmp_path / "kernels.json"
    assert cpu_precision.resolve_dtype("auto", "cpu", config, cache) == "bfloat16"
    assert timed == [torch.float32, torch.bfloat16]
    assert cpu_precision.resolve_dtype("auto", "cpu", config, cache) == "bfloat16"
    assert len(timed) == 2  # cached: measured once per machine and model shape
    monkeypatch.setattr(cpu_precision, "native_bf16", lambda: False)
    assert cpu_precision.resolve_dtype("auto", "cpu", config, cache) == "float32"
    assert cpu_precision.resolve_dtype("auto", "cuda", config, cache) == "bfloat16"
    assert cpu_precision.resolve_dtype("float64", "cpu", config, cache) == "float64"
    assert len(timed) == 2


def test_linear_counts_are_one_forward_pass():
    """Every weight of every linear once (minicb fuses q, k, v and gate, up: the shapes differ from
    transformers', the elements do not), the LM head included."""
    hf = make_tiny_model("llama", seed=0)
    counts = cpu_precision.linear_counts(hf.config)
    elements = sum(i * o * n for (i, o), n in counts.items())
    assert elements == sum(m.weight.numel() for m in hf.modules() if type(m) is nn.Linear)
    assert counts[(hf.config.hidden_size, hf.config.vocab_size)] >= 1


def test_engine_with_dtype_auto_runs_in_the_dtype_it_chose(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_precision, "choose_cpu_dtype", lambda *a: ("bfloat16", {}))
    loaded = load_model(save_tiny_model(tmp_path, arch="llama", seed=0), dtype=torch.float32)
    llm = LLM.from_loaded(loaded, dtype="auto")
    assert llm.engine.config.dtype == "bfloat16"
    assert llm.engine.runner.model.lm_head.weight.dtype == torch.bfloat16
    out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize(
    "fields,words",
    [
        (dict(quantization="int4"), ["quantization", "'int4'", "int8"]),
        (dict(quantization="int8", device="cuda"), ["int8", "CPU", "cuda"]),
        (dict(quantization="int8", tensor_parallel_size=2), ["int8", "tensor_parallel_size=2"]),
        (dict(dtype="fp8"), ["dtype", "'fp8'", "auto"]),
    ],
)
def test_config_refuses_what_int8_weights_cannot_do(fields, words):
    with pytest.raises(ValueError) as e:
        EngineConfig(**fields)
    for w in words:
        assert w in str(e.value)


def test_the_load_tests_offline_yardstick_runs_dtype_auto(tmp_path, monkeypatch):
    """The load test builds its offline engine from the server's config: with dtype "auto" it loads
    float32 weights and lets the engine choose, as the server does."""
    from minicb.serve.loadtest import Offline

    monkeypatch.setattr(cpu_precision, "choose_cpu_dtype", lambda *a: ("bfloat16", {}))
    path = save_tiny_model(tmp_path, arch="llama", seed=0)
    offline = Offline(EngineConfig(model=str(path), dtype="auto", num_blocks=64, block_size=4))
    assert offline.with_slots(2).engine.config.dtype == "bfloat16"
