"""Weights: a Hugging Face state dict into minicb's model, whose layers fuse what transformers keeps
apart.

minicb's attention computes q, k and v with one matmul (`qkv_proj`) and its MLP computes gate and up
with one (`gate_up_proj`), as vLLM's do: one larger GEMM instead of three (or two) small ones. So
the checkpoint's `q_proj`, `k_proj`, `v_proj` weights are concatenated along the output dimension
into `qkv_proj`, `gate_proj` and `up_proj` into `gate_up_proj`, and every other name maps one to one
(without the "model." prefix). A model with tied embeddings (SmolLM2, small Qwens) has one tensor
for the input embedding and the LM head. Anything missing or left over is an error that names it.
"""

import torch


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
    hf = {
        k.removeprefix("model."): t
        for k, t in state_dict.items()
        if not k.endswith("rotary_emb.inv_freq")
    }
    if model.tie_word_embeddings:
        hf.pop("lm_head.weight", None)  # the same tensor as embed_tokens.weight

    weights = {}
    for name in model.state_dict():
        if name == "lm_head.weight" and model.tie_word_embeddings:
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
