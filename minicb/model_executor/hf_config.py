"""What the engine reads off a Hugging Face model config: the shape of one attention head, how many
key/value heads there are, which layers slide a window, and so how many bytes of KV cache one token
needs. The model, its attention paths, the KV cache and the memory planner all ask these questions;
the answers live here, below all of them."""

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


def kv_bytes_per_token(hf_config, dtype: torch.dtype) -> int:
    """Bytes of cache one token needs: K and V, in every layer, for every kv head."""
    return (
        2
        * hf_config.num_hidden_layers
        * num_kv_heads_of(hf_config)
        * head_dim_of(hf_config)
        * dtype.itemsize
    )


def sliding_window_of(hf_config, layer_idx: int) -> int | None:
    """Keys a query may see in this layer (itself included), or None for full causal attention."""
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if window is None:
        return None
    if layer_types is not None:  # Qwen2/Qwen3: per-layer choice
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window if hf_config.model_type == "mistral" else None
