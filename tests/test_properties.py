"""Property-based tests (hypothesis): the scheduler's books balance after every step, whatever
the workload and configuration.

A stateful machine adds requests (random lengths, priorities, shared prefixes, some invalid),
steps the real Scheduler with a scripted model, and aborts requests in every state, also between
schedule() and update(). Memory is tight (few blocks), so preemption by recompute and by swap
happens often. A shadow KV cache (a token id per slot) follows every write, swap and prefix hit,
so a block handed out twice, a wrong prefix hit or a lost swap shows up as a wrong token.

Deterministic: derandomized, no example database.
"""

import dataclasses

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minicb.config import EngineConfig
from minicb.core.kv_cache_groups import (
    KVCacheGroupSpec,
    blocks_per_request,
    max_live_blocks,
    num_skipped_blocks,
)
from minicb.core.request import Request, RequestStatus
from minicb.core.scheduler import Scheduler
from minicb.sampling_params import SamplingParams
from minicb.sim import SimRequest, simulate

PREFIXES = [(), tuple(range(2, 26)), tuple(range(2, 12)) + tuple(range(60, 74))]  # 0, 24, 24 tokens
SCRIPTED_TOKEN = 1  # what the scripted model samples; never a stop token (ignore_eos, no stop ids)


class ShadowKV:
    """A fake paged KV cache holding token ids: device[block][offset] and cpu[block][offset]."""

    def __init__(self, num_blocks, num_cpu_blocks, block_size, num_offload_blocks=0):
        self.bs = block_size
        self.device = [[None] * block_size for _ in range(num_blocks)]
        self.cpu = [[None] * block_size for _ in range(num_cpu_blocks)]
        self.tier = [[None] * block_size for _ in range(num_offload_blocks)]  # the CPU tier

    def run(self, out):
        """What a model runner does with a SchedulerOutput: the block copies in KVCache.transfer's
        order, then write every row."""
        for dev, slot in out.blocks_to_offload:
            self.tier[slot] = list(self.device[dev])
        for dev, cpu in out.blocks_to_swap_out:
            self.cpu[cpu] = list(self.device[dev])
        for cpu, dev in out.blocks_to_swap_in:
            self.device[dev] = list(self.cpu[cpu])
        for slot, dev in out.blocks_to_load:
            self.device[dev] = list(self.tier[slot])
        for row in out.scheduled:  # into every KV cache group's block (a null block: IndexError)
            for table in row.block_ids or [row.block_table]:
                for p in range(row.start, row.start + row.num_tokens):
                    self.device[table[p // self.bs]][p % self.bs] = row.request.token_ids[p]

    def read(self, table, n, where, first_block=0):
        pool = self.device if where == "device" else self.cpu
        return [pool[table[p // self.bs]][p % self.bs] for p in range(first_block * self.bs, n)]


CONFIG_PARAMS = dict(
    block_size=st.sampled_from([1, 2, 4, 8, 16]),
    blocks_for_tokens=st.integers(16, 64),  # the cache holds this many tokens (rounded up): tight
    # Busy values first: hypothesis leans towards the first choice, and preemption needs many
    # requests running at once with a budget that lets them in.
    max_num_seqs=st.sampled_from([4, 8, 2, 1, 3, 6]),
    budget=st.sampled_from([64, 128, 16, 8, 3, 2, 1]),
    batching=st.sampled_from(["continuous", "static"]),
    policy=st.sampled_from(["fcfs", "sjf", "priority"]),
    mode=st.sampled_from(["recompute", "swap"]),
    chunked=st.booleans(),
    prefix_caching=st.booleans(),
    num_cpu_blocks=st.one_of(st.none(), st.integers(0, 12)),
    max_model_len=st.sampled_from([None, 40]),
    num_offload_blocks=st.sampled_from([0, 0, 1, 3, 12]),  # the prefix cache's CPU tier
    # KV cache groups: one layer each, full attention (None) or a window (the tier takes one group)
    windows=st.sampled_from([(None,), (None, 3), (5,), (None, 1, 2), (None, 8), (2, None)]),
)
# (prefix index, prefix cut, suffix length, max_tokens, priority)
REQUEST_SPEC = st.tuples(
    st.sampled_from(range(len(PREFIXES))),
    st.integers(0, 24),
    st.integers(0, 20),
    st.integers(1, 16),
    st.integers(0, 3),
)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(params=st.fixed_dictionaries(CONFIG_PARAMS))
    def setup(self, params):
        self.configure(**params)

    def configure(
        self,
        block_size,
        blocks_for_tokens,
        max_num_seqs,
        budget,
        batching,
        policy,
        mode,
        chunked,
        prefix_caching,
        num_cpu_blocks,
        max_model_len,
        num_offload_blocks=0,
        windows=(None,),
    ):
        num_blocks = -(-blocks_for_tokens // block_size)
        if windows != (None,):  # the CPU tier keeps one full-attention group's blocks
            num_offload_blocks = 0
        groups = tuple(KVCacheGroupSpec((i,), w) for i, w in enumerate(windows))
        self.config = EngineConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            batching=batching,
            scheduling_policy=policy,
            preemption_mode=mode,
            enable_chunked_prefill=chunked,
            enable_prefix_caching=prefix_caching,
            num_cpu_blocks=num_cpu_blocks,
            max_model_len=max_model_len,
            num_offload_blocks=num_offload_blocks,
            kv_cache_groups=groups,
        )
        self.sched = Scheduler(self.config)
        bm = self.sched.block_manager
        self.kv = ShadowKV(bm.num_blocks, bm.num_cpu_blocks, block_size, num_offload_blocks)
        self.all: dict[str, Request] = {}
        self.aborted: set[str] = set()
        self.next_token = 1000  # unique suffix tokens: no accidental sharing
        self.static_batch: set[str] = set()
        self.steps = 0

    # ------------------------------------------------------------------ rules
    @rule(specs=st.lists(REQUEST_SPEC, min_size=1, max_size=6))
    def add_requests(self, specs):
        for spec in specs:
            self.add_request(*spec)

    def add_request(self, prefix, cut, suffix, max_tokens, priority):
        prompt = list(PREFIXES[prefix][:cut]) + list(
            range(self.next_token, self.next_token + suffix)
        )
        self.next_token += suffix
        rid = f"r{len(self.all)}"
        if self.config.scheduling_policy != "priority" and priority < 3:
            priority = 0  # priorities need scheduling_policy="priority"; a 3 here must be refused
        req = Request(
            rid,
            prompt,
            SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            priority=priority,
            arrival_index=len(self.all),
        )
        c, n = self.config, len(prompt)
        violated = []  # the limits this request breaks: the error must name one of them
        if n == 0:
            violated.append("empty")
        if c.max_model_len is not None and n + max_tokens > c.max_model_len:
            violated.append(f"max_model_len {c.max_model_len}")
        cached, chunk = n + max_tokens - 1, min(n + max_tokens - 1, c.max_num_batched_tokens)
        if blocks_per_request(c.kv_cache_groups, cached, c.block_size, chunk) > c.num_blocks:
            violated.append(f"num_blocks={c.num_blocks}")
        if not c.enable_chunked_prefill and n > c.max_num_batched_tokens:
            violated.append(f"max_num_batched_tokens is {c.max_num_batched_tokens}")
        if priority != 0 and c.scheduling_policy != "priority":
            violated.append("scheduling_policy")
        before = self.snapshot()
        try:
            self.sched.add_request(req)
        except ValueError as e:
            assert violated and any(v in str(e) for v in violated), (str(e), violated)
            assert self.snapshot() == before, "a refused request changed the scheduler"
            return
        assert not violated, f"accepted a request that breaks {violated}"
        self.all[rid] = req

    @precondition(lambda self: self.sched.requests)
    @rule(data=st.data())
    def add_duplicate(self, data):
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        before = self.snapshot()
        try:
            self.sched.add_request(Request(rid, [5, 6], SamplingParams(max_tokens=1)))
        except ValueError as e:
            assert "already in use" in str(e)
        else:
            raise AssertionError("duplicate id accepted")
        assert self.snapshot() == before

    @rule(times=st.integers(1, 6), abort_index=st.sampled_from([None, None, None, 0, 1, 2, 3]))
    def step(self, times, abort_index):
        """`times` steps; with an abort_index, the first step aborts a request between schedule()
        and update(), as a client disconnecting while the model runs would."""
        for i in range(times):
            self.one_step(abort_index=abort_index if i == 0 and self.sched.requests else None)
            self.books_balance()

    @precondition(lambda self: self.sched.requests)
    @rule(index=st.integers(0, 1000), really=st.sampled_from([False, False, True]))
    def abort(self, index, really):
        """Abort a request in whatever state it is (waiting, running or swapped); one draw in
        three, so that enough requests live long enough to be preempted."""
        if really:
            ids = sorted(self.sched.requests)
            self.do_abort(ids[index % len(ids)])

    # ------------------------------------------------------------------ one step
    def do_abort(self, rid):
        req = self.sched.abort_request(rid)
        assert req is self.all[rid] and req.status == RequestStatus.FINISHED_ABORTED
        self.aborted.add(rid)
        assert self.sched.abort_request(rid) is None  # twice: nothing left to abort

    def one_step(self, abort_index):
        s = self.sched
        batch_done = all(self.all[r].is_finished for r in self.static_batch)
        out = s.schedule()
        self.steps += 1
        assert out.step == self.steps == s.step_count
        self.check_output(out, batch_done)
        for name in ("preempted", "swapped_out", "swapped_in"):
            if getattr(out, name):
                # shown by --hypothesis-show-statistics: the machine reaches these paths
                event(name)
        if any(
            r.is_prefill
            and r.start > 0
            and r.request.num_output_tokens == 0
            and r.request.admitted_step == out.step
            for r in out.scheduled
        ):
            event("prefix hit")
        self.kv.run(out)
        if abort_index is not None:
            ids = sorted(s.requests)
            self.do_abort(ids[abort_index % len(ids)])
        sampled = [SCRIPTED_TOKEN] * sum(1 for r in out.scheduled if r.do_sample)
        touched = s.update(out, sampled)
        assert all(r.request_id not in self.aborted for r in touched)
        for req in touched:
            assert (
                req.output_token_ids[-1] == SCRIPTED_TOKEN
                and req.num_output_tokens <= req.params.max_tokens
            )
        s.take_finished()

    def check_output(self, out, batch_done):
        c, bm = self.config, self.sched.block_manager
        rows = out.scheduled
        assert out.num_batched_tokens == sum(r.num_tokens for r in rows) <= c.max_num_batched_tokens
        assert len(rows) <= c.max_num_seqs
        slots = [r.slot for r in rows]
        assert len(set(slots)) == len(slots) and all(0 <= x < c.max_num_seqs for x in slots)
        assert len({r.request.request_id for r in rows}) == len(rows)
        kinds = [r.is_prefill for r in rows]
        assert kinds == sorted(kinds), "a decode row after a prefill row"
        for r in rows:
            req = r.request
            assert req.status == RequestStatus.RUNNING and r.slot == req.slot
            assert r.start == req.num_computed_tokens and r.num_tokens >= 1
            assert r.start + r.num_tokens <= req.num_tokens
            assert r.do_sample == (r.start + r.num_tokens == req.num_tokens)
            if not r.is_prefill:
                assert r.num_tokens == 1 and r.do_sample and req.num_output_tokens > 0
            assert r.block_table is bm.block_tables[req.request_id]
            assert len(r.block_table) * c.block_size >= r.start + r.num_tokens
            if not c.enable_chunked_prefill and req.num_output_tokens == 0:
                assert r.do_sample, "without chunked prefill a prompt must run whole"
        for rid in out.preempted:  # back in the queue, from scratch (unless readmitted at once)
            req = self.all[rid]
            assert rid in out.admitted or (
                req.status == RequestStatus.WAITING and req.num_computed_tokens == 0
            )
        for rid in out.swapped_out:
            # may come back
            assert self.all[rid].status in (RequestStatus.SWAPPED, RequestStatus.RUNNING)
        if c.batching == "static":
            new = [rid for rid in out.admitted if rid not in self.static_batch]
            if new:
                assert batch_done, (
                    f"static batch admitted {new} before {self.static_batch} finished"
                )
                # the batch is everyone who took a slot now (some get their first tokens later)
                self.static_batch = {r.request_id for r in self.sched.running}
            live = {r.request_id for r in self.sched.running + self.sched.swapped}
            assert live <= self.static_batch

    # ------------------------------------------------------------------ invariants
    def snapshot(self):
        s, bm = self.sched, self.sched.block_manager
        return (
            [r.request_id for r in s.waiting],
            [r.request_id for r in s.running],
            [r.request_id for r in s.swapped],
            sorted(s.requests),
            list(bm.free_queue),
            {k: list(v) for k, v in bm.block_tables.items()},
            list(bm.ref_counts),
        )

    @invariant()
    def books_balance(self):
        if not hasattr(self, "sched"):
            return
        s, c, bm = self.sched, self.config, self.sched.block_manager
        bm.check_invariants()
        # The same facts, checked here independently of check_invariants.
        owners = [0] * bm.num_blocks
        for tables in bm.tables.values():
            for b in (b for table in tables for b in table if b != bm.null_block):
                owners[b] += 1
        assert owners == bm.ref_counts
        assert set(bm.free_queue) == {b for b in range(bm.num_blocks) if owners[b] == 0}
        assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
        assert set(bm.block_tables) == {r.request_id for r in s.running}
        assert set(bm.cpu_block_tables) == {r.request_id for r in s.swapped}
        assert (
            bm.num_free_cpu_blocks + sum(map(len, bm.cpu_block_tables.values()))
            == bm.num_cpu_blocks
        )
        # Queues: each unfinished request in exactly one, with the matching status.
        queues = {
            RequestStatus.WAITING: s.waiting,
            RequestStatus.RUNNING: s.running,
            RequestStatus.SWAPPED: s.swapped,
        }
        in_queues = [r.request_id for q in queues.values() for r in q]
        assert sorted(in_queues) == sorted(s.requests)
        for status, q in queues.items():
            assert all(r.status == status for r in q)
        assert len(s.running) <= c.max_num_seqs
        slots = [r.slot for r in s.running]
        assert None not in slots and len(set(slots)) == len(slots)
        assert sorted(slots + list(s.free_slots)) == list(range(c.max_num_seqs))
        for req in s.waiting:
            assert req.slot is None and req.num_computed_tokens == 0
        # Contents: every computed token sits where the block table says, and prefix hits are right.
        # In a window's group, from the first block the next query may see.
        for req in s.running:
            n = req.num_computed_tokens
            assert n < req.num_tokens  # the newest token is never cached yet
            for window, table in zip(bm.windows, bm.tables[req.request_id]):
                first = sum(b == bm.null_block for b in table)
                # nothing the next query may see is freed (blocks out of the window go when the
                # request is next scheduled)
                assert first <= num_skipped_blocks(window, n, c.block_size)
                if window is not None:  # vLLM's bound, q at most the budget
                    live = len(table) - first
                    assert live <= max_live_blocks(window, c.max_num_batched_tokens, c.block_size)
                assert (
                    self.kv.read(table, n, "device", first)
                    == req.token_ids[first * c.block_size : n]
                )
        for req in s.swapped:
            flat = iter(bm.cpu_block_tables[req.request_id])
            for nulls in bm.swapped_nulls[req.request_id]:
                table = [None if null else next(flat) for null in nulls]
                first = sum(nulls)
                assert (
                    self.kv.read(table, req.num_computed_tokens, "cpu", first)
                    == req.token_ids[first * c.block_size : req.num_computed_tokens]
                )
        # Every cached block (used or free) still holds the tokens its hash names.
        named = {
            h: req.token_ids[i * c.block_size : (i + 1) * c.block_size]
            for req in self.all.values()
            for i, h in enumerate(req.block_hashes)
        }
        for h, b in bm.cached.items():  # (group, hash) past group 0
            assert self.kv.device[b] == named[h[1] if isinstance(h, tuple) else h], (
                f"cached block {b} holds other tokens than its hash names"
            )
        if bm.tier is not None:  # and every block the CPU tier keeps, in its slot
            for h, slot in bm.tier.lru.items():
                assert self.kv.tier[slot] == named[h], f"tier slot {slot} holds other tokens"
        for req in self.all.values():
            assert req.num_output_tokens <= req.params.max_tokens
            if req.is_finished and req.request_id not in self.aborted:
                assert (
                    req.finish_reason == "length" and req.num_output_tokens == req.params.max_tokens
                )

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        s, c = self.sched, self.config
        bound = 50 + 4 * sum(r.num_prompt_tokens + r.params.max_tokens for r in self.all.values())
        for _ in range(bound):
            if not s.has_unfinished_requests():
                break
            self.one_step(abort_index=None)
            self.books_balance()
        assert not s.has_unfinished_requests(), f"not finished after {bound} steps: {s!r}"
        bm = s.block_manager
        assert (
            bm.num_free_blocks == bm.num_blocks and not bm.block_tables and not bm.cpu_block_tables
        )
        assert sorted(s.free_slots) == list(range(c.max_num_seqs))
        for rid, req in self.all.items():
            if rid in self.aborted:
                assert req.finish_reason == "abort"
                continue
            n = req.params.max_tokens
            assert req.num_output_tokens == n and req.finish_reason == "length"
            assert (
                req.first_token_step is not None and req.finish_step >= req.first_token_step + n - 1
            )
            if req.num_preemptions == 0 and c.max_num_batched_tokens >= c.max_num_seqs:
                # every running decode fits each step: N tokens take exactly N steps
                assert req.finish_step == req.first_token_step + n - 1, req


SchedulerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSchedulerMachine = SchedulerMachine.TestCase


# ---------------------------------------------------------------------------------- block size


@st.composite
def workloads(draw):
    n = draw(st.integers(1, 10))
    reqs = []
    for i in range(n):
        prefix = PREFIXES[draw(st.integers(0, len(PREFIXES) - 1))][: draw(st.integers(0, 24))]
        suffix = draw(st.integers(0 if prefix else 1, 16))
        prompt = list(prefix) + [5000 + 100 * i + j for j in range(suffix)]
        reqs.append(
            SimRequest(
                len(prompt),
                draw(st.integers(1, 20)),
                arrival_step=draw(st.integers(0, 12)),
                priority=draw(st.integers(0, 3)),
                prompt_token_ids=prompt,
            )
        )
    return reqs


@settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    reqs=workloads(),
    policy=st.sampled_from(["fcfs", "sjf", "priority"]),
    batching=st.sampled_from(["continuous", "static"]),
    mode=st.sampled_from(["recompute", "swap"]),
    chunked=st.booleans(),
    max_num_seqs=st.integers(1, 5),
    budget=st.sampled_from([4, 8, 16, 40, 64]),
)
def test_timing_does_not_depend_on_block_size(
    reqs, policy, batching, mode, chunked, max_num_seqs, budget
):
    """With ample memory (no preemption for blocks) and no prefix cache, block size is invisible:
    who runs in which step, with how many tokens, and when each request gets its tokens."""
    if not chunked:
        budget = max(budget, max(r.prompt_len for r in reqs))  # whole prompts must fit a step
    if policy != "priority":  # priorities are refused under the other policies
        reqs = [dataclasses.replace(r, priority=0) for r in reqs]
    results = []
    for block_size in (1, 4, 16):
        config = EngineConfig(
            block_size=block_size,
            num_blocks=4096,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            batching=batching,
            scheduling_policy=policy,
            preemption_mode=mode,
            enable_chunked_prefill=chunked,
            enable_prefix_caching=False,
        )
        res = simulate(reqs, config, max_steps=5000)
        sampled = {}
        for rec in res.trace:
            for row in rec.rows:
                sampled[row.request_id] = sampled.get(row.request_id, 0) + row.sampled
        assert [sampled[r.request_id] for r in res.requests] == [r.output_len for r in reqs]
        results.append(
            (
                res.num_steps,
                [(r.first_token_step, r.finish_step, r.num_preemptions) for r in res.requests],
                [
                    [(row.request_id, row.slot, row.start, row.num_tokens) for row in rec.rows]
                    for rec in res.trace
                ],
            )
        )
    assert results[0] == results[1] == results[2]


# ---------------------------------------------------------------------------------- dense workloads


def spec_tokens(spec):
    prefix, cut, suffix, max_tokens, _ = spec
    return len(PREFIXES[prefix][:cut]) + suffix, max_tokens


@settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    params=st.fixed_dictionaries(CONFIG_PARAMS),
    arrivals=st.lists(st.tuples(st.integers(1, 8), REQUEST_SPEC), min_size=8, max_size=24),
    pressure=st.floats(0.1, 1.0),
    aborts=st.lists(st.tuples(st.integers(1, 30), st.integers(0, 100), st.booleans()), max_size=3),
)
def test_dense_workload_keeps_the_books(params, arrivals, pressure, aborts):
    """The machine's checks on a whole workload at once: many requests arriving over the first
    steps into a cache that holds only `pressure` of what they need together (but each one
    alone), so that preemption and swapping are the rule, not the exception.
    `aborts`: (step, which request, between schedule and update?)."""
    # empty prompts: machine test
    arrivals = [(a, spec) for a, spec in arrivals if spec_tokens(spec)[0] > 0]
    if params["policy"] != "priority":  # refused priorities are the machine test's business too
        arrivals = [(a, spec[:4] + (0,)) for a, spec in arrivals]
    if not arrivals:
        return
    bs = params["block_size"]
    if not params["chunked"]:  # whole prompts must fit one step
        params["budget"] = max(params["budget"], max(spec_tokens(spec)[0] for _, spec in arrivals))
    groups = [KVCacheGroupSpec((i,), w) for i, w in enumerate(params["windows"])]
    needs = [
        blocks_per_request(groups, n + m - 1, bs, min(n + m - 1, params["budget"]))
        for n, m in map(spec_tokens, (spec for _, spec in arrivals))
    ]
    num_blocks = max(max(needs), int(pressure * sum(needs)))
    params = {**params, "blocks_for_tokens": num_blocks * bs, "max_model_len": None}
    m = SchedulerMachine()
    m.configure(**params)
    last_arrival = max(a for a, _ in arrivals)
    step = 0
    while step < last_arrival or m.sched.has_unfinished_requests():
        step += 1
        assert step < 5000, "no progress"
        for arrival, spec in arrivals:
            if arrival == step:
                m.add_request(*spec)
        middle = None
        for when, index, in_the_middle in aborts:
            if when == step and m.sched.requests:
                if in_the_middle:
                    middle = index
                else:
                    m.do_abort(sorted(m.sched.requests)[index % len(m.sched.requests)])
        m.one_step(abort_index=middle if m.sched.requests else None)
        m.books_balance()
    assert len(m.all) == len(arrivals)  # every request was valid and accepted
    m.teardown()
