"""What the engine reads off a Hugging Face model config: the shape of one attention head, how many
key/value heads there are, which layers slide a window and which RoPE each takes, which MLPs are
mixtures of experts, and how many bytes of KV cache one token needs. The model, its attention paths,
the KV cache and the memory planner all ask these questions; the answers live here, below all of
them."""

import math
from dataclasses import dataclass

import torch


def head_dim_of(hf_config) -> int:
    """Size of one attention head (Qwen3 sets it explicitly, others derive it)."""
    return (
        getattr(hf_config, "head_dim", None)
        or hf_config.hidden_size // hf_config.num_attention_heads
    )


def num_kv_heads_of(hf_config) -> int:
    """Number of key/value heads (fewer than query heads with grouped-query attention)."""
    return getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads


def cache_shape_of(hf_config) -> tuple[int, int, int]:
    """(heads, key width, value width) of one token's cache entry in one layer: K and V of every kv
    head; for multi-head latent attention one latent "head" and no separate value (mla.py)."""
    mla = mla_spec_of(hf_config)
    if mla is not None:
        return 1, mla.kv_lora_rank + mla.qk_rope_head_dim, 0
    return num_kv_heads_of(hf_config), head_dim_of(hf_config), head_dim_of(hf_config)


def kv_bytes_per_token(hf_config, dtype: torch.dtype) -> int:
    """Bytes of cache one token needs: K and V, in every layer, for every kv head (MLA: the
    latent)."""
    heads, k_width, v_width = cache_shape_of(hf_config)
    return hf_config.num_hidden_layers * heads * (k_width + v_width) * dtype.itemsize


@dataclass(frozen=True)
class MlaSpec:
    """Multi-head latent attention's shape (DeepSeek-V2/V3's config fields; mla.py)."""

    kv_lora_rank: int  # the cached latent c
    qk_rope_head_dim: int  # the cached rotary key, shared by every head
    qk_nope_head_dim: int  # each head's key from c (and its query's part that meets it)
    v_head_dim: int  # each head's value from c
    q_lora_rank: int | None  # the query's own compression (None: one q_proj)
    rope_interleave: bool  # rotary dims in interleaved pairs
    softmax_scale: float


def mla_spec_of(hf_config) -> MlaSpec | None:
    """The latent attention of a DeepSeek-V3-family config, or None for any other model."""
    if getattr(hf_config, "model_type", None) != "deepseek_v3":  # (a bare namespace: no MLA)
        return None
    scale = (hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim) ** -0.5
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        # YaRN's attention scaling, squared because it scales q and k alike (DeepSeek-V3's config)
        factor, mscale_all_dim = rope["factor"], rope["mscale_all_dim"]
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale = scale * mscale * mscale
    return MlaSpec(
        hf_config.kv_lora_rank,
        hf_config.qk_rope_head_dim,
        hf_config.qk_nope_head_dim,
        hf_config.v_head_dim,
        hf_config.q_lora_rank,
        bool(getattr(hf_config, "rope_interleave", True)),
        scale,
    )


def sliding_window_of(hf_config, layer_idx: int) -> int | None:
    """Keys a query may see in this layer (itself included), or None for full causal attention."""
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if window is None:
        return None
    if layer_types is not None:  # Qwen2/Qwen3: per-layer choice
        return window if layer_types[layer_idx] == "sliding_attention" else None
    # Mistral and the two MoE families window every layer alike when the config sets one
    return window if hf_config.model_type in ("mistral", "mixtral", "qwen3_moe") else None


def has_attention_sinks(hf_config) -> bool:
    """Whether every softmax of the attention holds a learned logit per head (gpt-oss's sinks:
    attention_sinks.py)."""
    return getattr(hf_config, "model_type", None) == "gpt_oss"


def rope_layer_type_of(hf_config, layer_idx: int) -> str | None:
    """The key of this layer's RoPE parameters where they differ by layer type (Gemma 3:
    "sliding_attention" and "full_attention", each with its own theta and scaling), or None where
    one set serves every layer (Qwen2/Qwen3 have layer_types but one flat rope_parameters)."""
    layer_types = getattr(hf_config, "layer_types", None)
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if layer_types is None or layer_types[layer_idx] not in rope:
        return None
    return layer_types[layer_idx]


@dataclass(frozen=True)
class MoeSpec:
    """One mixture-of-experts layer's shape, as the config gives it (fused_moe.py)."""

    num_experts: int  # experts the router scores
    top_k: int  # experts each token runs through (num_experts_per_tok)
    intermediate_size: int  # of one expert's MLP
    renormalize: bool  # the top_k probabilities rescaled to sum to 1


def moe_spec_of(hf_config, layer_idx: int) -> MoeSpec | None:
    """The MoE shape of this layer's MLP, or None for a dense MLP."""
    if hf_config.model_type in ("mixtral", "gpt_oss"):  # every layer; the top_k sum to 1
        return MoeSpec(
            hf_config.num_local_experts,
            hf_config.num_experts_per_tok,
            hf_config.intermediate_size,
            True,
        )
    if hf_config.model_type == "deepseek_v3" and layer_idx >= hf_config.first_k_dense_replace:
        return MoeSpec(  # routed experts; the router and shared experts: grouped_topk.py
            hf_config.n_routed_experts,
            hf_config.num_experts_per_tok,
            hf_config.moe_intermediate_size,
            bool(hf_config.norm_topk_prob),
        )
    if hf_config.model_type == "qwen3_moe":  # dense where mlp_only_layers / decoder_sparse_step say
        is_sparse = (
            layer_idx not in (hf_config.mlp_only_layers or [])
            and hf_config.num_experts > 0
            and (layer_idx + 1) % hf_config.decoder_sparse_step == 0
        )
        if is_sparse:
            return MoeSpec(
                hf_config.num_experts,
                hf_config.num_experts_per_tok,
                hf_config.moe_intermediate_size,
                bool(hf_config.norm_topk_prob),
            )
    return None
