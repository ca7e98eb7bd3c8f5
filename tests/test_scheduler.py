"""Scheduler behaviour, worked out by hand: policies, late arrivals, priority preemption, chunked
prefill, static batching, prefix caching, preemption under memory pressure, and abort.

Conventions used in the derivations (design.md): steps count from 1; a request admitted in step
k whose prompt fits the step produces its first token in step k and, with N output tokens,
finishes in step k + N - 1; a slot freed in step k is refilled in step k + 1. A decode in step k
feeds the newest token, so a request with prompt P feeds position P + k - a - 1 in step k if it
was admitted in step a, and needs ceil((that position + 1) / block_size) blocks.
"""

import pytest

from minicb.config import EngineConfig
from minicb.core.request import Request, RequestStatus
from minicb.core.scheduler import Scheduler
from minicb.sampling_params import SamplingParams
from minicb.sim import SimRequest, simulate


class Run:
    """simulate() plus what a test wants to look at: every Request object and SchedulerOutput."""

    def __init__(self, reqs, config, max_steps=1000, look=None):
        self.reqs, self.outs = {}, []

        def on_step(sched, out):
            self.reqs.update({r.request_id: r for r in sched.requests.values()})
            self.outs.append(out)
            if look is not None:
                look(sched, out)

        self.res = simulate(reqs, config, max_steps=max_steps, on_step=on_step)
        self.trace = self.res.trace

    def timeline(self):
        return [(r.first_token_step, r.finish_step) for r in self.res.requests]

    def rows(self, step):
        return {r.slot: r.request_id for r in self.trace[step - 1].rows}

    def row_shapes(self, step):
        """[(request id, start, num_tokens, is_prefill)] in batch order."""
        return [
            (r.request_id, r.start, r.num_tokens, r.is_prefill) for r in self.trace[step - 1].rows
        ]

    def output_lengths(self):
        return {rid: r.num_output_tokens for rid, r in self.reqs.items()}


def cfg(**kw):
    base = dict(max_num_seqs=4, block_size=16, num_blocks=256, max_num_batched_tokens=256)
    return EngineConfig(**{**base, **kw})


# ---------------------------------------------------------------------------------- policies


def mean_finish(run):
    return sum(f for _, f in run.timeline()) / len(run.res.requests)


def test_sjf_lowers_mean_completion_step():
    # One slot; outputs 10, 2, 3 in arrival order.
    # FIFO: 10 (steps 1-10), then 2 (11-12), then 3 (13-15): mean (10 + 12 + 15) / 3 = 12.33.
    # SJF:  2 (1-2), 3 (3-5), 10 (6-15):                      mean (2 + 5 + 15) / 3 = 7.33.
    reqs = [SimRequest(4, 10), SimRequest(4, 2), SimRequest(4, 3)]
    fcfs, sjf = (
        Run(reqs, cfg(max_num_seqs=1)),
        Run(reqs, cfg(max_num_seqs=1, scheduling_policy="sjf")),
    )
    assert fcfs.timeline() == [(1, 10), (11, 12), (13, 15)]
    assert sjf.timeline() == [(6, 15), (1, 2), (3, 5)]
    assert mean_finish(fcfs) == pytest.approx(37 / 3) and mean_finish(sjf) == pytest.approx(22 / 3)
    assert fcfs.res.num_steps == sjf.res.num_steps == 15  # same work, different order


def test_sjf_breaks_ties_by_arrival():
    reqs = [SimRequest(4, 3), SimRequest(4, 2), SimRequest(4, 2)]
    run = Run(reqs, cfg(max_num_seqs=1, scheduling_policy="sjf"))
    assert run.timeline() == [(5, 7), (1, 2), (3, 4)]


def test_late_arrival_joins_a_running_batch():
    # r0 runs from step 1; r1 arrives in step 3 with a free slot and runs 3-4 beside it.
    run = Run([SimRequest(4, 6), SimRequest(4, 2, arrival_step=3)], cfg())
    assert run.timeline() == [(1, 6), (3, 4)]
    assert run.trace[2].admitted == ["1"] and run.rows(3) == {0: "0", 1: "1"}


