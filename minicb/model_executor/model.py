"""A Llama-family decoder-only transformer over the paged KV cache.

Covers Llama (and SmolLM2), Mistral, Qwen2, Qwen3 and Gemma 3 (text), and the mixture-of-experts
families Qwen3-MoE, Mixtral and gpt-oss (their MLPs are fused_moe.SparseMoeBlock), loaded from
Hugging Face weights.
The forward pass works on one *flat* batch: every scheduled token of every sequence,
(num_tokens,), with no padding to a common length. Where each token sits in its
sequence (positions) and in the cache (AttentionMetadata) is all that ties it to a
sequence, which is what lets decodes and prefill chunks share one step.

  embedding -> layers: [RMSNorm -> fused qkv -> RoPE -> paged attention -> o_proj -> + residual,
                        RMSNorm -> fused gate_up -> SiLU(gate) * up -> down -> + residual]
                        (MoE: RMSNorm -> router -> top_k experts' MLPs, weighted -> + residual)
            -> final RMSNorm -> (compute_logits) lm_head
  Gemma 3: embeddings scaled by sqrt(hidden_size), q/k RMSNorm, an RMSNorm after attention and
  around the MLP too ("sandwich" norms), a RoPE table per layer type (local and global layers).
  gpt-oss: attention sinks (attention_sinks.py), biases on q, k, v and o, its experts (gpt_oss.py).

Papers: Llama (Touvron et al., 2023), RoPE (Su et al., 2021), RMSNorm (Zhang & Sennrich,
2019), SwiGLU (Shazeer, 2020), grouped-query attention (Ainslie et al., 2023), Gemma 3 (Gemma
Team, 2025).
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .attention import AttentionMetadata, paged_attention
from .fused_moe import moe_block
from .hf_config import (
    has_attention_sinks,
    head_dim_of,
    mla_spec_of,
    num_kv_heads_of,
    rope_layer_type_of,
    sliding_window_of,
)
from .mla import MLAttention
from .weights import load_hf_weights

SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "deepseek_v3",
    "gemma3_text",
    "gpt_oss",
)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # x / sqrt(mean(x^2) + eps), then a learned per-channel gain. Computed in float32 for
        # every dtype, as transformers does: bf16 sums lose digits, and in float64 it keeps us
        # bit-comparable with the reference implementation.
        if (
            x.dtype == torch.float32 == self.weight.dtype
        ):  # the same numbers, the gain in the same call
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def extra_repr(self):
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: its weight holds gain - 1, and the gain is applied in float32 before the one
    cast back, even in float64: transformers' exact steps, for parity."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)  # gain 1 + 0: the identity, where transformers starts it

    def forward(self, x):
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


def rms_norm_class(cfg) -> type[RMSNorm]:
    return GemmaRMSNorm if cfg.model_type == "gemma3_text" else RMSNorm


def rope_tables(
    hf_config, head_dim: int, layer_type: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for every position up to max_position_embeddings: two (max_pos, head_dim) float32
    tables; layer_type picks one set of rope_parameters where they differ by layer type (Gemma 3).

    The frequency variants (linear, llama3, yarn, dynamic, ...) come from transformers;
    like transformers we compute angles in float32 and scale cos/sin by attention_factor.
    """
    params = getattr(hf_config, "rope_parameters", None) or {
        "rope_theta": getattr(hf_config, "rope_theta", 10000.0)
    }
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        dims = torch.arange(0, head_dim, 2, dtype=torch.float32)
        inv_freq, attention_factor = 1.0 / (params["rope_theta"] ** (dims / head_dim)), 1.0
    elif rope_type == "longrope":
        # longrope switches frequencies with the current sequence length: not one table.
        raise ValueError(
            "rope_type 'longrope' is not supported; supported: default, "
            + ", ".join(t for t in ROPE_INIT_FUNCTIONS if t != "longrope")
        )
    elif rope_type in ROPE_INIT_FUNCTIONS:
        # "dynamic" only rescales beyond max_position_embeddings, where our table ends,
        # so inside the table it is exact.
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](
            hf_config, "cpu", layer_type=layer_type
        )
    else:
        raise ValueError(f"unknown rope_type {rope_type!r}")
    if 2 * inv_freq.numel() != head_dim:
        raise ValueError(
            f"partial rotary embeddings are not supported (rotary dim {2 * inv_freq.numel()} "
            f"!= head_dim {head_dim})"
        )
    positions = torch.arange(hf_config.max_position_embeddings, dtype=torch.float32)
    angles = positions[:, None] * inv_freq.float()[None, :]  # (max_pos, head_dim / 2)
    angles = torch.cat((angles, angles), dim=-1)  # rotate-half layout: (max_pos, head_dim)
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    """Rotate each pair (x[i], x[i + head_dim/2]) by its position's angle. x: (num_tokens, heads,
    head_dim)."""
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, num_kv_heads_of(cfg)
        self.head_dim = head_dim_of(cfg)
        bias = bool(getattr(cfg, "attention_bias", False))
        qkv_bias = bias or cfg.model_type == "qwen2"  # Qwen2: bias on q, k, v but not on o
        # q, k and v projections fused into one matmul at load time: (hidden) -> (heads + 2 *
        # kv_heads) * head_dim
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim, qkv_bias
        )
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias)
        # Qwen3 (and Qwen3-MoE) normalises each q and k head before RoPE
        self.qk_norm = cfg.model_type in ("qwen3", "qwen3_moe", "gemma3_text")
        if self.qk_norm:
            self.q_norm = rms_norm_class(cfg)(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = rms_norm_class(cfg)(self.head_dim, cfg.rms_norm_eps)
        # Gemma 3 scales scores by query_pre_attn_scalar ** -0.5, which need not be head_dim's
        self.scale = (getattr(cfg, "query_pre_attn_scalar", None) or self.head_dim) ** -0.5
        self.sliding_window = sliding_window_of(cfg, layer_idx)
        # gpt-oss: a learned logit per query head that joins every softmax (attention_sinks.py)
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if has_attention_sinks(cfg) else None

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata, quant=None):
        n = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.qkv_proj(x)  # (num_tokens, (num_heads + 2 * kv_heads) * head_dim)
        # q's heads, k's
        qk = qkv[:, : q_size + kv_size].view(n, self.num_heads + self.num_kv_heads, self.head_dim)
        # (num_tokens, kv_heads, head_dim)
        v = qkv[:, q_size + kv_size :].view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:  # Qwen3: every head normalized, q's and k's with their own gains
            qk = torch.cat(
                (self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])), dim=1
            )
        # both in one call
        q, k = apply_rope(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        out = paged_attention(
            q, k, v, k_cache, v_cache, meta, self.scale, self.sliding_window, quant, self.sinks
        )
        return self.o_proj(out.view(n, q_size))


class MLP(nn.Module):
    def __init__(self, cfg, intermediate_size: int | None = None):
        super().__init__()
        bias = bool(getattr(cfg, "mlp_bias", False))
        inter = intermediate_size or cfg.intermediate_size
        # gate and up projections fused into one matmul: (hidden) -> 2 * intermediate
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias)
        self.act = ACT2FN[getattr(cfg, "hidden_activation", None) or cfg.hidden_act]  # Gemma's name

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        norm = rms_norm_class(cfg)
        self.input_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        # DeepSeek-V3: multi-head latent attention (mla.py), its cache one latent per token
        mla = mla_spec_of(cfg) is not None
        self.self_attn = MLAttention(cfg, layer_idx, RMSNorm) if mla else Attention(cfg, layer_idx)
        self.post_attention_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = moe_block(cfg, layer_idx, MLP) or MLP(cfg)
        # Gemma 3 normalizes each block's output too: post_attention_layernorm is then the norm
        # after attention, and the MLP gets its own norm before and after
        self.sandwich_norms = cfg.model_type == "gemma3_text"
        if self.sandwich_norms:
            self.pre_feedforward_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, cos, sin, k_cache, v_cache, meta, quant=None):
        attn = self.self_attn(
            self.input_layernorm(h), cos, sin, k_cache, v_cache, meta, quant=quant
        )
        if self.sandwich_norms:
            h = h + self.post_attention_layernorm(attn)
            return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        h = h + attn
        return h + self.mlp(self.post_attention_layernorm(h))


