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

The token ids that min_tokens and logit_bias index never change during a request, so they are made
into tensors once, at the request's first step (ProcessorTensors, kept on the Request): a step then
costs one indexed write per row, however many stop ids or biases the request holds, where walking
a 500,000-entry list in Python at every step would slow every other request of the batch too.
"""

import torch
from torch import Tensor


class ProcessorTensors:
    """One request's fixed indices for min_tokens and logit_bias, on the logits' device. Ids at or
    above the vocabulary are dropped here (a stop id the model can never produce needs no mask)."""

    def __init__(self, params, stop_token_ids, vocab: int, device, dtype: torch.dtype):
        self.key = (vocab, device, dtype)  # what they were built for
        ids = lambda tokens: torch.tensor(
            [t for t in tokens if t < vocab], dtype=torch.long, device=device
        )
        # (num stop ids,): masked with -inf while fewer than min_tokens tokens are out
        self.stop_ids = ids(stop_token_ids) if params.min_tokens else None
        bias = params.logit_bias or {}
        self.bias_ids = ids(bias)  # (num biased ids,)
        self.bias_values = torch.tensor(
            [b for t, b in bias.items() if t < vocab], dtype=dtype, device=device
        )

    def __repr__(self):
        stops = 0 if self.stop_ids is None else len(self.stop_ids)
        return f"ProcessorTensors(stop_ids={stops}, bias_ids={len(self.bias_ids)})"


def processor_tensors(seq, params, vocab: int, device, dtype: torch.dtype) -> ProcessorTensors:
    """The request's ProcessorTensors, built on its first step and kept on it, in
    seq.processor_tensors (a Request starts with None there)."""
    tensors = getattr(seq, "processor_tensors", None)
    if tensors is None or tensors.key != (vocab, device, dtype):
        tensors = ProcessorTensors(params, seq.stop_token_ids, vocab, device, dtype)
        seq.processor_tensors = tensors
    return tensors


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
        fixed = processor_tensors(seq, p, vocab, device, out.dtype)
        if len(output_ids) < p.min_tokens:
            row[fixed.stop_ids] = float("-inf")
        if p.logit_bias:
            row[fixed.bias_ids] += fixed.bias_values
        if p.repetition_penalty != 1:
            seen = ids(set(seq.prompt_token_ids) | set(output_ids))
            row[seen] = torch.where(
                row[seen] > 0, row[seen] / p.repetition_penalty, row[seen] * p.repetition_penalty
            )
        if (p.frequency_penalty or p.presence_penalty) and output_ids:
            counts = torch.bincount(ids(output_ids), minlength=vocab).to(out.dtype)  # (vocab,)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(out.dtype)
    return out