def test_fcfs_serves_by_arrival_not_by_input_position():
    # One slot. B and C arrive in step 1, A (listed first) only in step 3. B runs 1-4; in step 5
    # FIFO must take C (waiting since step 1) before A (waiting since step 3): C 5-6, A 7-8.
    reqs = [
        SimRequest(4, 2, arrival_step=3, request_id="A"),
        SimRequest(4, 4, request_id="B"),
        SimRequest(4, 2, request_id="C"),
    ]
    run = Run(reqs, cfg(max_num_seqs=1))
    assert run.timeline() == [(7, 8), (1, 4), (5, 6)]


# ---------------------------------------------------------------------------------- priority
# preemption

# vLLM's rule: the LOWEST priority value is served first.
PRIO = [
    SimRequest(4, 10, priority=5),
    SimRequest(4, 10, priority=5),
    SimRequest(4, 3, arrival_step=3, priority=0),
]


def test_priority_preempts_by_recompute():
    # Two slots, r0 and r1 (priority 5) run from step 1. r2 (priority 0) arrives in step 3 with
    # the slots full: the lowest-ranked running request (r1: same priority as r0, later arrival)
    # is preempted, and r2 takes its slot 1: r2 runs 3-5. r1 held 2 tokens; its slot frees in
    # step 5, so it comes back in step 6 and re-prefills prompt + 2 tokens = 6 tokens (no prefix
    # cache here), samples its 3rd token in step 6 and its 10th in step 13.
    run = Run(
        PRIO,
        cfg(
            max_num_seqs=2, block_size=4, scheduling_policy="priority", enable_prefix_caching=False
        ),
    )
    assert run.timeline() == [(1, 10), (1, 13), (3, 5)]
    assert run.trace[2].preempted == ["1"] and run.trace[2].admitted == ["2"]
    assert run.rows(3) == {0: "0", 1: "2"} and run.rows(5) == {0: "0", 1: "2"}
    assert run.trace[5].admitted == ["1"] and ("1", 0, 6, True) in run.row_shapes(6)
    assert run.res.requests[1].num_preemptions == 1
    assert run.output_lengths() == {"0": 10, "1": 10, "2": 3}


def test_priority_recompute_reuses_the_cached_prompt():
    # The same, with prefix caching: r1's prompt (one full 4-token block) is still cached when it
    # returns, so it recomputes only its 2 generated tokens (positions 4 and 5).
    run = Run(PRIO, cfg(max_num_seqs=2, block_size=4, scheduling_policy="priority"))
    assert run.timeline() == [(1, 10), (1, 13), (3, 5)]
    assert ("1", 4, 2, True) in run.row_shapes(6)


def test_priority_preempts_by_swap():
    # As with recompute, but r1's blocks go to CPU in step 3 and come back in step 6, when r2's
    # slot frees: it resumes with a decode of its newest token (position 5) and ends in step 13.
    run = Run(
        PRIO,
        cfg(max_num_seqs=2, block_size=4, scheduling_policy="priority", preemption_mode="swap"),
    )
    assert run.timeline() == [(1, 10), (1, 13), (3, 5)]
    assert [
        (rec.step, rec.swapped_out, rec.swapped_in)
        for rec in run.trace
        if rec.swapped_out or rec.swapped_in
    ] == [(3, ["1"], []), (6, [], ["1"])]
    assert ("1", 5, 1, False) in run.row_shapes(6)
    assert run.output_lengths() == {"0": 10, "1": 10, "2": 3}


def test_priority_does_not_preempt_an_equal_priority():
    reqs = [
        SimRequest(4, 5, priority=3),
        SimRequest(4, 5, priority=3),
        SimRequest(4, 2, arrival_step=2, priority=3),
    ]
    run = Run(reqs, cfg(max_num_seqs=2, scheduling_policy="priority"))
    assert run.timeline() == [(1, 5), (1, 5), (6, 7)]
    assert all(not rec.preempted and not rec.swapped_out for rec in run.trace)


# ---------------------------------------------------------------------------------- chunked prefill


