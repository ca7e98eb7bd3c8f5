"""Logits processors: what a request's SamplingParams do to its logits before anything is drawn.

They change which token is best, so they run before greedy decoding and before temperature, in
vLLM's order (vllm/v1/sample/sampler.py):
  1. min_tokens: EOS and the request's stop tokens get -inf until min_tokens tokens are out;
  2. logit_bias: a fixed number added to chosen tokens' logits (OpenAI's field, in [-100, 100]);
  3. repetition_penalty r (CTRL, Keskar et al., 2019): the logit of a token already in the prompt or
     the output is divided by r when positive and multiplied by r when not, so r > 1 always makes
     it less likely;
  4. frequency_penalty f and presence_penalty p (OpenAI's): minus f times the token's count in the
     output so far, minus p once it appeared there at all.
Each row is processed on its own, in a plain loop: these are per-request settings, and a row that
sets none is not touched (not one bit changes, so seeded draws and parity stay exact).
"""

import torch
from torch import Tensor


def process_logits(logits: Tensor, params: list, seqs: list) -> Tensor:
    """Apply each row's logits processors (min_tokens, logit_bias, penalties). logits (n, vocab);
    params: one SamplingParams per row; seqs: one Request (or anything with prompt_token_ids,
    output_token_ids, stop_token_ids) per row. Returns `logits` itself when no row sets a processor,
    so the common case costs nothing and changes no bit; otherwise a float32 (or float64) copy."""
    rows = [i for i, p in enumerate(params) if p.processes_logits]
    if not rows:
        return logits
    out = logits.to(torch.promote_types(logits.dtype, torch.float32), copy=True)  # (n, vocab)
    vocab, device = out.shape[1], out.device
    ids = lambda tokens: torch.tensor(
        [t for t in tokens if t < vocab], dtype=torch.long, device=device
    )
    for i in rows:
        p, seq, row = params[i], seqs[i], out[i]  # row: (vocab,), a view into out
        output_ids = seq.output_token_ids
        if len(output_ids) < p.min_tokens:
            row[ids(seq.stop_token_ids)] = float("-inf")
        if p.logit_bias:
            row[ids(p.logit_bias)] += torch.tensor(
                [b for t, b in p.logit_bias.items() if t < vocab], dtype=out.dtype, device=device
            )
        if p.repetition_penalty != 1:
            seen = ids(set(seq.prompt_token_ids) | set(output_ids))
            row[seen] = torch.where(
                row[seen] > 0, row[seen] / p.repetition_penalty, row[seen] * p.repetition_penalty
            )
        if (p.frequency_penalty or p.presence_penalty) and output_ids:
            counts = torch.bincount(ids(output_ids), minlength=vocab).to(out.dtype)  # (vocab,)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(out.dtype)
    return out
