"""Tiny random models of every supported architecture, for tests that must be exact and fast.

Each is 2 layers (6 for Gemma 3's pattern of five local layers and one global), 4 query heads
sharing 2 KV heads (grouped-query attention), a vocabulary of 128 (the MoE ones with 8 or 4 experts
of which each token picks 2), built by transformers from a config with a fixed seed, so the same
arguments always give the same weights: minicb's forward pass is compared with transformers' on
them in float64, token for token.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

TINY_ARCHS = {  # arch -> (HF config class, fields that give the variant its twist in model.py)
    "llama": ("LlamaConfig", dict()),
    "llama3": (
        "LlamaConfig",
        dict(
            rope_parameters={  # frequency-dependent RoPE scaling
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        ),
    ),
    "mistral": ("MistralConfig", dict(sliding_window=None)),  # the window would exceed 256 anyway
    # every layer windowed, the window shorter than most prompts: positions further back than 8
    # tokens are masked (minicb keeps their blocks: issue 39's cache groups would free them)
    "mistral_window": ("MistralConfig", dict(sliding_window=8)),
    # a hybrid: layer 0 full attention, layer 1 a window of 8 (Qwen2's layers from
    # max_window_layers on are windowed), the 1:1 alternation of gpt-oss in two layers
    "qwen2_hybrid": (
        "Qwen2Config",
        dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
    ),
    # Gemma 3's pattern (five windowed layers, then one with full attention) on Qwen2's layers: 6
    # layers, so 6 KV cache groups of one layer (the shape of issue 39's capacity test)
    "qwen2_local_global": (
        "Qwen2Config",
        dict(
            use_sliding_window=True,
            sliding_window=8,
            num_hidden_layers=6,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
        ),
    ),
    "qwen2": ("Qwen2Config", dict()),  # q/k/v projections have biases
    "qwen3": ("Qwen3Config", dict(head_dim=32)),  # q/k RMSNorm, head_dim != hidden / heads
    # Gemma 3: five layers with a window of 4 (shorter than most prompts), then one global layer,
    # each type with its own RoPE (the global one linearly scaled, as in the larger Gemma 3s);
    # scores scaled by 24 ** -0.5, not head_dim's 16 ** -0.5. Untied like every tiny arch: a tied
    # random Gemma mostly repeats its last token (the embedding, times sqrt(hidden), dominates)
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=6,
            head_dim=16,
            sliding_window=4,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
            query_pre_attn_scalar=24,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            },
        ),
    ),
    # mixtures of experts (fused_moe.py): 8 experts, top 2, probabilities used as they come
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            norm_topk_prob=False,
        ),
    ),
    # 4 experts, top 2, renormalized
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
}
# gpt-oss: 4 layers alternating a window of 8 (shorter than most prompts) and full attention, a sink
# per head, biases on q, k, v, o and on the experts, YaRN RoPE (factor 4 over 64 positions); 4
# experts, top 2; a swiglu_limit of 1 so that the clamps bite on the tiny model's activations
TINY_ARCHS["gpt_oss"] = (
    "GptOssConfig",
    dict(
        num_hidden_layers=4,
        head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=32,
        swiglu_limit=1.0,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
    ),
)
MOE_ARCHS = ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss")
TINY_ARCHS["deepseek_v3"] = (  # multi-head latent attention (mla.py); layer 1 a DeepSeek MoE:
    "DeepseekV3Config",  # 8 experts in 4 groups, the top 2 from the best 2 groups, 1 shared expert
    dict(
        num_key_value_heads=4,
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=24,
        head_dim=16,
        first_k_dense_replace=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
    ),
)


def tiny_config(arch: str = "llama", **config_overrides) -> transformers.PretrainedConfig:
    """The config of a tiny model: 2 layers, 4 query heads sharing 2 KV heads (GQA), vocab 128."""
    if arch not in TINY_ARCHS:
        raise ValueError(f"tiny arch {arch!r} is not one of {', '.join(TINY_ARCHS)}")
    class_name, arch_fields = TINY_ARCHS[arch]
    fields = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=1,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        # HF's default 0.02 makes a tiny model's logits nearly flat, so greedy argmax would
        # hinge on rounding; 0.2 separates the top tokens clearly and outputs stay varied.
        initializer_range=0.2,
    )
    fields.update(arch_fields)
    fields.update(config_overrides)
    config = getattr(transformers, class_name)(**fields)
    # the class AutoModelForCausalLM builds for this config (Gemma3TextConfig: Gemma3ForCausalLM)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    return config


def make_tiny_model(
    arch: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float64, **config_overrides
) -> transformers.PreTrainedModel:
    """A deterministic random HF model (same arch + seed + overrides -> same weights), in eval
    mode."""
    config = tiny_config(arch, **config_overrides)
    with torch.random.fork_rng():  # do not disturb the caller's random stream
        torch.manual_seed(seed)
        # Initialize in float64 whatever `dtype` is, so a float32 model is the rounded float64 one.
        # transformers 5 runs experts with torch._grouped_mm by default, which has no float64
        # kernel: the eager loop over experts is the reference.
        moe = {"experts_implementation": "eager"} if arch in MOE_ARCHS else {}
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64, **moe)
        # HF starts norms at their identity (1; Gemma's 1 + weight at 0) and biases at 0; a forward
        # pass that forgot them would still match. Make them count.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(1.0, 0.1)
                elif name.endswith("bias"):
                    p.normal_(0.0, config.initializer_range)
            for name, b in model.named_buffers():  # DeepSeek's router bias steers the choice
                if name.endswith("e_score_correction_bias"):
                    b.normal_(0.0, 0.5)
    return model.to(dtype).eval()


def save_tiny_model(
    path: str | os.PathLike,
    arch: str = "llama",
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    **config_overrides,
) -> Path:
    """Write a tiny model as an HF directory (config.json, model.safetensors,
    generation_config.json)."""
    path = Path(path)
    make_tiny_model(arch, seed, dtype, **config_overrides).save_pretrained(path)
    return path


BYTE_VOCAB = 256  # a byte tokenizer's tokens: one per byte value, then <eos>


def save_byte_tokenizer(path: str | os.PathLike) -> int:
    """Write a fast tokenizer with one token per byte (ids 0-255) and <eos> (256) into `path`, for
    tests that need text from a tiny model (structured outputs): give the model a vocabulary of at
    least 257 and eos_token_id=256. Returns the EOS id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415

    byte_chars = pre_tokenizers.ByteLevel.alphabet()  # the 256 characters that stand for bytes
    by_byte = sorted(byte_chars, key=lambda c: _byte_of(c))
    vocab = {c: i for i, c in enumerate(by_byte)} | {"<eos>": BYTE_VOCAB}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<eos>"])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")
    fast.chat_template = (  # plain text turns, so a chat endpoint can serve the tiny model
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    fast.save_pretrained(path)
    return BYTE_VOCAB


def _byte_of(char: str) -> int:
    """The byte a ByteLevel character stands for (GPT-2's printable remapping of the 256 bytes)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    code = ord(char)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]