def test_chunked_prefill_runs_beside_decodes():
    # Budget 32. r0, r1 (4-token prompts, 20 outputs) decode every step from step 2. The 100-token
    # prompt of r2 arrives in step 2 and gets what the two decodes leave: 30, 30, 30, then the last
    # 10 tokens in step 5, which samples its first token; 3 tokens: steps 5-7.
    reqs = [SimRequest(4, 20), SimRequest(4, 20), SimRequest(100, 3, arrival_step=2)]
    run = Run(reqs, cfg(max_num_batched_tokens=32))
    assert run.timeline() == [(1, 20), (1, 20), (5, 7)]
    for step, start, n in [(2, 0, 30), (3, 30, 30), (4, 60, 30), (5, 90, 10)]:
        # decodes first
        assert run.row_shapes(step) == [
            ("0", 3 + step - 1, 1, False),
            ("1", 3 + step - 1, 1, False),
            ("2", start, n, True),
        ]
        assert run.trace[step - 1].num_batched_tokens == 2 + n
    # mid-prompt: no sample
    assert [row.sampled for row in run.trace[3].rows] == [True, True, False]
    assert run.row_shapes(6)[2] == ("2", 100, 1, False)


def test_without_chunked_prefill_a_prompt_runs_whole():
    # Budget 101. Chunked: r2's 100-token prompt takes 93 tokens in step 1 (after 2 x 4) and 7 in
    # step 2: first token in 2, done in 3. Not chunked: it needs 100 tokens in one step, but the two
    # decodes leave only 99 while r0, r1 run (steps 1-5); it runs whole in step 6: steps 6-7.
    reqs = [SimRequest(4, 5), SimRequest(4, 5), SimRequest(100, 2)]
    chunked = Run(reqs, cfg(max_num_batched_tokens=101))
    whole = Run(reqs, cfg(max_num_batched_tokens=101, enable_chunked_prefill=False))
    assert chunked.timeline() == [(1, 5), (1, 5), (2, 3)]
    assert chunked.row_shapes(1)[2] == ("2", 0, 93, True)
    assert whole.timeline() == [(1, 5), (1, 5), (6, 7)]
    assert whole.row_shapes(6) == [("2", 0, 100, True)]
    assert all(n in (1, 4, 100) for rec in whole.trace for n in (r.num_tokens for r in rec.rows))


# ---------------------------------------------------------------------------------- static batching


def test_static_with_fewer_slots_than_requests():
    # Two slots, outputs 3, 5, 2, 2, 4. Static: batch {r0, r1} runs 1-5 (slot 0 idles in 4-5),
    # then {r2, r3} runs 6-7, then {r4} 8-11. Continuous: r2 takes slot 0 in step 4 (4-5),
    # r3 and r4 take both slots in step 6: r3 6-7, r4 6-9.
    reqs = [SimRequest(4, n) for n in (3, 5, 2, 2, 4)]
    static = Run(reqs, cfg(max_num_seqs=2, batching="static"))
    cont = Run(reqs, cfg(max_num_seqs=2))
    assert static.timeline() == [(1, 3), (1, 5), (6, 7), (6, 7), (8, 11)]
    assert static.rows(4) == {1: "1"}
    assert [rec.admitted for rec in static.trace if rec.admitted] == [["0", "1"], ["2", "3"], ["4"]]
    assert cont.timeline() == [(1, 3), (1, 5), (4, 5), (6, 7), (6, 9)]
    assert (static.res.num_steps, cont.res.num_steps) == (11, 9)


def test_static_admits_the_whole_batch_even_when_prompts_wait_for_budget():
    # Budget 8, four 4-token prompts, 2 outputs each: all four join the batch (take a slot) in
    # step 1, but only r0, r1 prefill there. Step 2: 2 decodes + r2 (4) + the first 2 tokens of r3.
    # Step 3: r2 decodes, r3's last 2 prompt tokens. So r0, r1: 1-2; r2: 2-3; r3: 3-4. "Admitted"
    # is the step that first gives a request tokens (design.md), so r2 and r3 count from step 2.
    run = Run(
        [SimRequest(4, 2) for _ in range(4)], cfg(batching="static", max_num_batched_tokens=8)
    )
    assert [rec.admitted for rec in run.trace][:2] == [["0", "1"], ["2", "3"]]
    assert [r.slot for r in run.trace[1].rows] == [0, 1, 2, 3]  # all four held slots from step 1
    assert run.timeline() == [(1, 2), (1, 2), (2, 3), (3, 4)]
    assert run.row_shapes(2) == [
        ("0", 4, 1, False),
        ("1", 4, 1, False),
        ("2", 0, 4, True),
        ("3", 0, 2, True),
    ]


