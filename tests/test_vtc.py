"""scheduling_policy="vtc": the Virtual Token Counter of Sheng et al., "Fairness in Serving Large
Language Models" (OSDI 2024), fair between the tenants that requests' `user` names.

What the paper promises, measured from each run's own trace (reference/fairness.py counts the
weighted tokens the steps served, independently of the scheduler's counters): two tenants
backlogged together get equal shares of the service, whatever their request rates, where first come,
first served gives them shares in proportion to their rates; a tenant back from idle gets no burst
that starves the others (the counter lift). On the engine (a tiny float64 model) the policy changes
who runs when, never a token.
"""

import math

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import invariant
from reference import byte_model
from test_properties import SchedulerMachine

from minicb import LLM, EngineConfig, SamplingParams
from minicb.core.fairness import INPUT_TOKEN_WEIGHT, OUTPUT_TOKEN_WEIGHT, VirtualTokenCounter
from minicb.core.request import Request
from minicb.core.scheduler import Scheduler
from minicb.reference.fairness import served_per_step, tenant_shares
from minicb.sim import SimRequest, simulate


def cfg(**kw):
    base = dict(max_num_seqs=8, block_size=16, num_blocks=512, max_num_batched_tokens=256)
    return EngineConfig(**{**base, **kw})


def flood(every=2, until=60, prompt_len=16, output_len=16):
    """Tenant A sends 4 requests for each 1 of tenant B's, every `every` steps until `until`: both
    arrive faster than 8 slots serve them, so both stay backlogged for a while."""
    reqs = []
    for step in range(1, until + 1, every):
        reqs += [SimRequest(prompt_len, output_len, step, user="A") for _ in range(4)]
        reqs.append(SimRequest(prompt_len, output_len, step, user="B"))
    return reqs


def tenants_of(res) -> dict:
    return {r.request_id: (r.user, r.prompt_len) for r in res.requests}


def backlogged_steps(res, users=("A", "B")) -> range:
    """The steps after which every tenant in `users` still had a request waiting (arrived, not yet
    admitted): the period over which VTC promises equal service."""

    def waits(user, step):
        return any(
            r.user == user and max(r.arrival_step, 1) <= step < r.admitted_step
            for r in res.requests
        )

    both = [s for s in range(1, res.num_steps + 1) if all(waits(u, s) for u in users)]
    assert both == list(range(both[0], both[-1] + 1)), "the tenants were not backlogged throughout"
    return range(both[0], both[-1] + 1)


def share_of(served: dict, user, steps: range) -> float:
    mine = sum(served[user][s - 1] for s in steps)
    return mine / sum(sum(v[s - 1] for s in steps) for v in served.values())


# ---------------------------------------------------------------------------------- the bound


def test_two_backlogged_tenants_get_equal_shares_under_vtc_and_rate_shares_under_fcfs():
    """The issue's measurement: A sends 4x B's requests. Over the steps where both are backlogged,
    B's share of the served weighted tokens is within 20% of an equal share under VTC (0.4 to 0.6,
    at the end of that period and at every step after its first 20), about a fifth under FCFS."""
    shares = {}
    for policy in ("fcfs", "vtc"):
        res = simulate(flood(), cfg(scheduling_policy=policy))
        served = served_per_step(res.trace, tenants_of(res))
        period = backlogged_steps(res)
        running = [share_of(served, "B", range(period[0], s + 1)) for s in period]
        shares[policy] = share_of(served, "B", period)
        print(
            f"{policy}: both backlogged in steps {period[0]}..{period[-1]}; B's share of weighted "
            f"tokens {shares[policy]:.3f} (running share after 20 steps: "
            f"{min(running[20:]):.3f} to {max(running[20:]):.3f})"
        )
        if policy == "vtc":
            assert 0.4 <= shares[policy] <= 0.6
            assert all(0.4 <= s <= 0.6 for s in running[20:]), running
        else:
            assert 0.15 <= shares[policy] <= 0.25  # about a fifth: its rate's share
    assert shares["vtc"] > 2 * shares["fcfs"]


