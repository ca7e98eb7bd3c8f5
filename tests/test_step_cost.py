"""A step's time, not only its tokens: StepCost's arithmetic, the scheduler's time target
(max_decode_slowdown) on the simulator, and the calibration on a real engine. Schedules are checked
with given StepCosts (the same on every machine); the calibration is checked for what it must do,
never for the numbers it measures."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minicb import Engine, EngineConfig
from minicb.config import StepCost
from minicb.core.request import Request
from minicb.core.scheduler import Scheduler
from minicb.core.step_cost import StepTimer
from minicb.engine.step_cost import calibrate_step_cost
from minicb.model_executor.loader import load_model, save_tiny_model
from minicb.sampling_params import SamplingParams
from minicb.sim import SimRequest, scripted_step, simulate

# seconds chosen to be exact in binary: the estimates below are compared with ==
COST = StepCost(step_s=0.0625, token_s=0.001953125, context_token_s=2**-18, logits_row_s=2**-10)


def estimate(rec, cost: StepCost, with_logits=frozenset()) -> tuple[float, float]:
    """(the decodes' estimate, the whole step's) for one trace record."""
    decode_s = cost.step_s
    other_s = 0.0
    for r in rec.rows:
        logits = r.num_tokens if r.request_id in with_logits and r.is_prefill else 0
        seconds = cost.row_s(r.num_tokens, r.start, logits)
        if r.is_prefill:
            other_s += seconds
        else:
            decode_s += seconds
    return decode_s, decode_s + other_s


def test_step_cost_is_checked_and_read_from_a_dict():
    assert StepCost.of(None) is None
    assert StepCost.of({**COST.__dict__}) == COST
    with pytest.raises(ValueError, match="token_s must be a number >= 0"):
        StepCost(0.1, -1.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="max_decode_slowdown must be None"):
        EngineConfig(max_decode_slowdown=1)
    assert "ms" in repr(COST)


def test_a_row_costs_its_tokens_the_positions_they_attend_and_its_logits():
    cost = StepCost(step_s=0, token_s=1, context_token_s=1, logits_row_s=1)
    # 3 tokens after 10: they attend to 11, 12 and 13 positions
    assert cost.row_s(3, 10) == 3 + 36
    assert cost.row_s(3, 10, logits_rows=3) == 3 + 36 + 3
    assert cost.row_s(0, 10) == 0
    # and the row reads 13 positions of keys and values, once, whatever its tokens
    reads = StepCost(step_s=0, token_s=0, context_token_s=0, logits_row_s=0, position_s=1)
    assert reads.row_s(3, 10) == 13 and reads.row_s(1, 12) == 13 and reads.row_s(0, 10) == 0
    assert StepCost.of({**COST.__dict__, "position_s": 0.5}).position_s == 0.5


@given(
    st.integers(0, 5000),
    st.integers(1, 512),
    st.integers(0, 1),
    st.floats(1.01, 8),
    st.integers(0, 64),
)
def test_the_chunk_that_fits_is_the_largest_that_fits(context, most, logits, slowdown, decodes):
    timer = StepTimer(COST, slowdown)
    for _ in range(decodes):
        timer.add(COST.row_s(1, 100), is_decode=True)
    fits = timer.tokens_that_fit(most, context, logits)
    row = lambda n: COST.row_s(n, context, n * logits)
    assert 0 <= fits <= most
    assert fits == 0 or row(fits) <= timer.left_s
    assert fits == most or row(fits + 1) > timer.left_s


def long_prompt_beside_decodes(cost, slowdown, prompt_len=3000, budget=256):
    config = EngineConfig(
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        block_size=16,
        num_blocks=4096,
        max_decode_slowdown=slowdown,
        step_cost=cost,
    )
    streams = [SimRequest(8, 200) for _ in range(3)]
    return simulate(streams + [SimRequest(prompt_len, 4, arrival_step=5)], config)


def test_a_long_prompt_is_spread_so_that_every_step_stays_within_its_target():
    res = long_prompt_beside_decodes(COST, 2.5)
    long_rows = [(rec, r) for rec in res.trace.steps for r in rec.rows if r.request_id == "3"]
    checked = 0
    for rec, row in long_rows:
        decode_s, step_s = estimate(rec, COST)
        if row.is_prefill and row.num_tokens > 1:  # one token is always given: progress
            assert step_s <= 2.5 * decode_s
            checked += 1
    chunks = [row.num_tokens for _, row in long_rows if row.is_prefill]
    assert checked > len(chunks) // 2
    assert sum(chunks) == 3000  # every prompt token, once
    # later chunks attend to more context: they get fewer tokens
    assert chunks[0] > chunks[len(chunks) // 2] > chunks[-2]


def test_without_a_time_target_the_token_budget_alone_sizes_chunks():
    res = long_prompt_beside_decodes(None, None)
    chunks = [r.num_tokens for rec in res.trace.steps for r in rec.rows if r.request_id == "3"]
    # 256 - 3 decodes, until the prompt's last chunk
    assert chunks[:5] == [253] * 5
    timed = long_prompt_beside_decodes(COST, 2.5)
    assert timed.num_steps > res.num_steps  # time bought for the others, paid by the long prompt


def test_prompt_logprobs_rows_count_in_the_step_time():
    config = EngineConfig(
        max_num_seqs=4, max_num_batched_tokens=512, num_blocks=1024, block_size=16,
        max_decode_slowdown=2.0, step_cost=COST,
    )  # fmt: skip
    sizes = {}
    for plp in (None, 5):
        sched = Scheduler(config)
        sched.add_request(Request("d", [1] * 8, SamplingParams(max_tokens=50, ignore_eos=True)))
        scripted_step(sched)  # its prompt
        params = SamplingParams(max_tokens=1, prompt_logprobs=plp)
        sched.add_request(Request("p", list(range(2, 400)), params, arrival_index=1))
        out = scripted_step(sched)
        sizes[plp] = next(r.num_tokens for r in out.scheduled if r.request.request_id == "p")
    assert 1 <= sizes[5] < sizes[None]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 600), st.integers(1, 30), st.integers(1, 6)), max_size=10),
    st.floats(1.1, 5),
    st.sampled_from([16, 64, 256]),
)
def test_every_step_keeps_the_budget_and_the_target_or_gives_one_token(reqs, slowdown, budget):
    config = EngineConfig(
        max_num_seqs=4, max_num_batched_tokens=budget, block_size=4, num_blocks=2048,
        max_decode_slowdown=slowdown, step_cost=COST,
    )  # fmt: skip
    res = simulate([SimRequest(p, o, arrival_step=a) for p, o, a in reqs], config)
    for rec in res.trace.steps:
        assert rec.num_batched_tokens <= budget
        decode_s, step_s = estimate(rec, COST)
        chunks = [r.num_tokens for r in rec.rows if r.is_prefill]
        within = step_s <= slowdown * decode_s * (1 + 1e-12)
        assert within or chunks == [1], (rec, decode_s, step_s)
    assert all(r.finish_step is not None for r in res.requests)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama", seed=3)
    return load_model(path, dtype=torch.float64)


def test_the_engine_measures_its_step_cost_and_is_left_as_it_was(loaded):
    base = dict(model=loaded.name, dtype="float64", block_size=4, num_blocks=512)
    engine = Engine(EngineConfig(**base, max_decode_slowdown=2.5), loaded)
    cost = engine.config.step_cost
    assert isinstance(cost, StepCost) and engine.scheduler.config.step_cost == cost
    assert engine.scheduler.step_count == 0 and not engine.trace.steps
    assert not engine.has_unfinished_requests()
    prompt = list(range(3, 60))
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    rid = engine.add_request(prompt, greedy)
    assert rid == "0"  # the calibration's requests took no ids
    timed = Engine(EngineConfig(**base, max_decode_slowdown=1.5, step_cost=COST), loaded)
    plain = Engine(EngineConfig(**base), loaded)
    outputs = []
    for e in (engine, timed, plain):
        if e is not engine:
            e.add_request(prompt, greedy)
        while e.has_unfinished_requests():
            done = [o for o in e.step() if o.finished]
            outputs += [o.outputs[0].token_ids for o in done]
    assert outputs[0] == outputs[1] == outputs[2]  # only the chunks changed, not the tokens


def test_the_calibration_steps_tell_every_number_of_the_model_apart(loaded, monkeypatch):
    """Each of the five numbers must be identifiable from the steps the calibration times: the
    regressors of its distinct steps have full rank, and the short chunks (which alone separate a
    row's cost per position read from its cost per position attended) ran deep in the prompt, on
    its cached prefix, beside nothing else."""
    seen = []
    lstsq = torch.linalg.lstsq

    def spy(x, y):
        seen.append(x.clone())
        return lstsq(x, y)

    monkeypatch.setattr(torch.linalg, "lstsq", spy)
    config = EngineConfig(
        model=loaded.name, dtype="float64", block_size=4, num_blocks=512, max_model_len=256
    )
    engine = Engine(config.replace(enable_prefix_caching=False), loaded)
    cost = calibrate_step_cost(engine)
    (x,) = seen
    assert torch.linalg.matrix_rank(x) == 5 and cost.position_s >= 0
    # (1, tokens, attended, logits rows, positions read): one row each, k tokens at context c
    short = {(int(t), int(r - t)) for _, t, a, lg, r in x.tolist() if t in (1, 16, 64) and lg == 0}
    assert {k for k, _ in short} == {1, 16, 64} and max(c for _, c in short) >= 128
    assert engine.scheduler.config.enable_prefix_caching is False  # the engine's own, restored


def test_a_short_prompt_arriving_beside_a_long_one_is_not_fed_one_token_a_step():
    """The long prompt's chunk comes first in a step; with others waiting it takes only half of
    the time left, so a short newcomer's prompt fits in the other half."""
    config = EngineConfig(
        max_num_seqs=8, max_num_batched_tokens=256, block_size=16, num_blocks=4096,
        max_decode_slowdown=2.5, step_cost=COST,
    )  # fmt: skip
    streams = [SimRequest(8, 300) for _ in range(3)]
    long = SimRequest(6000, 2, arrival_step=3)
    short = SimRequest(40, 4, arrival_step=60)
    res = simulate(streams + [long, short], config)
    long_done = res.requests[3].first_token_step
    short = res.requests[4]
    assert short.first_token_step < long_done  # it did not wait for the long prompt
    assert short.first_token_step - short.arrival_step <= 2  # its 40 tokens in one or two steps
