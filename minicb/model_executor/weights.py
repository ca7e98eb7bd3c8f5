"""Weights: a Hugging Face state dict into minicb's model, whose layers fuse what transformers keeps
apart.

minicb's attention computes q, k and v with one matmul (`qkv_proj`) and its MLP computes gate and up
with one (`gate_up_proj`), as vLLM's do: one larger GEMM instead of three (or two) small ones. So
the checkpoint's `q_proj`, `k_proj`, `v_proj` weights are concatenated along the output dimension
into `qkv_proj`, `gate_proj` and `up_proj` into `gate_up_proj`, and every other name maps one to one
(without the "model." prefix). A model with tied embeddings (SmolLM2, small Qwens) has one tensor
for the input embedding and the LM head. Anything missing or left over is an error that names it.

Mixture-of-experts checkpoints store each expert's projections apart (`mlp.experts.7.gate_proj`;
Mixtral's `block_sparse_moe.experts.7.w1`, with w1 = gate, w3 = up, w2 = down); minicb stacks them
as vLLM's FusedMoE does: `experts.w13_weight` (E, 2 * I, hidden) and `experts.w2_weight`
(E, hidden, I). transformers 5 keeps them stacked in memory already (`experts.gate_up_proj`,
`experts.down_proj`); `per_expert_names` turns every layout into the first, which tensor-parallel
sharding also reads. gpt-oss keeps its experts stacked and transposed, with biases and gate and up
interleaved: gpt_oss.gpt_oss_weights turns them into minicb's stacked names before anything else.
"""

import re

import torch

from .gpt_oss import gpt_oss_weights

MIXTRAL_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
EXPERT = re.compile(r"(.*\.)experts\.(\d+)\.(\w+)\.weight$")  # prefix, expert, projection


def per_expert_names(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict with every MoE layer in one layout: `...mlp.gate.weight` for the router and
    `...mlp.experts.{e}.{gate,up,down}_proj.weight` per expert. Dense models pass through."""
    out = {}
    for name, t in state_dict.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's hub names
        expert = EXPERT.match(name)
        if expert and expert.group(3) in MIXTRAL_NAMES:
            prefix, e, proj = expert.groups()
            name = f"{prefix}experts.{e}.{MIXTRAL_NAMES[proj]}.weight"
        if name.endswith("experts.gate_up_proj"):  # transformers 5, stacked: (E, 2 * I, hidden)
            prefix = name.removesuffix("gate_up_proj")
            for e, w in enumerate(t):
                gate, up = w.chunk(2, dim=0)
                out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = gate, up
        elif name.endswith("experts.down_proj"):  # (E, hidden, I)
            prefix = name.removesuffix("down_proj")
            out.update((f"{prefix}{e}.down_proj.weight", w) for e, w in enumerate(t))
        else:
            out[name] = t
    return out


def expert_weight(name: str, hf: dict, num_experts: int, dtype, device) -> torch.Tensor:
    """Our stacked `experts.w13_weight` or `experts.w2_weight` from the per-expert tensors of `hf`
    (popped as they are used)."""
    prefix = name.removesuffix("w13_weight").removesuffix("w2_weight")
    projections = ("gate_proj", "up_proj") if name.endswith("w13_weight") else ("down_proj",)
    stacked = []
    for e in range(num_experts):
        parts = [f"{prefix}{e}.{p}.weight" for p in projections]
        missing = [p for p in parts if p not in hf]
        if missing:
            raise ValueError(f"state dict has no {missing[0]!r} (needed for {name})")
        stacked.append(torch.cat([hf.pop(p).to(device=device, dtype=dtype) for p in parts]))
    return torch.stack(stacked)


def hf_names(name: str) -> list[str]:
    """The Hugging Face parameters (without the "model." prefix) that make up one of ours."""
    if ".qkv_proj." in name:
        return [name.replace("qkv_proj", f"{x}_proj") for x in "qkv"]
    if ".gate_up_proj." in name:
        return [name.replace("gate_up_proj", p) for p in ("gate_proj", "up_proj")]
    return [name]


def load_hf_weights(model, state_dict: dict[str, torch.Tensor], dtype: torch.dtype, device) -> None:
    """Give `model` (a CausalLM built on the meta device: shapes only) the weights of `state_dict`,
    on `device` in `dtype`."""
    if model.config.model_type == "gpt_oss":
        state_dict = gpt_oss_weights(state_dict)
    hf = {
        k.removeprefix("model."): t
        for k, t in per_expert_names(state_dict).items()
        if not k.endswith("rotary_emb.inv_freq")
    }
    if model.tie_word_embeddings:
        hf.pop("lm_head.weight", None)  # the same tensor as embed_tokens.weight

    weights = {}
    for name in model.state_dict():
        if name == "lm_head.weight" and model.tie_word_embeddings:
            continue
        is_per_expert = name.endswith(("experts.w13_weight", "experts.w2_weight"))
        if is_per_expert and name not in hf:  # stacked from each expert's tensors
            num_experts = model.get_parameter(name).shape[0]
            weights[name] = expert_weight(name, hf, num_experts, dtype, device)
            continue
        parts = hf_names(name)
        missing = [p for p in parts if p not in hf]
        if missing:
            raise ValueError(
                f"state dict has no {missing[0]!r} (needed for {name}); "
                "is tie_word_embeddings / attention_bias set right in the config?"
            )
        weights[name] = torch.cat([hf.pop(p).to(device=device, dtype=dtype) for p in parts])
    if hf:
        raise ValueError(
            f"state dict has parameters this {model.config.model_type} model does not use: "
            f"{sorted(hf)[:5]}"
        )
    if model.tie_word_embeddings:
        weights["lm_head.weight"] = weights["embed_tokens.weight"]
    model.load_state_dict(weights, strict=True, assign=True)
    if model.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight  # one Parameter, not two copies
