"""Verifying drafts (vLLM's rejection sampler): which proposed tokens a request keeps, exactly.

A verifying row fed [t, d_1, ..., d_k]: its newest token t and k drafts (spec_decode.py). The
model's logits at the row's position j (0-based) are its distribution p_j for the token that follows
t, d_1,
...,
d_j, i.e. for the position where draft d_{j+1} sits; the logits after d_k give one token more.

Greedy: p_j puts all its mass on argmax_j. Draft d_{j+1} is kept while it equals argmax_j; the first
that does not is replaced by argmax_j, and the tokens are exactly those of one-at-a-time greedy
decoding.

Sampling (Leviathan et al., 2023; Chen et al., 2023), for a proposer that is deterministic, i.e.
puts probability 1 on its draft x: keep x with probability p(x); otherwise draw from p with x
removed and the rest renormalized, and stop. The token that comes out is distributed as p: it is x
with probability p(x), and y != x with probability (1 - p(x)) * p(y) / (1 - p(x)) = p(y). Every
draft kept is a token drawn from the model's own distribution, so the whole output is distributed as
without speculation. If every draft is kept, the logits after d_k give the next token, drawn as any
decode's (the model runner's sampler does that: the caller gets None for the replacement then).
"""

import torch
from torch import Tensor

from .sampler import Sampler


def verify(
    logits: Tensor, drafts: list[int], params, sampler: Sampler, generator=None
) -> tuple[int, int | None]:
    """logits (k, vocab) at the k draft positions of one row (logits[j] scores drafts[j]); the
    request's SamplingParams, the runner's Sampler and the request's generator (None: the shared
    one). Returns (drafts accepted, the token that replaces the first rejected draft, or None if all
    were accepted)."""
    if params.temperature == 0:  # greedy: keep drafts while they are the argmax
        # (k,) ties go to the lowest id, as the sampler's argmax
        target = logits.argmax(dim=-1).tolist()
        accepted = next((j for j, (d, t) in enumerate(zip(drafts, target)) if d != t), len(drafts))
        return accepted, (target[accepted] if accepted < len(drafts) else None)
    # (k, vocab): what the sampler would draw from
    probs = sampler.probabilities(logits, [params] * len(drafts))
    draft_probs = probs[
        torch.arange(len(drafts), device=probs.device), torch.tensor(drafts, device=probs.device)
    ]
    uniform = torch.rand(
        len(drafts),
        dtype=probs.dtype,
        device=probs.device,  # (k,) one draw per draft
        generator=generator or sampler.shared_generator(probs.device),
    )
    kept = (uniform < draft_probs).tolist()  # u < p(x) happens with probability p(x)
    accepted = next((j for j, keep in enumerate(kept) if not keep), len(drafts))
    if accepted == len(drafts):
        return accepted, None
    # (vocab,): p without the rejected draft, renormalized by the draw
    residual = probs[accepted].clone()
    residual[drafts[accepted]] = 0  # (p(x) < 1 here: u < 1 always keeps a draft of probability 1)
    # the exponential race draws from residual
    noise = sampler.exponential_noise(residual[None], [generator])
    return accepted, int((residual[None] / noise).argmax(dim=-1))


def verify_drafts(
    rows, last: list[int], logits: Tensor, result, sampler: Sampler, generator_of, stats
) -> None:
    """Verify every row's drafts after the sampler has drawn each row's token from its last logits.
    rows: the step's sampling rows (ScheduledRequest); last[j]: the index of row j's last logits in
    `logits` (num_logits, vocab). A row that keeps all k drafts keeps its sampled token too;
    otherwise that token is replaced by the one that replaces the first rejected draft. Fills
    result.accepted_drafts and result.sampled_token_ids (one entry per sequence, as the sampler left
    them), and counts into `stats`."""
    # index of the row's token in result.sampled_token_ids (a row about to fork holds n of them)
    seq = 0
    for row, end in zip(rows, last):
        req, drafts = row.request, row.spec_token_ids
        if (
            drafts and result.sampled_token_ids[seq] is not None
        ):  # None: its sampling failed already
            try:
                accepted, token = verify(
                    logits[end - len(drafts) : end], drafts, req.params, sampler, generator_of(req)
                )
            except Exception as e:  # its own settings broke verification: it fails alone
                result.sampled_token_ids[seq], result.errors[req.request_id] = None, e
            else:
                result.accepted_drafts[req.request_id] = drafts[:accepted]
                result.sampled_token_ids[seq] = (
                    result.sampled_token_ids[seq] if token is None else token
                )
                stats.observe(len(drafts), accepted)
        seq += req.num_seqs
