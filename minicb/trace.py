"""Trace: a record of what every step did, so that it can be drawn and checked afterwards.

One StepRecord per step: which request sat in which slot, how many tokens each was given and
whether they were prompt (prefill) or generation (decode) tokens, every running request's block
table, the free/cached block counts, and who was admitted, preempted, swapped or finished.
The simulator and the real engine write the same records, so every figure in the notebooks can be
drawn from either.
"""

from dataclasses import dataclass, field


@dataclass(slots=True)
class RowRecord:
    request_id: str
    slot: int
    start: int  # position of the first token fed this step
    num_tokens: int
    is_prefill: bool
    sampled: bool  # produced a token this step
    # speculative decoding: drafts this row verified (they are among its num_tokens)
    num_drafts: int = 0
    # and how many of them were kept (the row then yields num_accepted + 1 tokens)
    num_accepted: int = 0
    constrained: bool = False  # a grammar masks its tokens (structured outputs)


@dataclass(slots=True)
class StepTimes:
    """When the parts of one step ran, in time.perf_counter() seconds (the real engine only). A step
    is host work before the launch (schedule, input lists), device work (the forward pass, then
    sampling) and host work after (update, detokenization, stop strings, outputs). Synchronous steps
    run them one after another; with async scheduling the next step's host work runs during this
    step's device work, and its sampling waits until this step's outputs are processed."""

    schedule_start: float = 0.0
    launch: float = 0.0  # the inputs are built and handed to the executor (worker/executor.py)
    device_start: float = 0.0  # the forward pass begins (async: once the step before is done)
    forward_end: float = 0.0  # the logits are ready
    sample_start: float = 0.0  # sampling begins (async: after the step before was processed)
    device_end: float = 0.0  # the sampled tokens are on the host
    outputs_start: float = 0.0  # update() and output processing begin
    outputs_end: float = 0.0
    detokenize_s: float = 0.0  # of outputs: text, stop strings and logprobs per token
    # all of the step's work is queued, on either thread (on CUDA the kernels are launched and
    # the tokens' copy to the host started; on a CPU the work is done by then)
    queued: float = 0.0

    @property
    def host_before_s(self) -> float:
        return self.launch - self.schedule_start

    @property
    def device_s(self) -> float:
        return self.device_end - self.device_start

    @property
    def host_after_s(self) -> float:
        return self.outputs_end - self.outputs_start


@dataclass
class StepRecord:
    step: int
    rows: list[RowRecord]  # the batch, decodes first
    block_tables: dict[str, tuple[int, ...]]  # every request holding device blocks this step
    num_free_blocks: int  # after the step (finished requests have given theirs back)
    num_cached_blocks: int  # free blocks still holding a reusable prefix
    num_waiting: int
    num_running: int
    num_swapped: int
    num_batched_tokens: int
    fragmentation: int  # token capacity of the allocated blocks minus tokens stored, over the rows
    admitted: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    swapped_out: list[str] = field(default_factory=list)
    swapped_in: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)  # includes aborted requests
    graph_bucket: int | None = None  # batch bucket of the CUDA graph that ran; None when eager
    graph_width: int | None = None  # and the block-table columns it read (its width bucket)
    duration: float | None = None  # wall-clock seconds of the step (real engine only)
    # when its host and device parts ran (real engine only). With async scheduling a record is
    # written when the step's outputs are processed, after the next step was scheduled: the counts
    # above (free blocks, waiting, running) are read then; its rows' block tables are the step's own
    times: StepTimes | None = None
    # a mixture of experts: per MoE layer, how many of the step's tokens picked each expert (a
    # captured graph's padding rows route too and are counted); None for a dense model
    expert_load: tuple[tuple[int, ...], ...] | None = None
    # with expert parallelism, per MoE layer: [s][d] = (token, expert) pairs that rank s's share of
    # the step sent to rank d's experts (the all-to-all's traffic matrix); None otherwise
    expert_traffic: tuple[tuple[tuple[int, ...], ...], ...] | None = None
    # the prefix cache's CPU tier: blocks copied to it (evicted) and back from it (hits) this step
    blocks_offloaded: int = 0
    blocks_loaded: int = 0

    def tokens_per_rank(self, num_ranks: int) -> tuple[tuple[int, ...], ...] | None:
        """Per MoE layer, the (token, expert) pairs that each rank's experts got this step, with the
        experts placed as expert parallelism places them: E / num_ranks contiguous ones a rank."""
        if self.expert_load is None:
            return None
        per_rank = len(self.expert_load[0]) // num_ranks
        return tuple(
            tuple(sum(layer[r * per_rank : (r + 1) * per_rank]) for r in range(num_ranks))
            for layer in self.expert_load
        )

    @property
    def num_decode_rows(self) -> int:
        return sum(1 for r in self.rows if not r.is_prefill)

    @property
    def num_prefill_rows(self) -> int:
        return sum(1 for r in self.rows if r.is_prefill)

    def __repr__(self):
        rows = " ".join(
            f"[{r.slot}]{r.request_id}:{'P' if r.is_prefill else 'D'}{r.num_tokens}"
            + (f"({r.num_accepted}/{r.num_drafts} kept)" if r.num_drafts else "")
            for r in self.rows
        )
        events = " ".join(
            f"{k}={v}"
            for k, v in (
                ("admit", self.admitted),
                ("preempt", self.preempted),
                ("swap_out", self.swapped_out),
                ("swap_in", self.swapped_in),
                ("finish", self.finished),
            )
            if v
        )
        return (
            f"Step {self.step}: {rows or '(idle)'} | tokens={self.num_batched_tokens} "
            f"free_blocks={self.num_free_blocks} waiting={self.num_waiting} {events}"
        ).rstrip()


