"""Scheduler: iteration-level scheduling, as in Orca (Yu et al., OSDI 2022) and vLLM.

Every step the scheduler decides, from scratch, which requests run and how many tokens each gets.
Finished requests leave at once and waiting ones take their slots in the next step, so the batch
never waits for its longest member (continuous batching). One rule covers prefill, chunked prefill,
decode and recompute: a request is given up to `num_tokens - num_computed_tokens` of its tokens (a
decode also its drafts, with speculative decoding), within a per-step token budget
(`max_num_batched_tokens`). schedule() says in which order; when blocks run out, the request the
policy would serve last is preempted, by recompute (free its blocks, prefill it again later) or by
swap (copy them to CPU). With `batching="static"` the same machinery admits a batch only when the
previous batch has completely finished, which is what static batching costs. With
`max_decode_slowdown` the budget is also one of time (step_cost.py): a prefill chunk gets only the
tokens whose estimated time keeps the step within that many times its decodes' own.
"""

import bisect
import heapq

from ..config import EngineConfig
from .block_manager import BlockManager
from .fairness import VirtualTokenCounter
from .limits import check_request
from .request import Request, RequestStatus
from .scheduler_output import ScheduledRequest, SchedulerOutput
from .step_cost import StepTimer


class Scheduler:
    def __init__(self, config: EngineConfig):
        if config.num_blocks is None:
            raise ValueError(
                "the scheduler needs config.num_blocks (the engine derives it from memory)"
            )
        self.config = config
        self.block_manager = BlockManager(
            config.num_blocks,
            config.block_size,
            config.num_swap_blocks,
            config.enable_prefix_caching,
            config.num_offload_blocks or 0,
            tuple(g.sliding_window for g in config.kv_cache_groups or ()) or (None,),
        )
        self.waiting: list[Request] = []  # kept sorted by policy key
        self.running: list[Request] = []  # in admission order
        self.swapped: list[Request] = []  # kept sorted by policy key
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.free_slots = list(range(config.max_num_seqs))  # a heap: lowest free slot first
        self.static_batch: set[str] = set()  # static mode: members of the batch being served
        self.step_count = 0
        # prompt tokens looked up in, and found in, the prefix cache at first admissions (vLLM V1's
        # PrefixCacheStats): the hit rate a cache-aware router is judged by
        self.prefix_cache_queries = self.prefix_cache_hits = 0
        self.offload_hits = 0  # of those hits, the tokens loaded from the CPU tier
        self.finished: list[Request] = []  # finished or aborted since take_finished()
        # the step being scheduled: its estimated time (None: a token budget only)
        self.timer: StepTimer | None = None
        # scheduling_policy="vtc": the service each tenant has received, in weighted tokens
        self.fairness = VirtualTokenCounter() if config.scheduling_policy == "vtc" else None
        self.policy_key = {  # sort key: the request served first has the smallest key
            "fcfs": lambda r: r.arrival_index,
            "priority": lambda r: (
                r.priority,
                r.arrival_index,
            ),  # the lowest value first, as in vLLM
            "sjf": lambda r: (r.params.max_tokens, r.arrival_index),
            "vtc": lambda r: self.fairness.key(r),  # the least served tenant first (it changes)
        }[config.scheduling_policy]

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, req: Request) -> None:
        """Queue a request, or raise ValueError if it could never run (nothing else changes)."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        check_request(
            self.config, req.num_prompt_tokens, req.params.max_tokens, req.priority, req.num_seqs
        )
        self.requests[req.request_id] = req
        if self.fairness is not None:  # the counter lift (the queues' order stays: it was not in)
            self.fairness.on_arrival(req.user, self.waiting + self.swapped, self.running)
        bisect.insort(self.waiting, req, key=self.policy_key)

    def abort_request(
        self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> Request | None:
        """Remove a request in any state and free all it holds. Returns it, or None if unknown.
        `status`: FINISHED_ABORTED (asked), FINISHED_ERROR (its inputs failed), FINISHED_STOPPED
        (stop string)."""
        if (req := self.requests.get(request_id)) is not None:
            self._finish(req, status)
        return req

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ slots and preemption
    def _has_seats(self, req: Request) -> bool:
        """A slot for each of its sequences? (One that will fork n samples holds 1 and reserves n -
        1.)"""
        return sum(r.num_seqs for r in self.running) + req.num_seqs <= self.config.max_num_seqs

    def _take_slot(self, req: Request) -> None:
        req.status = RequestStatus.RUNNING
        req.slot = heapq.heappop(self.free_slots)
        self.running.append(req)

    def _release_slot(self, req: Request) -> None:
        if req.slot is not None:
            heapq.heappush(self.free_slots, req.slot)
            req.slot = None

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self._release_slot(req)
        req.num_preemptions += 1
        swaps_out = self.config.preemption_mode == "swap" and self.block_manager.can_swap_out(
            req.request_id
        )
        if swaps_out:
            out.blocks_to_swap_out += self.block_manager.swap_out(req.request_id)
            req.status = RequestStatus.SWAPPED
            bisect.insort(self.swapped, req, key=self.policy_key)
            out.swapped_out.append(req.request_id)
        else:  # recompute (also the fallback when the swap space is full)
            self.block_manager.free(req.request_id)
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
            bisect.insort(self.waiting, req, key=self.policy_key)
            out.preempted.append(req.request_id)

    def _lowest_ranked_running(self) -> Request | None:
        """The running request the policy would serve last; among equals, the latest admitted. Not
        one waiting for its step in flight (async scheduling: its forks must land on a running
        request; a request being scheduled is always a candidate). None: no candidate."""
        candidates = [r for r in reversed(self.running) if not r.waits_for_step]
        return max(candidates, key=self.policy_key, default=None)

    def _preempt_for_priority(self, out: SchedulerOutput) -> None:
        """A waiting request that outranks a running one and cannot get in takes its place. Runs
        before anything is scheduled (continuous batching only: a static batch is never broken up),
        with step 3's admission test."""
        while self.waiting and self.running:
            best = self.waiting[0]
            victim = self._lowest_ranked_running()
            # a lower value outranks; equals never preempt
            if victim is None or best.priority >= victim.priority:
                return
            hits, _, computed, num_new = self._admission(best, self.config.max_num_batched_tokens)
            fits = self._has_seats(best) and self.block_manager.can_allocate(
                best.request_id, computed + num_new, hits
            )
            if fits:
                return  # it fits without taking anyone's place
            self._preempt(victim, out)

    # ------------------------------------------------------------------ one step
    def _num_new_tokens(self, req: Request, computed: int, budget: int) -> int:
        """Tokens to give `req` this step (0: it must wait for a larger budget)."""
        remaining = req.num_tokens_with_placeholders - computed
        # a decode verifies its drafts if blocks are free
        verifies_drafts = (
            remaining == 1
            and req.spec_token_ids
            and self.block_manager.can_allocate(
                req.request_id, computed + 1 + len(req.spec_token_ids), num_computed=computed
            )
        )
        if verifies_drafts:
            remaining += len(req.spec_token_ids)  # (nobody is preempted for a draft)
        prompt_exceeds_budget = (
            remaining > budget
            and not self.config.enable_chunked_prefill
            and req.num_output_tokens == 0
        )
        if prompt_exceeds_budget:
            return 0  # without chunked prefill a prompt runs whole (a recompute may still be split)
        num_new = min(remaining, budget)
        is_decode = req.num_tokens_with_placeholders - computed == 1 and (
            req.num_output_tokens or req.num_output_placeholders
        )
        if self.timer is not None and not is_decode:
            num_new = self.timer.chunk_that_fits(req, computed, num_new, bool(self.waiting))
        return num_new

    def _row(self, req: Request, num_new: int) -> ScheduledRequest:
        """The row feeding `req` its next `num_new` tokens, counted in the step's estimated time."""
        row = ScheduledRequest.make(req, num_new, self.block_manager.block_tables[req.request_id])
        row.block_ids = self.block_manager.tables[req.request_id]
        if self.timer is not None:
            self.timer.add_row(row)
        return row

    def _admission(self, req: Request, budget: int) -> tuple[list[int], list[int], int, int]:
        """(prefix-cache hits on the device, then in the CPU tier, tokens they cover, tokens to
        compute now) for a waiting request."""
        hits = self.block_manager.find_cached_prefix(req)
        offloaded = self.block_manager.find_offloaded(req, len(hits))
        computed = (len(hits) + len(offloaded)) * self.config.block_size
        return hits, offloaded, computed, self._num_new_tokens(req, computed, budget)

    def _mark_admitted(self, req: Request, out: SchedulerOutput) -> None:
        """Admitted means one thing: holding a slot, the request is given its first tokens (again,
        after a recompute). A static batch's members take their slots together and are admitted
        when they get tokens."""
        out.admitted.append(req.request_id)
        req.admitted_step = req.admitted_step or out.step  # steps count from 1
        if req.num_cached_tokens < 0:  # its first admission: what the cache gave (vLLM V1's count)
            req.num_cached_tokens = req.num_computed_tokens
            self.prefix_cache_queries += req.num_prompt_tokens
            self.prefix_cache_hits += req.num_computed_tokens

    def schedule(self) -> SchedulerOutput:
        """Decide this step's batch: who runs, with how many tokens. Three phases, in this order,
        each taking tokens from the one budget of `max_num_batched_tokens`:
          1. running requests (decodes first, then prompts part-way through), preempting when blocks
             run out;
          2. swapped requests coming back;
          3. waiting requests admitted by policy.
        The batch lists decode rows first, then prefill rows (the model runner relies on it)."""
        self.step_count += 1
        out = SchedulerOutput(step=self.step_count)
        times_steps = self.config.max_decode_slowdown is not None and self.config.step_cost
        if times_steps:
            self.timer = StepTimer(self.config.step_cost, self.config.max_decode_slowdown)
        if self.config.scheduling_policy == "priority" and self.config.batching == "continuous":
            self._preempt_for_priority(out)
        budget = self.config.max_num_batched_tokens
        num_preempted = len(out.preempted) + len(out.swapped_out)  # by priority, just above
        rows, budget = self._schedule_running(out, budget)
        running_fit = len(out.preempted) + len(out.swapped_out) == num_preempted
        if running_fit:  # otherwise blocks ran out, and nobody new comes in
            swapped_rows, budget = self._schedule_swapped(out, budget)
            waiting_rows, budget = self._schedule_waiting(out, budget)
            rows += swapped_rows + waiting_rows
        out.scheduled = [r for r in rows if not r.is_prefill] + [r for r in rows if r.is_prefill]
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        out.blocks_to_copy = self.block_manager.take_copies()
        out.blocks_to_offload, out.blocks_to_load = self.block_manager.take_transfers()
        self._update_after_schedule(out)
        return out

    def _update_after_schedule(self, out: SchedulerOutput) -> None:
        """Nothing: a step's tokens are counted when it has run (update()). AsyncScheduler counts
        them now."""

    def _may_schedule(self, req: Request) -> bool:
        """Every running request may get tokens (AsyncScheduler holds some back for a step)."""
        return True

    def _schedule_running(
        self, out: SchedulerOutput, budget: int
    ) -> tuple[list[ScheduledRequest], int]:
        """Phase 1: give every running request its next tokens, in policy order, decodes first. When
        one needs a block and none is free, the running request the policy ranks last is preempted
        (if it already got a row this step, the row and its tokens are taken back)."""
        bm, rows = self.block_manager, {}
        ranked = sorted(filter(self._may_schedule, self.running), key=self.policy_key)
        left = lambda r: r.num_tokens_with_placeholders - r.num_computed_tokens
        decoding = [r for r in ranked if left(r) == 1]
        prefilling = [r for r in ranked if left(r) > 1]
        if self.timer is not None:  # shortest first: a long prompt's chunks must not starve a short
            prefilling.sort(key=left)
        for req in decoding + prefilling:
            if budget == 0:
                break
            bm.remove_skipped(req.request_id, req.num_computed_tokens)  # out of a window: freed
            num_new = self._num_new_tokens(req, req.num_computed_tokens, budget)
            cannot_schedule = req.status != RequestStatus.RUNNING or num_new == 0
            if cannot_schedule:  # preempted earlier, or it must wait for budget
                continue
            rid, done = req.request_id, req.num_computed_tokens
            has_blocks = bm.covers(rid, done + num_new, done)  # most decodes need no new block
            while not has_blocks and not bm.can_allocate(rid, done + num_new, num_computed=done):
                victim = self._lowest_ranked_running()
                budget += self._take_back(rows, victim)
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                if not has_blocks:
                    bm.allocate(req, done + num_new)
                rows[req.request_id] = self._row(req, num_new)
                if req.admitted_step is None:  # a static batch member given its first tokens
                    self._mark_admitted(req, out)
                budget -= num_new
        return list(rows.values()), budget

    def _take_back(self, rows: dict, victim: Request) -> int:
        """Undo the row a preempted request got earlier in this step, if any: its tokens return to
        the budget."""
        row = rows.pop(victim.request_id, None)
        if row is not None and self.timer is not None:
            self.timer.take_back(row)
        return 0 if row is None else row.num_tokens

    def _schedule_swapped(
        self, out: SchedulerOutput, budget: int
    ) -> tuple[list[ScheduledRequest], int]:
        """Phase 2: swapped requests come back while they fit, unless a waiting request ranks before
        them (a static batch's swapped members always come first: nobody else may join)."""
        c = self.config
        bm = self.block_manager
        rows = []
        while self.swapped:
            req = self.swapped[0]
            has_room = budget > 0 and self._has_seats(req)
            if not has_room:
                break
            waiting_ranks_first = (
                c.batching == "continuous"
                and self.waiting
                and self.policy_key(self.waiting[0]) < self.policy_key(req)
            )
            if waiting_ranks_first:
                break
            num_new = self._num_new_tokens(req, req.num_computed_tokens, budget)
            cannot_swap_in = num_new == 0 or not bm.can_swap_in(
                req.request_id, req.num_computed_tokens + num_new
            )
            if cannot_swap_in:
                break
            self.swapped.pop(0)
            out.blocks_to_swap_in += bm.swap_in(req)
            bm.remove_skipped(req.request_id, req.num_computed_tokens)
            bm.allocate(req, req.num_computed_tokens + num_new)
            self._take_slot(req)
            self._charge_tenants([req], [])
            out.swapped_in.append(req.request_id)
            rows.append(self._row(req, num_new))
            budget -= num_new
        return rows, budget

    def _schedule_waiting(
        self, out: SchedulerOutput, budget: int
    ) -> tuple[list[ScheduledRequest], int]:
        """Phase 3: admit waiting requests in policy order while a slot, the blocks and the budget
        allow. Static batching forms a new batch only when the previous one is done (its members
        take their slots at once and may get their first tokens in later steps); until then only the
        batch's own preempted members come back."""
        c = self.config
        bm = self.block_manager
        rows = []
        forming = self._forming_batch()
        while self.waiting:
            head = self.waiting[0]
            req = self._next_to_admit(forming)
            must_wait = (
                req is None
                or not self._has_seats(req)
                or (
                    self.swapped
                    and (not forming or self.policy_key(self.swapped[0]) < self.policy_key(req))
                )
            )
            if must_wait:
                # a swapped request comes first: it waits for room, and so does everyone behind it
                break
            hits, offloaded, computed, num_new = self._admission(req, budget)
            does_not_fit = (num_new == 0 and c.batching == "continuous") or not bm.can_allocate(
                req.request_id, computed + num_new, hits
            )
            if does_not_fit:
                break
            if req is not head and forming:
                head.num_passed += 1
            self.waiting.remove(req)
            bm.allocate(req, computed + num_new, hits, offloaded)
            if req.num_cached_tokens < 0:  # first admission: tokens the CPU tier gave
                self.offload_hits += len(offloaded) * c.block_size
            req.num_computed_tokens = computed
            self._take_slot(req)
            self._charge_tenants([req], [])  # before the next pick
            if c.batching == "static":
                self.static_batch.add(req.request_id)
            if num_new:  # a recomputed request whose prefix is all cached may need just a decode
                rows.append(self._row(req, num_new))
                self._mark_admitted(req, out)
                budget -= num_new
        return rows, budget

    def _next_to_admit(self, forming: bool) -> Request | None:
        """The waiting request to admit next: the policy's first, except that a request waiting
        for seats (n samples need n at once) lets one needing fewer pass it, so that it does not
        stop everyone behind it while seats sit free. At most max_num_seqs requests pass it; then
        nobody does until it is in (it cannot wait forever)."""
        if not forming:  # static batching: only the batch's own members come back
            return next((r for r in self.waiting if r.request_id in self.static_batch), None)
        head = self.waiting[0]
        may_be_passed = (
            self.config.batching == "continuous"
            and not self._has_seats(head)
            and head.num_passed < self.config.max_num_seqs
        )
        if not may_be_passed:
            return head
        return next((r for r in self.waiting[1:] if self._has_seats(r)), head)

    def _forming_batch(self) -> bool:
        """May new requests join? Always with continuous batching; with static batching only once
        every member of the previous batch has finished (until then its preempted members
        return)."""
        if self.config.batching == "continuous":
            return True
        self.static_batch &= self.requests.keys()
        return not self.static_batch

    # ------------------------------------------------------------------ after the model ran
    def update(
        self,
        out: SchedulerOutput,
        sampled_token_ids: list[int],
        accepted_drafts: dict[str, list[int]] | None = None,
    ) -> list[Request]:
        """Advance every scheduled request. `sampled_token_ids` holds one token for each row with
        `do_sample`, in row order (n for a request that forks now: its own, then its forks').
        `accepted_drafts`: the drafts each verifying row kept, which come before its sampled token.
        Returns the requests that received tokens."""
        samples = iter(sampled_token_ids)
        accepted_drafts = accepted_drafts or {}
        touched = []
        for row in out.scheduled:
            req = row.request
            tokens = [next(samples) for _ in range(req.num_seqs if row.do_sample else 0)]
            if req.status.finished:  # aborted after schedule(), or finished by the step before
                continue  # (async: its extra row's tokens and K/V are dropped, its blocks freed)
            # kept: their K/V stays; the rest's is rolled back
            drafts = accepted_drafts.get(req.request_id, [])
            self._count_computed(req, row, len(row.spec_token_ids) - len(drafts))
            # (async: preempted while the step ran, it keeps its tokens; its blocks are gone)
            if req.status == RequestStatus.RUNNING:
                # blocks that held only rejected drafts go back (not a cost every row pays)
                if row.spec_token_ids:
                    self.block_manager.free_tail(req.request_id, req.num_computed_tokens)
                self.block_manager.cache_full_blocks(req)
            # a verifying row's tokens, then forks' one each
            news = [drafts + tokens[:1]] + [[t] for t in tokens[1:]]
            for seq, new in zip([req, *self.fork(req)] if tokens else [], news):
                if seq.is_finished:  # its own sampling failed (the engine stopped it)
                    continue
                stop = seq.append_output_tokens(new)
                touched.append(seq)
                seq.first_token_step = seq.first_token_step or out.step
                if stop is not None:
                    self._finish(seq, stop)
        self._charge_tenants([], touched)
        return touched

    def _charge_tenants(self, admitted: list[Request], sampled: list[Request]) -> None:
        """VTC (fairness.py): charge each tenant the service just given, then rank the queues by the
        counters of now. (The other policies' keys never change: their queues stay sorted.)"""
        if self.fairness is not None:
            self.fairness.charge(admitted, sampled)
            self.waiting.sort(key=self.policy_key)
            self.swapped.sort(key=self.policy_key)

    def _count_computed(self, req: Request, row: ScheduledRequest, rejected: int) -> None:
        """The row's tokens have K/V now, but for `rejected` drafts."""
        req.num_computed_tokens += row.num_tokens - rejected

    def fork(self, parent: Request) -> list[Request]:
        """Its prompt computed, an n-sample request forks: each other sample runs in a slot reserved
        for it, sharing the prompt's blocks (copy-on-write), and is preempted and finished on its
        own from here on."""
        children = parent.forks
        parent.forks = []
        # not one whose first sampling failed
        for child in (c for c in children if not c.is_finished):
            child.token_ids = list(parent.token_ids)
            child.num_computed_tokens = parent.num_computed_tokens
            child.block_hashes = list(parent.block_hashes)
            child.admitted_step, child.num_cached_tokens = parent.admitted_step, 0  # counted once
            self.block_manager.fork(parent.request_id, child.request_id)
            self.requests[child.request_id] = child
            self._take_slot(child)
        return children

    def _finish(self, req: Request, status: RequestStatus) -> None:
        # out of the queue that holds it
        {
            RequestStatus.RUNNING: self.running,
            RequestStatus.WAITING: self.waiting,
            RequestStatus.SWAPPED: self.swapped,
        }[req.status].remove(req)
        req.status = status
        for child in req.forks:  # samples that will never fork finish with their parent
            child.status = status
        req.finish_step = self.step_count
        self._release_slot(req)
        self.block_manager.free(req.request_id)
        del self.requests[req.request_id]
        self.finished.append(req)

    def take_finished(self) -> list[Request]:
        """Requests that finished or were aborted since the last call."""
        finished = self.finished
        self.finished = []
        return finished

    def __repr__(self):
        ids = lambda q: [r.request_id for r in q]
        return (
            f"Scheduler(step={self.step_count}, waiting={ids(self.waiting)}, "
            f"running={ids(self.running)}, swapped={ids(self.swapped)}, "
            f"free_blocks={self.block_manager.num_free_blocks}/{self.config.num_blocks})"
        )