def test_continuous_admits_only_what_gets_tokens():
    # The same four requests with continuous batching: a request takes a slot only in a step that
    # gives it prompt tokens. Step 1: r0, r1 (8 tokens); step 2: 2 decodes + r2 (4) + r3 (2).
    run = Run([SimRequest(4, 2) for _ in range(4)], cfg(max_num_batched_tokens=8))
    assert [rec.admitted for rec in run.trace][:2] == [["0", "1"], ["2", "3"]]
    assert run.timeline() == [(1, 2), (1, 2), (2, 3), (3, 4)]


@pytest.mark.parametrize("policy", ["sjf", "priority"])
def test_static_readmits_a_preempted_member(policy):
    # Static, 5 blocks of 4 tokens, r0 and r1 (prompt 4, 8 outputs) form the batch. As in
    # test_memory_pressure_recompute, r1 is preempted in step 6 and returns in step 9 (r0 ends in
    # step 8): r1 ends in step 11. r2 (2 outputs, arriving in step 2) sorts first under SJF (and
    # under priority, where its lower value ranks first), but is not a member: it must wait for the
    # batch to finish and run 12-13. priorities need scheduling_policy="priority"
    prio = (2, 2, 1) if policy == "priority" else (0, 0, 0)
    reqs = [
        SimRequest(4, 8, priority=prio[0]),
        SimRequest(4, 8, priority=prio[1]),
        SimRequest(4, 2, arrival_step=2, priority=prio[2]),
    ]
    run = Run(
        reqs,
        cfg(
            max_num_seqs=2,
            batching="static",
            scheduling_policy=policy,
            block_size=4,
            num_blocks=5,
            enable_prefix_caching=False,
        ),
        max_steps=100,
    )
    assert run.timeline() == [(1, 8), (1, 11), (12, 13)]


# ---------------------------------------------------------------------------------- prefix caching

PREFIX = list(range(500, 532))  # 32 tokens = two blocks of 16


def test_prefix_cache_shares_two_blocks():
    # A (prefix + 8 own tokens) prefills 40 tokens in step 1; after it, its two full blocks are
    # cached. B (prefix + 8 other tokens) arrives in step 2: it shares blocks 0 and 1 (ref count 2)
    # and computes only its last 8 tokens (positions 32-39) in a third block of its own.
    seen = {}

    def look(sched, out):
        if out.step == 2:
            seen["ref"] = list(sched.block_manager.ref_counts[:4])
            seen["tables"] = {rid: list(t) for rid, t in sched.block_manager.block_tables.items()}

    reqs = [
        SimRequest(40, 5, prompt_token_ids=PREFIX + list(range(8)), request_id="A"),
        SimRequest(
            40, 3, arrival_step=2, prompt_token_ids=PREFIX + list(range(50, 58)), request_id="B"
        ),
    ]
    run = Run(reqs, cfg(), look=look)
    assert seen["tables"] == {"A": [0, 1, 2], "B": [0, 1, 3]}
    assert seen["ref"] == [2, 2, 1, 1]
    assert run.row_shapes(2) == [("A", 40, 1, False), ("B", 32, 8, True)]
    assert run.timeline() == [(1, 5), (2, 4)]  # the shared prefix does not change when tokens come
    assert run.output_lengths() == {"A": 5, "B": 3}


def test_fully_cached_prompt_still_computes_its_last_token():
    # C is exactly the 32-token prefix: both blocks are cached, but the block holding its last
    # token is never taken from the cache (its logits are needed), so C shares block 0 and
    # computes positions 16-31. D is the prefix plus A's 33rd token: it shares both blocks and
    # computes one token, position 32.
    reqs = [
        SimRequest(40, 5, prompt_token_ids=PREFIX + list(range(8)), request_id="A"),
        SimRequest(32, 2, arrival_step=2, prompt_token_ids=PREFIX, request_id="C"),
        SimRequest(33, 2, arrival_step=2, prompt_token_ids=PREFIX + [0], request_id="D"),
    ]
    run = Run(reqs, cfg())
    assert run.row_shapes(2) == [("A", 40, 1, False), ("C", 16, 16, True), ("D", 32, 1, True)]
    assert run.trace[1].block_tables["C"][0] == 0 and run.trace[1].block_tables["D"][:2] == (0, 1)
    assert run.timeline() == [(1, 5), (2, 3), (2, 3)]


