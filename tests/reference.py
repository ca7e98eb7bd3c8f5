"""The reference every parity test compares with: transformers' greedy generate, each prompt alone."""

import torch


def greedy_reference(hf_model, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Exactly max_tokens[i] greedy tokens for prompts[i] (EOS ignored), no batching, no padding."""
    refs = []
    with torch.no_grad():
        for p, n in zip(prompts, max_tokens):
            out = hf_model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                    pad_token_id=0, eos_token_id=None)
            refs.append(out[0, len(p):].tolist())
    return refs