class CausalLM(nn.Module):
    def __init__(self, hf_config):
        super().__init__()
        if hf_config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {hf_config.model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        # Gemma 2's tanh cap on attention scores and EmbeddingGemma's bidirectional attention: the
        # paged attention has neither
        for field in ("attn_logit_softcapping", "use_bidirectional_attention"):
            if getattr(hf_config, field, None):
                raise ValueError(
                    f"{hf_config.model_type} with {field}={getattr(hf_config, field)!r} is not "
                    "supported: minicb's attention is causal, with no cap on the scores"
                )
        self.config = hf_config
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.embed_tokens = nn.Embedding(hf_config.vocab_size, hf_config.hidden_size)
        # Gemma: embeddings times sqrt(hidden_size), rounded to the model's dtype (from_hf sets it)
        self.register_buffer("embed_scale", None, persistent=False)
        self.layers = nn.ModuleList(
            DecoderLayer(hf_config, i) for i in range(hf_config.num_hidden_layers)
        )
        self.norm = rms_norm_class(hf_config)(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.lm_head = nn.Linear(hf_config.hidden_size, hf_config.vocab_size, bias=False)
        # Gemma 2 squashes logits into (-cap, cap) with tanh; Gemma 3 leaves it None
        self.final_logit_softcapping = getattr(hf_config, "final_logit_softcapping", None)
        # One RoPE table per layer type that has its own rope_parameters (Gemma 3: local layers and
        # global ones), else one table: rope_layer_types[t] is table t, layer_rope[i] layer i's.
        layer_types = [rope_layer_type_of(hf_config, i) for i in range(hf_config.num_hidden_layers)]
        self.rope_layer_types = list(dict.fromkeys(layer_types))
        self.layer_rope = [self.rope_layer_types.index(t) for t in layer_types]
        # cos/sin of every position, (max_position_embeddings, head_dim), with a leading (tables,)
        # dimension only when there are several; from_hf fills them
        self.max_position_embeddings = hf_config.max_position_embeddings
        several = (len(self.rope_layer_types),) if len(self.rope_layer_types) > 1 else ()
        table_shape = (*several, self.max_position_embeddings, head_dim_of(hf_config))
        self.register_buffer("rope_cos", torch.empty(table_shape), persistent=False)
        self.register_buffer("rope_sin", torch.empty(table_shape), persistent=False)

    @classmethod
    def from_hf(
        cls, hf_config, state_dict: dict[str, torch.Tensor], dtype: torch.dtype, device
    ) -> "CausalLM":
        """Build from a transformers config and a state dict with Hugging Face parameter names."""
        with torch.device("meta"):  # shapes only: no memory, no random init
            model = cls(hf_config)
        # names mapped, qkv and gate/up fused (weights.py)
        load_hf_weights(model, state_dict, dtype, device)
        tables = [rope_tables(hf_config, head_dim_of(hf_config), t) for t in model.rope_layer_types]
        cos, sin = (torch.stack(t) if len(t) > 1 else t[0] for t in zip(*tables))
        model.rope_cos, model.rope_sin = (t.to(device=device, dtype=dtype) for t in (cos, sin))
        if hf_config.model_type == "gemma3_text":
            model.embed_scale = torch.tensor(hf_config.hidden_size**0.5, dtype=dtype, device=device)
        return model.requires_grad_(False).eval()

    def forward(self, input_ids, positions, kv_cache, meta) -> torch.Tensor:
        """input_ids, positions: (num_tokens,) -> hidden states after the final norm (num_tokens,
        hidden_size). meta: an AttentionMetadata, or one per KV cache group (a layer reads its
        group's, as vLLM V1 keys metadata by layer name)."""
        h = self.embed_tokens(input_ids)  # (num_tokens, hidden_size)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        # per table, (num_tokens, 1, head_dim): looked up once, shared by every head of every layer
        # that uses the table (one table: exactly two lookups, as before Gemma 3's second)
        tables = (self.rope_cos, self.rope_sin)
        if self.rope_cos.dim() == 2:
            tables = ([self.rope_cos], [self.rope_sin])
        cos, sin = ([t[positions].unsqueeze(1) for t in ts] for ts in tables)
        metas = meta if isinstance(meta, list) else [meta] * kv_cache.num_groups
        for layer, k_cache, v_cache, quant, group, table in zip(
            self.layers,
            kv_cache.k_caches,
            kv_cache.v_caches,
            kv_cache.quant,
            kv_cache.layer_group,
            self.layer_rope,
        ):
            h = layer(h, cos[table], sin[table], k_cache, v_cache, metas[group], quant=quant)
        return self.norm(h)

    def compute_logits(self, hidden) -> torch.Tensor:
        """(n, hidden_size) -> (n, vocab_size); pass only the rows you sample from."""
        logits = self.lm_head(hidden)
        if self.final_logit_softcapping is not None:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits
