"""What gpt-oss's mixture of experts adds to fused_moe.py's (OpenAI, "gpt-oss-120b & gpt-oss-20b
Model Card", 2025): a router with a bias that picks the top_k logits before the softmax, experts
with biases, and a clamped SwiGLU ("swigluoai" in vLLM); and the checkpoint's layout of them.

  router_logits = x @ W_router^T + b_router                (num_tokens, E)
  topk_weights  = softmax(the top_k logits)                 (the other experts never enter it)
  expert_e(x)   = W2_e (swigluoai(W13_e x + b13_e)) + b2_e
  swigluoai     = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)

The attention's sinks live in attention_sinks.py; the rest of gpt-oss (biases on q, k, v and o,
YaRN RoPE, alternating windowed and full layers) is what model.py already reads from a config.
"""

import torch
import torch.nn.functional as F
from torch import nn


class GptOssRouter(nn.Module):
    """The router of one gpt-oss MoE layer: a linear layer with a bias, the top_k logits, then the
    softmax over those k only, in the logits' dtype (as transformers computes it). Returns
    (topk_weights, topk_ids), each (num_tokens, top_k)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts))

    def forward(self, x) -> tuple[torch.Tensor, torch.Tensor]:
        router_logits = F.linear(x, self.weight, self.bias)  # (num_tokens, E)
        top_logits, topk_ids = router_logits.topk(self.top_k, dim=-1)
        return torch.softmax(top_logits, dim=-1), topk_ids


def swigluoai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """(rows, 2 * I) as [gate | up] -> (rows, I): gpt-oss's SwiGLU. The gate is clamped from above
    and up on both sides, so that no activation grows past `limit`; sigmoid(alpha * g) * g is a
    GELU-like curve (alpha 1.702), and up + 1 lets an expert pass the gate through when up is 0."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def deinterleave(t: torch.Tensor) -> torch.Tensor:
    """The checkpoint's gate and up columns, interleaved (gate at even positions, up at odd), as
    [gate | up] along the last dim, the order fused_moe's experts split."""
    return torch.cat((t[..., ::2], t[..., 1::2]), dim=-1)


def gpt_oss_weights(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A gpt-oss state dict with minicb's names: the router as the MoE block's `gate`, and the
    experts stacked as FusedMoE keeps them. The checkpoint stores them transposed, x @ W:
    gate_up_proj (E, hidden, 2 * I) with gate and up interleaved, down_proj (E, I, hidden), and a
    bias for each; minicb's w13_weight is (E, 2 * I, hidden), [gate | up], and w2_weight
    (E, hidden, I)."""
    out = {}
    for name, t in state_dict.items():
        name = name.replace(".mlp.router.", ".mlp.gate.")
        prefix = name[: name.rfind("experts.") + len("experts.")]
        if name.endswith("experts.gate_up_proj"):
            out[prefix + "w13_weight"] = deinterleave(t).transpose(1, 2)
        elif name.endswith("experts.gate_up_proj_bias"):  # (E, 2 * I)
            out[prefix + "w13_bias"] = deinterleave(t)
        elif name.endswith("experts.down_proj"):
            out[prefix + "w2_weight"] = t.transpose(1, 2)
        elif name.endswith("experts.down_proj_bias"):  # (E, hidden)
            out[prefix + "w2_bias"] = t
        else:
            out[name] = t
    return out


def is_gpt_oss_shardable(name: str) -> bool:
    """Is `name` one of the gpt-oss tensors that tensor parallelism splits by gpt_oss_shard?"""
    return name.endswith(".sinks") or ".mlp.experts." in name


def gpt_oss_shard(name: str, t: torch.Tensor, rank: int, n: int, expert_parallel: bool):
    """Rank `rank`'s share of a gpt-oss sink or expert tensor, in the checkpoint's layout (before
    gpt_oss_weights): a sink per query head, split with the heads; whole experts with expert
    parallelism; else every expert split like a dense MLP. Gate and up are interleaved along the
    last dim of gate_up_proj, so a contiguous chunk of it holds the same features of both. The down
    projection's bias is added once, by rank 0, since the ranks' outputs are summed."""
    if name.endswith(".sinks"):
        return t.chunk(n)[rank].clone()
    if expert_parallel:
        return t.chunk(n, dim=0)[rank].clone()  # (E, ...): E / n whole experts
    if name.endswith("experts.down_proj_bias"):  # (E, hidden)
        return t.clone() if rank == 0 else torch.zeros_like(t)
    if name.endswith("experts.down_proj"):  # (E, I, hidden): the input features
        return t.chunk(n, dim=1)[rank].clone()
    return t.chunk(n, dim=-1)[rank].clone()  # gate_up_proj (E, hidden, 2 I), its bias (E, 2 I)