class Trace:
    """The list of StepRecords of one engine or simulation run, plus the sizes needed to draw it."""

    def __init__(
        self, max_num_seqs: int, num_blocks: int, block_size: int, max_steps: int | None = None
    ):
        self.max_num_seqs = max_num_seqs
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_steps = max_steps  # keep only the newest records (a long-running server)
        self.steps: list[StepRecord] = []

    def record(
        self,
        scheduler,
        out,
        finished: list,
        graph_bucket: int | None = None,
        duration: float | None = None,
        graph_width: int | None = None,
        accepted_drafts: dict | None = None,
        times: StepTimes | None = None,
        row_tables: dict | None = None,
        expert_load=None,
        expert_traffic=None,
    ) -> StepRecord:
        """Append the record of step `out.step`; call it after `scheduler.update`.
        `accepted_drafts`: {request id: drafts kept} from speculative decoding. `row_tables`:
        {request id: block table} of the rows as they were scheduled (async scheduling: the live
        tables have moved on since). `expert_load`: (moe_layers, num_experts), a mixture of
        experts' tokens per expert this step; `expert_traffic`: its all-to-alls' (ranks, ranks) pair
        counts per layer (expert parallelism)."""
        bm = scheduler.block_manager
        rows, tables, frag = [], {}, 0
        for s in out.scheduled:
            req = s.request
            kept = len((accepted_drafts or {}).get(req.request_id, ()))
            rows.append(
                RowRecord(
                    req.request_id,
                    s.slot,
                    s.start,
                    s.num_tokens,
                    s.is_prefill,
                    s.do_sample,
                    len(s.spec_token_ids),
                    kept,
                    req.params.structured_outputs is not None,
                )
            )
            # rejected drafts' blocks are already given back
            table = s.block_table if row_tables is None else row_tables[req.request_id]
            tables[req.request_id] = tuple(table)
            frag += len(table) * bm.block_size - (
                s.start + s.num_tokens - len(s.spec_token_ids) + kept
            )
        for req in scheduler.running:  # running but given no tokens this step
            if req.request_id not in tables:
                tables[req.request_id] = tuple(bm.block_tables.get(req.request_id, ()))
        rec = StepRecord(
            step=out.step,
            rows=rows,
            block_tables=tables,
            num_free_blocks=bm.num_free_blocks,
            num_cached_blocks=bm.num_cached_free_blocks,
            num_waiting=len(scheduler.waiting),
            num_running=len(scheduler.running),
            num_swapped=len(scheduler.swapped),
            num_batched_tokens=out.num_batched_tokens,
            fragmentation=frag,
            admitted=list(out.admitted),
            preempted=list(out.preempted),
            swapped_out=list(out.swapped_out),
            swapped_in=list(out.swapped_in),
            finished=[r.request_id for r in finished],
            graph_bucket=graph_bucket,
            duration=duration,
            graph_width=graph_width,
            times=times,
            expert_load=None if expert_load is None else tuple(map(tuple, expert_load.tolist())),
            blocks_offloaded=len(getattr(out, "blocks_to_offload", ())),
            blocks_loaded=len(getattr(out, "blocks_to_load", ())),
            expert_traffic=None
            if expert_traffic is None
            else tuple(tuple(map(tuple, layer)) for layer in expert_traffic),
        )
        self.steps.append(rec)
        if self.max_steps is not None and len(self.steps) > self.max_steps:
            del self.steps[0]
        return rec

    def __len__(self):
        return len(self.steps)

    def __getitem__(self, i):
        return self.steps[i]

    def __iter__(self):
        return iter(self.steps)

    def slot_utilization(self) -> float:
        """Busy slot-steps / all slot-steps: how full the batch was on average."""
        if not self.steps:
            return 0.0
        return sum(len(s.rows) for s in self.steps) / (len(self.steps) * self.max_num_seqs)

    def request_ids(self) -> list[str]:
        """Every request that ever ran, in order of first appearance."""
        seen = {}
        for s in self.steps:
            for r in s.rows:
                seen.setdefault(r.request_id, None)
        return list(seen)

    def __repr__(self):
        return (
            f"Trace({len(self.steps)} steps, slots={self.max_num_seqs}, blocks={self.num_blocks}x"
            f"{self.block_size}, slot utilization={self.slot_utilization():.0%})"
        )