def test_prefix_caching_off_computes_everything():
    reqs = [
        SimRequest(40, 5, prompt_token_ids=PREFIX + list(range(8)), request_id="A"),
        SimRequest(
            40, 3, arrival_step=2, prompt_token_ids=PREFIX + list(range(50, 58)), request_id="B"
        ),
    ]
    run = Run(reqs, cfg(enable_prefix_caching=False))
    assert run.row_shapes(2) == [("A", 40, 1, False), ("B", 0, 40, True)]


# ---------------------------------------------------------------------------------- memory pressure


def pressure(mode, **kw):
    # 5 blocks of 4 tokens; A and B: 4-token prompts, 8 outputs (each needs ceil(11 / 4) = 3 blocks
    # at the end, 6 > 5). Step 1: one block each. Decodes in step k feed position k + 2, so both
    # need a second block in step 2 (1 left) and a third in step 6: A (first in FIFO order) takes
    # the last free block, B finds none and, being last in the order, is its own victim.
    reqs = [SimRequest(4, 8, request_id="A"), SimRequest(4, 8, request_id="B")]
    return Run(
        reqs,
        cfg(
            max_num_seqs=2,
            block_size=4,
            num_blocks=5,
            preemption_mode=mode,
            enable_prefix_caching=False,
            **kw,
        ),
    )


def events(run):
    return [
        (rec.step, rec.preempted, rec.swapped_out, rec.swapped_in, rec.admitted)
        for rec in run.trace
        if rec.preempted or rec.swapped_out or rec.swapped_in or rec.admitted
    ]


def test_memory_pressure_recompute():
    # B is preempted in step 6 with 5 tokens generated and its 2 blocks freed. It needs
    # ceil(9 / 4) = 3 blocks to re-prefill its 9 tokens; only 2 are free until A finishes in
    # step 8, so it returns in step 9 (a 9-token prefill that samples its 6th token) and its 8th
    # token comes in step 11.
    run = pressure("recompute")
    assert run.timeline() == [(1, 8), (1, 11)]
    assert events(run) == [
        (1, [], [], [], ["A", "B"]),
        (6, ["B"], [], [], []),
        (9, [], [], [], ["B"]),
    ]
    assert run.row_shapes(6) == [("A", 8, 1, False)]
    assert run.trace[5].num_free_blocks == 2 and run.trace[5].num_waiting == 1
    assert run.row_shapes(9) == [("B", 0, 9, True)]
    assert run.res.requests[1].num_preemptions == 1
    assert run.output_lengths() == {"A": 8, "B": 8}


def test_memory_pressure_swap():
    # With swap space, B's 2 blocks are copied to CPU in step 6 and back in step 9 (3 free blocks
    # are needed: its 2 plus one for position 8), where it resumes with a plain decode.
    run = pressure("swap")
    assert run.timeline() == [(1, 8), (1, 11)]
    assert events(run) == [
        (1, [], [], [], ["A", "B"]),
        (6, [], ["B"], [], []),
        (9, [], [], ["B"], []),
    ]
    assert len(run.outs[5].blocks_to_swap_out) == 2 and run.outs[5].blocks_to_swap_in == []
    assert len(run.outs[8].blocks_to_swap_in) == 2
    assert run.trace[5].num_swapped == 1 and run.trace[8].num_swapped == 0
    assert run.row_shapes(9) == [("B", 8, 1, False)]
    assert run.output_lengths() == {"A": 8, "B": 8}


def test_swap_without_cpu_space_falls_back_to_recompute():
    run = pressure("swap", num_cpu_blocks=0)
    assert events(run) == events(pressure("recompute"))
    assert run.timeline() == [(1, 8), (1, 11)]


# ---------------------------------------------------------------------------------- abort