def test_the_quiet_tenant_is_served_sooner_under_vtc():
    """What B sees: its requests' time to first token, in steps, FCFS against VTC."""
    ttft = {}
    for policy in ("fcfs", "vtc"):
        res = simulate(flood(), cfg(scheduling_policy=policy))
        waits = [r.ttft_steps for r in res.requests if r.user == "B"]
        ttft[policy] = sum(waits) / len(waits)
    print(f"B's mean TTFT: fcfs {ttft['fcfs']:.1f} steps, vtc {ttft['vtc']:.1f} steps")
    assert ttft["vtc"] < ttft["fcfs"] / 2


# ---------------------------------------------------------------------------------- counting


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"num_blocks": 14, "preemption_mode": "recompute"},
        {"num_blocks": 14, "preemption_mode": "swap", "num_cpu_blocks": 64},
        {"max_num_batched_tokens": 10},  # prompts chunked over steps
        {"enable_prefix_caching": False},
    ],
    ids=["roomy", "recompute", "swap", "chunked", "no_prefix_cache"],
)
def test_each_token_is_charged_once(config):
    """Both tenants arrive in step 1 (no lift raises a counter above zero), so at the end each
    counter is exactly what its tenant was served: w_p per prompt token and w_q per output token,
    once, even when a preempted request computes its prompt again, when chunks spread it over steps
    or when the prefix cache spares it (on by default); and it is what the trace shows was
    served."""
    shared = list(range(7, 23))  # one prompt prefix for all: the prefix cache hits it
    reqs = [
        SimRequest(
            16 + i % 5,
            6 + i % 7,
            1,
            user="AB"[i % 2],
            prompt_token_ids=shared + [900 + i] * (i % 5),
        )
        for i in range(12)
    ]
    res = simulate(reqs, cfg(max_num_seqs=4, block_size=4, scheduling_policy="vtc", **config))
    if "num_blocks" in config:
        assert any(r.num_preemptions for r in res.requests), "nothing was preempted"
    if not config:
        first_rows = {}
        for record in res.trace:
            for row in record.rows:
                first_rows.setdefault(row.request_id, row)
        assert any(row.start > 0 for row in first_rows.values()), "no prefix cache hit"
    expected = {
        u: sum(
            INPUT_TOKEN_WEIGHT * r.prompt_len + OUTPUT_TOKEN_WEIGHT * r.output_len
            for r in res.requests
            if r.user == u
        )
        for u in "AB"
    }
    served = {u: sum(s) for u, s in served_per_step(res.trace, tenants_of(res)).items()}
    assert res.scheduler.fairness.counters == expected == served


