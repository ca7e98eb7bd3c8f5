"""What Scheduler.schedule() hands the model runner: the rows of one step and the block copies.

Plain data (vLLM keeps the same in vllm/v1/core/sched/output.py): the runner turns it into tensors,
the trace records it, and nothing in it changes once the step has been scheduled.
"""

from dataclasses import dataclass, field

from .request import Request

# Async scheduling: a token that a step still in flight is sampling (vLLM also uses -1)
PLACEHOLDER_TOKEN_ID = -1


@dataclass(slots=True)
class ScheduledRequest:
    """One row of the step's batch."""

    request: Request
    start: int  # num_computed_tokens before this step = position of the first token fed
    # tokens fed this step (a prompt chunk; 1 for a decode, 1 + drafts for a verifying decode)
    num_tokens: int
    is_prefill: bool
    do_sample: bool  # this step computes the request's last token, so a new token is sampled
    block_table: list[int]  # the request's live block table (read it during this step only)
    slot: int  # the batch row the request occupies while it runs
    # drafts fed after its newest token, to verify (spec_decode.py; vLLM's name)
    spec_token_ids: list[int] = field(default_factory=list)
    # KV cache groups (kv_cache_groups.py): every group's live table, group 0's first (vLLM's
    # block_ids); empty: one group, block_table
    block_ids: list[list[int]] = field(default_factory=list)

    @classmethod
    def make(cls, req: Request, num_tokens: int, block_table: list[int]) -> "ScheduledRequest":
        """The row that feeds `req` its next `num_tokens` tokens, then as many of its drafts as fit;
        it samples if they reach its end."""
        start, end = req.num_computed_tokens, req.num_tokens_with_placeholders
        drafts = req.spec_token_ids[: max(0, start + num_tokens - end)]
        done = start + num_tokens >= end
        has_output = req.num_output_tokens > 0 or req.num_output_placeholders > 0
        is_decode = done and num_tokens == 1 + len(drafts) and has_output
        return cls(req, start, num_tokens, not is_decode, done, block_table, req.slot, drafts)

    @property
    def token_ids(self) -> list[int]:
        """The tokens fed: its own, PLACEHOLDER_TOKEN_ID for each one a step in flight is sampling
        (async scheduling), then its drafts. Read it when the row is scheduled."""
        known = self.request.token_ids[self.start : self.start + self.num_tokens]
        missing = self.num_tokens - len(self.spec_token_ids) - len(known)
        return known + [PLACEHOLDER_TOKEN_ID] * missing + self.spec_token_ids


@dataclass
class SchedulerOutput:
    """One step's schedule: its rows and who was admitted, preempted or swapped."""

    step: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # decodes first, then prefills
    num_batched_tokens: int = 0
    admitted: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # by recompute
    swapped_out: list[str] = field(default_factory=list)
    swapped_in: list[str] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    # (device, device): copy-on-write
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # the prefix cache's CPU tier: evicted blocks kept (device, slot), hits loaded (slot, device)
    blocks_to_offload: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_load: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_decode_rows(self) -> int:
        """Rows that feed one generated token (not the attention metadata's num_decodes, which
        counts the leading decode rows of 1, or 1 + k, tokens, a last prompt token included)."""
        return sum(1 for s in self.scheduled if not s.is_prefill)