def new_request(rid, n_prompt=4, max_tokens=6, first=0):
    return Request(
        rid,
        list(range(first, first + n_prompt)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


def step(s):
    out = s.schedule()
    s.update(out, [1] * sum(1 for r in out.scheduled if r.do_sample))
    return out


def drain(s, max_steps=100):
    done = s.take_finished()
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return done
        step(s)
        done += s.take_finished()
    raise AssertionError("did not finish")


def all_free(s):
    bm = s.block_manager
    bm.check_invariants()
    return (
        bm.num_free_blocks == bm.num_blocks
        and bm.num_free_cpu_blocks == bm.num_cpu_blocks
        and not bm.block_tables
        and sorted(s.free_slots) == list(range(s.config.max_num_seqs))
    )


def check_aborted(s, req):
    assert req.status == RequestStatus.FINISHED_ABORTED and req.finish_reason == "abort"
    assert req not in s.waiting + s.running + s.swapped and req.request_id not in s.requests
    assert req.request_id not in s.block_manager.block_tables and req.slot is None
    assert req.request_id not in s.block_manager.cpu_block_tables


def test_abort_waiting():
    s = Scheduler(cfg(max_num_seqs=1, num_blocks=8))
    s.add_request(new_request("a"))
    s.add_request(new_request("b", first=100))
    step(s)
    b = s.abort_request("b")
    check_aborted(s, b)
    assert [r.request_id for r in drain(s)] == ["b", "a"]
    assert all_free(s)


def test_abort_running_frees_its_blocks_and_slot():
    s = Scheduler(cfg(max_num_seqs=1, num_blocks=8))
    s.add_request(new_request("a"))
    s.add_request(new_request("b", first=100))
    step(s)
    a = s.abort_request("a")
    check_aborted(s, a)
    assert s.block_manager.num_free_blocks == 8
    out = step(s)  # b takes the freed slot 0 in the next step
    assert out.admitted == ["b"] and out.scheduled[0].slot == 0
    done = drain(s)
    assert [r.request_id for r in done] == ["a", "b"] and done[1].num_output_tokens == 6
    assert all_free(s)


def test_abort_between_schedule_and_update_drops_the_token():
    s = Scheduler(cfg(max_num_seqs=2, num_blocks=8))
    s.add_request(new_request("a"))
    s.add_request(new_request("b", first=100))
    step(s)
    out = s.schedule()
    a = s.abort_request("a")
    touched = s.update(out, [7, 7])  # a's sampled token is dropped, b's appended
    assert [r.request_id for r in touched] == ["b"] and a.num_output_tokens == 1
    check_aborted(s, a)
    drain(s)
    assert all_free(s)


def test_abort_swapped_frees_cpu_blocks():
    # The memory-pressure setup in swap mode: B is swapped out in step 6 (see above).
    s = Scheduler(
        cfg(
            max_num_seqs=2,
            block_size=4,
            num_blocks=5,
            preemption_mode="swap",
            enable_prefix_caching=False,
        )
    )
    s.add_request(new_request("A", max_tokens=8))
    s.add_request(new_request("B", max_tokens=8, first=100))
    for _ in range(6):
        out = step(s)
    assert out.swapped_out == ["B"] and s.block_manager.num_free_cpu_blocks == 3
    b = s.abort_request("B")
    check_aborted(s, b)
    assert s.block_manager.num_free_cpu_blocks == 5 and not s.swapped
    done = drain(s)
    assert [(r.request_id, r.finish_reason, r.num_output_tokens) for r in done] == [
        ("B", "abort", 5),
        ("A", "length", 8),
    ]
    assert all_free(s)


def test_abort_unknown_or_finished_returns_none():
    s = Scheduler(cfg(num_blocks=8))
    assert s.abort_request("nobody") is None
    s.add_request(new_request("a", max_tokens=1))
    step(s)
    assert s.abort_request("a") is None  # already finished
    assert s.take_finished()[0].finish_reason == "length"


# ---------------------------------------------------------------------------------- readmission
# order


def test_readmitted_decode_row_comes_before_prefills():
    # Block size 1, prefix caching, priority. A0 (3 outputs) and B1 (5 outputs) run from step 1.
    # H2 (priority -1, ahead of 0) arrives in step 2 and preempts B1 (recompute), B1 having 3 tokens
    # of which 2 (its prompt) are cached. H2 and A0 finish in step 3. In step 4, G3 (priority -1) is
    # admitted first (a 3-token prefill), then B1, whose cache hit leaves only its newest token: a
    # decode. Decodes come first in a step's rows, so the batch must read [B1 decode, G3 prefill].
    s = Scheduler(cfg(max_num_seqs=2, block_size=1, num_blocks=64, scheduling_policy="priority"))
    add = lambda rid, prompt, n, prio: s.add_request(
        Request(
            rid,
            prompt,
            SamplingParams(max_tokens=n, ignore_eos=True),
            priority=prio,
            arrival_index=int(rid[-1]),
        )
    )
    add("A0", [1, 2], 3, 0)
    add("B1", [3, 4], 5, 0)
    step(s)
    add("H2", [5, 6, 7], 2, -1)
    assert step(s).preempted == ["B1"]
    step(s)
    add("G3", [8, 9, 10], 2, -1)
    out = step(s)
    assert sorted(out.admitted) == ["B1", "G3"]
    assert [(r.request.request_id, r.start, r.num_tokens, r.is_prefill) for r in out.scheduled] == [
        ("B1", 2, 1, False),
        ("G3", 0, 3, True),
    ]


# ---------------------------------------------------------------------------------- stop conditions


def test_stop_token_finishes_a_request():
    s = Scheduler(cfg(num_blocks=16, max_model_len=8))
    stop = Request("stop", [1, 2, 3], SamplingParams(max_tokens=4, stop_token_ids=[9]))
    cap = Request("cap", [4, 5, 6, 7, 8], SamplingParams(max_tokens=3))  # 5 + 3 = max_model_len
    s.add_request(stop)
    s.add_request(cap)
    step(s)
    out = s.schedule()
    s.update(out, [9, 1])  # stop samples its stop token; cap its second token
    assert (
        stop.finish_reason == "stop" and stop.output_token_ids == [1, 9] and stop.finish_step == 2
    )
    assert stop.request_id not in s.block_manager.block_tables
    drain(s)
    assert cap.finish_reason == "length" and cap.num_output_tokens == 3


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_out_of_blocks_preempts_the_lowest_priority_not_the_newcomer(prefix_caching):
    # A long low-priority request is decoding when a high-priority one arrives mid-way; blocks run
    # short while the newcomer is still prefilling (4-token budget). The victim must be the
    # low-priority request (the policy's last), never the high-priority one, which finishes first.
    config = EngineConfig(
        max_num_seqs=4,
        max_num_batched_tokens=4,
        block_size=4,
        num_blocks=8,
        scheduling_policy="priority",
        enable_prefix_caching=prefix_caching,
    )
    res = simulate([SimRequest(12, 18, 0, priority=5), SimRequest(16, 2, 4, priority=0)], config)
    low, high = res.requests
    assert high.num_preemptions == 0
    assert high.finish_step < low.finish_step


def test_a_request_waiting_for_seats_lets_a_smaller_one_pass_a_bounded_number_of_times():
    """n samples need n seats at once: FCFS would let such a request hold the queue while seats
    sit free. A smaller request behind it takes a free seat; at most max_num_seqs pass it."""
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, num_blocks=4096)
    streams = [SimRequest(8, 40) for _ in range(3)]
    big = SimRequest(8, 5, arrival_step=3, n=6)  # 6 seats; 5 are free
    small = SimRequest(8, 5, arrival_step=4)
    res = simulate(streams + [big, small], config)
    by_id = {r.request_id: r for r in res.requests}
    assert by_id["4"].admitted_step == 4  # it did not wait for the big one
    assert by_id["3"].admitted_step > by_id["4"].finish_step  # the big one waited for 6 seats
    # a stream of small requests passes it at most max_num_seqs times, then it goes in
    smalls = [SimRequest(8, 30, arrival_step=4 + 3 * i) for i in range(40)]
    res = simulate(streams + [big] + smalls, config)
    big_in = res.requests[3].admitted_step
    passed = [r for r in res.requests[4:] if r.admitted_step < big_in]
    assert len(passed) == config.max_num_seqs
    assert big_in is not None
