"""Log-probabilities: the sampled token's and the top alternatives (logprobs), the prompt's
(prompt_logprobs).

They are the log-softmax of the logits after the logits processors (penalties.py) and before
temperature, top-k, top-p and min-p, in float32 or better whatever the model's dtype. With no
processor set that is the model's own distribution, which is what vLLM V1 returns by default
("raw_logprobs"; vLLM V0 returned them after penalties and temperature). The chosen token's entry
and the top entries come from the one tensor, so a greedy token's logprob equals the best entry
exactly (lm-eval's is_greedy compares them with ==).

Prompt log-probabilities come from the forward pass that prefills the prompt: logits at position i
score token i + 1, so every prefill chunk scores its own tokens shifted by one, and a request that
asks for them takes no prefix-cache hits (a cached block saved the K/V, not the logits).
"""

import torch
from torch import Tensor

from ..outputs import Logprob


def logprobs(logits: Tensor) -> Tensor:
    """(n, vocab) log-probabilities, computed in float32 at least (float64 stays float64)."""
    return torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)


def gather_logprobs(
    logprob_rows: Tensor, token_ids: list[int], num_top: list[int]
) -> list[dict[int, Logprob]]:
    """For each row: {token: Logprob} holding the chosen token (the sampled one, or the prompt's
    next token) and the row's `num_top` most likely tokens, each with its rank. logprob_rows (n,
    vocab)."""
    k = max(num_top, default=0)
    top_values, top_ids = logprob_rows.topk(k, dim=-1) if k else (None, None)  # (n, k)
    chosen = torch.tensor(token_ids, dtype=torch.long, device=logprob_rows.device)
    chosen_lp = logprob_rows.gather(1, chosen[:, None])  # (n, 1)
    ranks = (logprob_rows > chosen_lp).sum(dim=-1) + 1  # (n,): 1 + tokens strictly more likely
    result = []
    for i, (token, lp, rank) in enumerate(zip(token_ids, chosen_lp[:, 0].tolist(), ranks.tolist())):
        entry = {token: Logprob(lp, rank)}
        if num_top[i]:
            for r, (t, v) in enumerate(
                zip(top_ids[i, : num_top[i]].tolist(), top_values[i, : num_top[i]].tolist())
            ):
                entry.setdefault(t, Logprob(v, r + 1))
        result.append(entry)
    return result


def prompt_logprob_targets(row) -> range:
    """The prompt tokens that this row's chunk scores now and that have no log-probability yet.
    Logits at position i score token i + 1, so a chunk [start, start + n) scores tokens start + 1 up
    to start + n, within the prompt (its last position scores the first generated token, the
    sample); after a recompute, the tokens scored before are skipped."""
    req = row.request
    if req.prompt_logprobs is None:
        return range(0)
    last = min(row.start + row.num_tokens, req.num_prompt_tokens - 1)
    return range(max(row.start + 1, len(req.prompt_logprobs)), last + 1)


def prompt_logprobs(rows, hidden: Tensor, row_starts: list[int], compute_logits) -> dict[str, list]:
    """{request id: new prompt entries} for the rows whose chunks score prompt tokens this step.
    hidden (num_tokens, hidden) is the step's output; row_starts[i] is row i's first token in it."""
    found = {}
    if all(row.request.prompt_logprobs is None for row in rows):
        return found  # the common case: nothing to do, and no device-to-host copy
    for i, row in enumerate(rows):
        targets, req = prompt_logprob_targets(row), row.request
        if targets:
            # the position that scores targets[0]
            first = row_starts[i] + targets.start - 1 - row.start
            # (len(targets), vocab)
            lp = logprobs(compute_logits(hidden[first : first + len(targets)]))
            found[req.request_id] = gather_logprobs(
                lp,
                req.token_ids[targets.start : targets.stop],
                [req.params.prompt_logprobs] * len(targets),
            )
    return found