def test_preemption_takes_the_most_served_tenant_first():
    """When blocks run out, the victim is the running request VTC would serve last: its tenant's
    counter is the largest, and among one tenant's requests it arrived last."""
    victims = []

    def look(sched, out):
        for rid in out.preempted:
            victim = next(r for r in sched.waiting if r.request_id == rid)
            victims.append(victim)
            assert all(sched.policy_key(victim) > sched.policy_key(r) for r in sched.running)

    reqs = [SimRequest(8 + 3 * i, 20, 1 + i // 2, user="ABC"[i % 3]) for i in range(12)]
    simulate(reqs, cfg(max_num_seqs=6, num_blocks=10, scheduling_policy="vtc"), on_step=look)
    assert len(victims) >= 3, "too few preemptions to say anything"


# ---------------------------------------------------------------------------------- the lift


def idle_then_burst():
    """A is backlogged from step 1; B is idle until step 150, then sends 12 requests at once."""
    return [SimRequest(16, 16, 1, user="A") for _ in range(60)] + [
        SimRequest(16, 16, 150, user="B") for _ in range(12)
    ]


def burst_shares(res):
    """A's admissions and share of service while B's burst waits (step 150 to B's last
    admission)."""
    last = max(r.admitted_step for r in res.requests if r.user == "B")
    steps = range(150, last + 1)
    a_admitted = sum(r.user == "A" and r.admitted_step in steps for r in res.requests)
    return a_admitted, share_of(served_per_step(res.trace, tenants_of(res)), "A", steps)


def test_a_tenant_back_from_idle_gets_no_burst(monkeypatch):
    """The counter lift: B, idle while A was served, arrives with its counter raised to A's, so
    the two alternate (A keeps about half of the service). Without the lift B's counter would
    still be 0: B would take every admission until its burst was done, and A would starve."""
    config = cfg(max_num_seqs=4, max_num_batched_tokens=64, scheduling_policy="vtc")
    a_admitted, a_share = burst_shares(simulate(idle_then_burst(), config))
    monkeypatch.setattr(VirtualTokenCounter, "on_arrival", lambda self, user, *queues: None)
    unlifted_admitted, unlifted_share = burst_shares(simulate(idle_then_burst(), config))
    print(
        f"during B's burst A was admitted {a_admitted} times, share {a_share:.2f}; "
        f"without the lift: {unlifted_admitted} times, share {unlifted_share:.2f}"
    )
    assert a_admitted >= 6 and 0.4 <= a_share <= 0.6
    assert unlifted_admitted == 0 and unlifted_share < 0.25  # the burst the lift prevents


def steady_then_burst():
    """A sends one request every 4 steps, which 8 slots serve at once (A never waits in the queue);
    B is idle until step 100, then sends 24 requests at once."""
    return [SimRequest(16, 16, 1 + 4 * i, user="A") for i in range(60)] + [
        SimRequest(16, 16, 100, user="B") for _ in range(24)
    ]


def a_waits_during_burst(res) -> list[int]:
    last = max(r.admitted_step for r in res.requests if r.user == "B")
    return [r.ttft_steps for r in res.requests if r.user == "A" and 100 <= r.arrival_step <= last]


def test_a_tenant_back_to_an_empty_queue_is_lifted_too(monkeypatch):
    """When nobody is queued, the paper lifts the newcomer to the counter of the tenant that left
    the queue last. B's burst then shares the slots with A's steady requests, which wait a few
    steps. With the artifact's rule alone (lift only when someone is queued) B would come back
    with the counter it had when it went idle, and A's requests would wait behind its whole
    burst."""
    config = cfg(max_num_seqs=8, max_num_batched_tokens=64, scheduling_policy="vtc")
    lifted = a_waits_during_burst(simulate(steady_then_burst(), config))

    def lift_only_when_queued(self, user, queued, running=()):
        queued_users = {r.user for r in queued}
        if queued_users and user not in queued_users:
            self.counters[user] = max(self.counter(user), min(map(self.counter, queued_users)))

    monkeypatch.setattr(VirtualTokenCounter, "on_arrival", lift_only_when_queued)
    unlifted = a_waits_during_burst(simulate(steady_then_burst(), config))
    print(f"A's TTFT during B's burst: at most {max(lifted)} steps; without it {max(unlifted)}")
    assert max(lifted) <= 12 and max(unlifted) >= 30


def request(rid, user, prompt_len=4, arrival_index=0):
    return Request(
        rid, [5] * prompt_len, SamplingParams(max_tokens=4), user=user, arrival_index=arrival_index
    )


def test_the_lift_by_hand():
    """The paper's rule: a tenant not in the queue is lifted to the smallest counter in it, or,
    with the queue empty, to the counter of the tenant that left it last; never lowered; a tenant
    already queued keeps its counter."""
    vtc = VirtualTokenCounter()
    vtc.counters = {"A": 100.0, "B": 40.0, "C": 70.0}
    queued = [request("a", "A"), request("c", "C")]
    vtc.on_arrival("D", queued)  # new: up to min(100, 70)
    vtc.on_arrival("B", queued)  # idle, behind: up to 70
    vtc.on_arrival("C", queued)  # queued already: unchanged
    assert vtc.counters == {"A": 100.0, "B": 70.0, "C": 70.0, "D": 70.0}
    vtc.counters["E"] = 500.0
    vtc.on_arrival("E", queued)  # ahead: never lowered
    assert vtc.counter("E") == 500.0
    vtc.charge([request("a", "A")], [])  # A's request leaves the queue: A left it last
    vtc.on_arrival("F", [])  # nobody queued: up to the counter of A, the last to leave
    assert vtc.last_left == "A" and vtc.counter("F") == 104.0
    print(vtc)


def test_charges_by_hand():
    """A prompt is charged w_p per token at its first admission only (a recompute or swap-in after
    a preemption is not service again); each sampled token w_q."""
    vtc = VirtualTokenCounter()
    req = request("r", "A", prompt_len=10)
    vtc.charge([req], [])
    assert vtc.counter("A") == 10 * INPUT_TOKEN_WEIGHT
    req.num_preemptions = 1
    vtc.charge([req], [])  # admitted again after a preemption
    req.num_new_tokens = 3  # a decode that kept 2 drafts
    vtc.charge([], [req])
    assert vtc.counter("A") == 10 * INPUT_TOKEN_WEIGHT + 3 * OUTPUT_TOKEN_WEIGHT
    assert vtc.key(req) == (vtc.counter("A"), 0)
    with pytest.raises(ValueError, match="weights must be >= 0"):
        VirtualTokenCounter(input_weight=-1)


def test_vtc_admits_the_least_served_tenant_fcfs_within_it():
    """In one step: each admission charges its prompt before the next pick, so admissions
    alternate between two tenants queued together, each tenant's in arrival order."""
    sched = Scheduler(cfg(max_num_seqs=4, scheduling_policy="vtc"))
    for i, user in enumerate("AAAABB"):
        sched.add_request(request(f"{user}{i}", user, prompt_len=8, arrival_index=i))
    out = sched.schedule()
    assert out.admitted == ["A0", "B4", "A1", "B5"]
    assert sched.fairness.counters == {"A": 16.0, "B": 16.0}


# ---------------------------------------------------------------------------------- other policies


@pytest.mark.parametrize("policy", ["fcfs", "sjf", "priority"])
def test_other_policies_ignore_users(policy):
    reqs = flood(until=10)
    anonymous = [SimRequest(r.prompt_len, r.output_len, r.arrival_step) for r in reqs]
    with_users = simulate(reqs, cfg(scheduling_policy=policy))
    without = simulate(anonymous, cfg(scheduling_policy=policy))
    assert with_users.scheduler.fairness is None
    timeline = lambda res: [(r.admitted_step, r.finish_step) for r in res.requests]
    assert timeline(with_users) == timeline(without)


def test_config_accepts_vtc_and_names_it_in_errors():
    assert EngineConfig(scheduling_policy="vtc").scheduling_policy == "vtc"
    with pytest.raises(ValueError, match="scheduling_policy 'fair'.*'vtc'"):
        EngineConfig(scheduling_policy="fair")


# ---------------------------------------------------------------------------------- tenant_shares


def test_tenant_shares_by_hand():
    """Two requests in step 1 (a prompt of 4 and one of 2, one output token each, then a second
    for the first): A is served 4 + 2 = 6 in step 1 and 2 in step 2, B 2 + 2 = 4 in step 1."""
    res = simulate(
        [SimRequest(4, 2, 1, user="A"), SimRequest(2, 1, 1, user="B")],
        cfg(scheduling_policy="vtc"),
    )
    served = served_per_step(res.trace, tenants_of(res))
    assert served == {"A": [6.0, 2.0], "B": [4.0, 0.0]}
    assert tenant_shares(res.trace, tenants_of(res)) == {"A": [0.6, 8 / 12], "B": [0.4, 4 / 12]}
    assert tenant_shares(res.trace, tenants_of(res), window=1) == {
        "A": [0.6, 1.0],
        "B": [0.4, 0.0],
    }
    raw = served_per_step(res.trace, tenants_of(res), input_weight=1, output_weight=1)
    assert raw == {"A": [5.0, 1.0], "B": [3.0, 0.0]}


def test_tenant_shares_of_idle_steps_forks_and_unknown_requests():
    res = simulate([SimRequest(4, 2, 1, user="A", n=2), SimRequest(4, 1, 6, user="B")], cfg())
    shares = tenant_shares(res.trace, tenants_of(res), window=2)
    assert math.isnan(shares["A"][4])  # steps 4 and 5 served nothing
    served = served_per_step(res.trace, tenants_of(res))
    # the fork "1_0" decodes for A; its first token came from A's row (not seen in the trace)
    assert served["A"][:2] == [4 + 2.0, 2 * 2.0]
    with pytest.raises(ValueError, match="not in `requests`"):
        served_per_step(res.trace, {"0": ("A", 4)})
    with pytest.raises(ValueError, match="window must be at least 1"):
        tenant_shares(res.trace, tenants_of(res), window=0)


# ---------------------------------------------------------------------------------- properties


class VTCMachine(SchedulerMachine):
    """test_properties' scheduler machine under VTC, each request from one of three tenants: the
    books balance after every step, every request finishes, and the queues stay ranked by the
    counters of now (which never go down)."""

    def configure(self, **params):
        super().configure(**{**params, "policy": "vtc"})
        self.seen_counters = {}
        add_request = self.sched.add_request

        def with_a_tenant(req):
            req.user = "ABC"[sum(map(ord, req.request_id)) % 3]
            add_request(req)

        self.sched.add_request = with_a_tenant

    @invariant()
    def queues_ranked_by_counters(self):
        if not hasattr(self, "sched"):
            return
        s = self.sched
        for queue in (s.waiting, s.swapped):
            keys = [s.policy_key(r) for r in queue]
            assert keys == sorted(keys)
        counters = s.fairness.counters
        assert all(counters[u] >= c for u, c in self.seen_counters.items())
        self.seen_counters = dict(counters)


VTCMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestVTCMachine = VTCMachine.TestCase


# ---------------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return byte_model(tmp_path_factory.mktemp("bytes"))


ENGINE = dict(dtype="float64", block_size=4, num_blocks=256, max_num_seqs=4)


def engine_flood():
    """40 prompts, A's four then B's one, eight times over: all queued at once."""
    prompts = [f"tenant {'AAAAB'[i % 5]} asks {i}: " + "xyz"[: i % 3] for i in range(40)]
    users = ["AAAAB"[i % 5] for i in range(40)]
    return prompts, users


def engine_run(loaded, **config):
    llm = LLM.from_loaded(loaded, **{**ENGINE, **config})
    prompts, users = engine_flood()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False, user=users)
    return llm, outs, users


def test_engine_vtc_is_fair_and_changes_no_token(loaded):
    """The two-tenant measurement on the engine (A queues 32 prompts, B 8, all at once): B's
    share while both wait is about a fifth under FCFS and about half under VTC. Greedy outputs are
    the same token for token: the policy changes the order, never the tokens (float64)."""
    results, shares = {}, {}
    runs = {
        "fcfs": dict(scheduling_policy="fcfs"),
        "vtc": dict(scheduling_policy="vtc"),
        "vtc_async": dict(scheduling_policy="vtc", async_scheduling=True),
        # blocks for about 3 of the 4 slots: preemption by recompute, and by swap
        "vtc_recompute": dict(scheduling_policy="vtc", num_blocks=20),
        "vtc_async_swap": dict(
            scheduling_policy="vtc", num_blocks=20, preemption_mode="swap", async_scheduling=True
        ),
    }
    for policy, config in runs.items():
        llm, outs, users = engine_run(loaded, **config)
        trace = llm.engine.trace
        requests = {o.request_id: (u, len(o.prompt_token_ids)) for o, u in zip(outs, users)}
        admitted = {}
        for record in trace:
            for rid in record.admitted:
                admitted.setdefault(rid, record.step)
        last = {u: max(admitted[o.request_id] for o, v in zip(outs, users) if v == u) for u in "AB"}
        period = range(1, min(last.values()))  # both have a prompt waiting after these steps
        shares[policy] = share_of(served_per_step(trace, requests), "B", period)
        results[policy] = [o.outputs[0].token_ids for o in outs]
        if policy.startswith("vtc"):
            served = {u: sum(s) for u, s in served_per_step(trace, requests).items()}
            assert llm.engine.scheduler.fairness.counters == served
        if "num_blocks" in config:
            assert any(r.preempted or r.swapped_out for r in trace), "nothing was preempted"
        assert llm.engine.scheduler.block_manager.num_used_blocks == 0
        llm.engine.shutdown()
        steps = f"steps {period[0]}..{period[-1]}"
        print(f"engine, {policy}: B's share while both wait ({steps}): {shares[policy]:.3f}")
    assert all(tokens == results["fcfs"] for tokens in results.values())
    assert 0.15 <= shares.pop("fcfs") <= 0.25
    assert all(0.4 <= share <= 0.6 for share in shares.values()), shares


def test_generate_takes_one_user_or_one_per_prompt(loaded):
    llm = LLM.from_loaded(loaded, **ENGINE, scheduling_policy="vtc")
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    llm.generate(["a", "b"], params, use_tqdm=False, user="solo")
    assert set(llm.engine.scheduler.fairness.counters) == {"solo"}
    streamed = list(llm.stream(["c"], params, user=["other"]))
    assert streamed[-1].finished
    assert set(llm.engine.scheduler.fairness.counters) == {"solo", "other"}
    with pytest.raises(ValueError, match="got 1 users for 2 prompts"):
        llm.generate(["a", "b"], params, use_tqdm=False, user=["x"])
    with pytest.raises(ValueError, match="user must be a str or None"):
        llm.generate(["a"], params, use_tqdm=False, user=[7])
    assert not llm.engine.has_unfinished_requests()  # a refused call leaves nothing behind
    llm.engine.shutdown()


def test_idle_tenants_are_forgotten_past_a_bound_and_come_back_at_the_floor(monkeypatch):
    """A server's clients may name any number of tenants: past MAX_IDLE_TENANTS idle ones, the
    counters of those at or below the lift's floor go first (nothing changes for them: back, they
    would be lifted to the floor anyway), then the longest known; queued and running tenants and
    the last to leave the queue are kept."""
    import minicb.core.fairness as fairness

    monkeypatch.setattr(fairness, "MAX_IDLE_TENANTS", 8)
    vtc = VirtualTokenCounter()
    queued, running = [request("q", "Q")], [request("r", "R")]
    vtc.counters = {"Q": 50.0, "R": 900.0, "rich": 800.0}
    for i in range(20):  # twenty one-off tenants, each served a little above the floor
        vtc.on_arrival(f"t{i}", queued, running)
        vtc.counters[f"t{i}"] += 10.0
    assert len(vtc.counters) <= 3 + 1 + 8, vtc.counters  # bounded: active + last_left + the bound
    assert {"Q", "R"} <= set(vtc.counters)
    assert "t19" in vtc.counters  # the newest are kept, the oldest forgotten
    forgotten = next(f"t{i}" for i in range(20) if f"t{i}" not in vtc.counters)
    vtc.on_arrival(forgotten, queued, running)
    assert vtc.counter(forgotten) == 50.0  # back at the floor, as a newcomer
    # below the floor goes first: a tenant served less than the floor is forgotten before "rich"
    vtc.counters = {"Q": 50.0, "rich": 800.0, **{f"p{i}": 10.0 for i in range(12)}}
    vtc.on_arrival("new", queued, [])
    assert "rich" in vtc.counters and len(vtc.counters) <= 2 + 1 + 8
