"""Speculative decoding with a prompt-lookup (n-gram) proposer: several tokens per decode step,
exactly.

A decode step feeds one token per request and reads all the weights to produce one token. When the
text ahead is easy to guess, a request can instead feed its newest token plus k guessed ones (the
"drafts") as one decode row of 1 + k queries that reads its paged cache once (vLLM V1's uniform
decode; model_executor/attention.py). The model then scores all k + 1 positions in the one forward
pass, and the drafts are checked in order (rejection_sampler.py): every draft that the model would
have produced itself is kept, and the first that it would not is replaced by the model's own
token. A step thus yields between 1 and k + 1
tokens for the price of reading the weights once, and the output is exactly what decoding one token
at a time would give: greedy decoding gives the same tokens, sampling gives the same distribution
(Leviathan et al., 2023, "Fast Inference from Transformers via Speculative Decoding"; Chen et al.,
2023).

Proposer: prompt lookup (Saxena, 2023; vLLM's method "ngram"). No second model: a request's last n
tokens are looked up earlier in its own prompt and output, and the k tokens that followed them there
are the drafts. It costs almost nothing and pays off where outputs copy their inputs (rewriting,
quoting, editing code, summaries with quotes) and where a model repeats itself.

The scheduler counts the drafts in the token budget and in block allocation, and drops them before
it would preempt anyone for them; after the step, the KV of rejected drafts is rolled back
(num_computed_tokens, and blocks that emptied are freed; scheduler.update). This module is pure
Python: the configuration, the proposer, who may speculate, and the counters that metrics report.
"""

from dataclasses import dataclass, field

# vLLM keeps it with the configs too (vllm/config/speculative.py)
from ..config import SpeculativeConfig


def can_speculate(req) -> bool:
    """May this request verify drafts? Not when the logits of a draft position would depend on the
    drafts before it (min_tokens, penalties, logit_bias), nor when it asked for per-token
    log-probabilities (the verified positions would need their own), nor before its n samples have
    forked, nor when a grammar constrains it (each draft position would need the mask of the
    grammar advanced past the drafts before it, and a rollback of those rejected: minicb refuses
    drafts for constrained rows instead, so their output is the same with drafts on or off)."""
    p = req.params
    return not (
        p.processes_logits
        or p.logprobs is not None
        or p.prompt_logprobs is not None
        or req.forks
        or p.structured_outputs is not None
    )


def propose_drafts(proposer, touched: list, finished: list) -> None:
    """After a step: drafts for every request that got tokens and may speculate, to verify in its
    next decode; a finished request's index is dropped. A draft is never proposed past max_tokens
    (its last token is not fed)."""
    for req in touched:
        if not req.is_finished and can_speculate(req):
            room = req.params.max_tokens - req.num_output_tokens - 1
            req.spec_token_ids = proposer.propose(req.request_id, req.token_ids, room)
    for req in finished:
        proposer.forget(req.request_id)


class NgramProposer:
    """Prompt lookup: the drafts are the tokens that followed the latest earlier occurrence of the
    request's last n tokens, for the largest n in [prompt_lookup_min, prompt_lookup_max] that
    occurs.

    Each request keeps an index {n-gram: the position right after its latest occurrence}, grown by
    the tokens added since the last call, so a proposal costs a few dictionary lookups however long
    the context is. vLLM V1 (vllm/v1/spec_decode/ngram_proposer.py) searches the whole context with
    KMP every step instead, takes the EARLIEST occurrence, and proposes at most the tokens that
    follow it; minicb takes the latest and extends past the context's end as LZ77 does (notebook 16
    compares the two)."""

    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.index: dict[str, dict[tuple, int]] = {}  # request id -> {n-gram: position after it}
        self.indexed: dict[str, int] = {}  # request id -> the context length its index covers

    def propose(self, request_id: str, tokens: list[int], max_drafts: int) -> list[int]:
        """Up to min(k, max_drafts) drafts for a request whose context is `tokens` ([] when nothing
        matches)."""
        index, n_tokens = self.index.setdefault(request_id, {}), len(tokens)
        for end in range(
            self.indexed.get(request_id, 0) + 1, n_tokens
        ):  # n-grams ending before the last token
            for n in range(self.min_n, min(self.max_n, end) + 1):
                # a later occurrence replaces an earlier one
                index[tuple(tokens[end - n : end])] = end
        self.indexed[request_id] = max(self.indexed.get(request_id, 0), n_tokens - 1)
        num = min(self.k, max_drafts)
        for n in range(min(self.max_n, n_tokens - 1), self.min_n - 1, -1) if num > 0 else ():
            after = index.get(tuple(tokens[n_tokens - n :]))
            if (
                after is not None
            ):  # copy what followed; past the end the copy reads its own output, as LZ77
                drafts = tokens[after : after + num]  # does, which continues a loop shorter than k
                while len(drafts) < num:
                    drafts.append(drafts[after + len(drafts) - n_tokens])
                return drafts
        return []

    def forget(self, request_id: str) -> None:
        self.index.pop(request_id, None)
        self.indexed.pop(request_id, None)


@dataclass
class SpecDecodingStats:
    """What speculation achieved (vLLM's counters): drafts proposed and verified, tokens
    accepted."""

    num_drafts: int = 0  # rows that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [j]: drafts accepted at position j
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """One verified row: `num_drafts` drafts of which the first `num_accepted` were accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        self.accepted_per_position += [0] * (num_drafts - len(self.accepted_per_position))
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / verified drafts (0.0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying row yields on average: its accepted drafts plus the model's own
        token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def __str__(self):
        return (
            f"speculative decoding: {self.num_drafts} rows verified {self.num_draft_tokens} "
            f"drafts, {self.num_accepted_tokens} accepted ({self.acceptance_rate:.0%}), "
            f"{self.mean_acceptance_length:.2f} tokens per verifying row"
        )
