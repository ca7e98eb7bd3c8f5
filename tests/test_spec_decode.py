"""Speculative decoding: vLLM's config, the prompt-lookup proposer, the rejection rule, and the
engine with drafts.

Exactness against transformers with speculation on is in test_parity.py (its "spec_*" configurations
and the preemption test). Here: an oracle proposer that knows the true continuation and spoils some
of its drafts, so that acceptance, rejection, rollback and stopping inside accepted drafts all
happen where the test says.
"""

import math
import random

import pytest
import torch
from reference import add_word_tokenizer
from test_sampler import LOGITS6, assert_matches, expected_distribution

from minicb import LLM, SamplingParams
from minicb.config import EngineConfig
from minicb.core.block_manager import hash_block
from minicb.core.request import Request
from minicb.core.scheduler import Scheduler
from minicb.model_executor.loader import load_model, save_tiny_model
from minicb.sample.rejection_sampler import verify
from minicb.sample.sampler import Sampler
from minicb.spec_decode.ngram_proposer import NgramProposer, SpecDecodingStats, SpeculativeConfig

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
rng = random.Random(3)
PROMPTS = [[rng.randrange(6, 128) for _ in range(n)] for n in (5, 12, 3, 20)]
MAX_TOKENS = [30, 17, 25, 9]


# ----------------------------------------------------------------------------------------------
# config
def test_config_takes_vllms_dict_and_defaults():
    assert EngineConfig(speculative_config=SPEC).speculative_config == SpeculativeConfig(
        "ngram", 4, 3, 3
    )
    assert (
        SpeculativeConfig.of(
            {"num_speculative_tokens": 2, "prompt_lookup_min": 2}
        ).prompt_lookup_max
        == 2
    )
    both = SpeculativeConfig.of({"num_speculative_tokens": 2})
    # vLLM's defaults when neither is given
    assert (both.prompt_lookup_min, both.prompt_lookup_max) == (5, 5)
    assert EngineConfig().speculative_config is None  # off by default


@pytest.mark.parametrize(
    "bad,message",
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method 'eagle' is not supported"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer, got 0"),
        (
            {"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            r"prompt_lookup_min \(4\) must be at most",
        ),
        (
            {"num_speculative_tokens": 2, "model": "x"},
            r"unknown speculative_config keys \['model'\]",
        ),
        ("ngram", "must be a dict"),
    ],
)
def test_config_errors_name_the_problem(bad, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=bad)


# ----------------------------------------------------------------------------------------------
# proposer
def brute_force(tokens, k, lo, hi, max_drafts):
    """The proposer's definition, searched in full: the longest suffix n in [lo, hi] that occurs
    earlier; the tokens after its latest earlier occurrence, continued by copying (a copy may read
    its own output)."""
    num = min(k, max_drafts)
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        ends = [e for e in range(n, len(tokens)) if tokens[e - n : e] == tokens[len(tokens) - n :]]
        if ends and num > 0:
            seq = list(tokens)
            for i in range(num):
                seq.append(seq[ends[-1] + i])
            return seq[len(tokens) :]
    return []


def test_proposer_equals_a_full_search_as_the_context_grows():
    r = random.Random(0)
    for trial in range(30):
        lo = r.randint(1, 3)
        config = SpeculativeConfig(
            num_speculative_tokens=r.randint(1, 5),
            prompt_lookup_min=lo,
            prompt_lookup_max=lo + r.randint(0, 2),
        )
        proposer, tokens = NgramProposer(config), [r.randrange(4) for _ in range(r.randint(1, 6))]
        for _ in range(40):  # the index grows with the tokens, as a request's does between steps
            max_drafts = r.randint(0, 6)
            assert proposer.propose("a", tokens, max_drafts) == brute_force(
                tokens,
                config.num_speculative_tokens,
                config.prompt_lookup_min,
                config.prompt_lookup_max,
                max_drafts,
            )
            tokens += [r.randrange(4) for _ in range(r.randint(1, 3))]


def test_proposer_examples():
    p = NgramProposer(
        SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)
    )
    assert p.propose("a", [1, 2, 3, 9, 9, 7, 3, 1, 2, 3], 10) == [9, 9, 7, 3]  # "1 2 3" seen before
    # "1": the copy runs into its own output
    assert p.propose("b", [5, 1, 6, 2, 1], 10) == [6, 2, 1, 6]
    assert p.propose("c", [7, 7, 7], 2) == [7, 7]  # max_drafts caps k
    assert p.propose("d", [1, 2, 3], 10) == []  # nothing recurs
    p.forget("a")
    assert "a" not in p.index


# ---------------------------------------------------------------------------------------------- the
# rule
def test_greedy_verification_keeps_drafts_while_they_are_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 1.0, 5.0]])  # argmax 1, 0, 2
    params = SamplingParams(temperature=0.0)
    # all kept: the sampler draws the next
    assert verify(logits, [1, 0, 2], params, Sampler()) == (3, None)
    # the second is wrong: the model's 0 instead
    assert verify(logits, [1, 2, 2], params, Sampler()) == (1, 0)
    assert verify(logits, [0, 0, 2], params, Sampler()) == (0, 1)


@pytest.mark.parametrize(
    "draft", [0, 2, 5]
)  # the most likely token, a middling one, one top-k removes
def test_sampled_verification_keeps_the_distribution(draft):
    """Keep the draft x with probability p(x), else draw from p without x: the token is distributed
    as p."""
    params = SamplingParams(temperature=0.8, top_k=5)
    expected = expected_distribution(LOGITS6, temperature=0.8, top_k=5)
    sampler, generator, n = Sampler(), torch.Generator().manual_seed(1), 6000
    logits = torch.tensor([LOGITS6], dtype=torch.float64)
    tokens, kept = [], 0
    for _ in range(n):
        accepted, token = verify(logits, [draft], params, sampler, generator)
        tokens.append(draft if accepted else token)
        kept += accepted
    assert_matches(torch.tensor(tokens), expected, len(LOGITS6))
    p = expected[draft]
    # accepted with probability p(x)
    assert abs(kept / n - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1e-12


def test_stats_count_drafts_and_positions():
    stats = SpecDecodingStats()
    stats.observe(4, 2)
    stats.observe(3, 3)
    stats.observe(2, 0)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 9, 5)
    assert stats.accepted_per_position == [2, 2, 1, 0]
    assert stats.acceptance_rate == 5 / 9 and stats.mean_acceptance_length == 1 + 5 / 3


# ---------------------------------------------------------------------------------------------- the
# engine
@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama", seed=1)
    return load_model(add_word_tokenizer(path), dtype=torch.float64)


class Oracle:
    """A proposer that knows each prompt's true greedy continuation and spoils draft `spoil(call)`
    of each proposal (None: all correct). It records how many drafts of each proposal the engine
    must accept."""

    def __init__(self, truth: dict[tuple, list[int]], k: int, spoil):
        self.truth, self.k, self.spoil, self.calls = truth, k, spoil, 0
        # (request id, row start) -> drafts its verification must keep
        self.expected: dict[tuple, int] = {}

    def propose(self, request_id, tokens, max_drafts):
        full = next(list(p) + t for p, t in self.truth.items() if list(p) == tokens[: len(p)])
        drafts = full[len(tokens) : len(tokens) + min(self.k, max_drafts)]
        bad, self.calls = self.spoil(self.calls), self.calls + 1
        if bad is not None and bad < len(drafts):
            drafts[bad] = (drafts[bad] + 1) % 128
        self.expected[request_id, len(tokens) - 1] = (
            len(drafts) if bad is None or bad >= len(drafts) else bad
        )
        return drafts

    def forget(self, request_id):
        pass


def generate(
    loaded, prompts=PROMPTS, max_tokens=MAX_TOKENS, oracle_spoil=None, step_check=None, **config
):
    llm = LLM.from_loaded(loaded, dtype="float64", **config)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    if oracle_spoil is not None:
        truth = dict(zip(map(tuple, prompts), generate(loaded, prompts, max_tokens)[0]))
        llm.engine.proposer = Oracle({p: list(t) for p, t in truth.items()}, 4, oracle_spoil)
    eng = llm.engine
    ids = [eng.add_request(p, q) for p, q in zip(prompts, params)]
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o
        if step_check:
            step_check(eng)
    assert eng.scheduler.block_manager.num_used_blocks == 0, "blocks leaked"
    return [outs[i].outputs[0].token_ids for i in ids], eng


def test_oracle_drafts_are_kept_exactly_up_to_the_first_wrong_one(loaded):
    base, base_engine = generate(loaded, block_size=2, num_blocks=200)
    # every kind: all right, wrong first, wrong later
    spoil = lambda call: [None, 0, 2, 1, None, 3][call % 6]
    seen = []

    def check(
        eng,
    ):  # after every step: rejected drafts hold no block, the books balance, the hashes are right
        bm = eng.scheduler.block_manager
        bm.check_invariants()
        assert eng.trace[-1].fragmentation >= 0
        for req in eng.scheduler.running:
            assert len(bm.block_tables[req.request_id]) == bm.blocks_for(req.num_computed_tokens)
            chain = []  # the prefix-cache hash chain of its tokens, computed afresh
            for i in range(len(req.block_hashes)):
                chain.append(
                    hash_block(
                        chain[-1] if chain else None, tuple(req.token_ids[2 * i : 2 * i + 2])
                    )
                )
            assert req.block_hashes == chain and len(chain) <= req.num_computed_tokens // 2
        for r in eng.trace[-1].rows:
            if r.num_drafts:
                assert r.num_accepted == eng.proposer.expected.pop((r.request_id, r.start))
                seen.append((r.num_drafts, r.num_accepted))

    tokens, eng = generate(
        loaded,
        block_size=2,
        num_blocks=200,
        speculative_config=SPEC,
        oracle_spoil=spoil,
        step_check=check,
    )
    assert tokens == base
    assert {a for _, a in seen} == {0, 1, 2, 3, 4} and any(a < d for d, a in seen)
    stats = eng.runner.spec_stats
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (
        sum(d for d, _ in seen),
        sum(a for _, a in seen),
    )
    assert len(eng.trace) < len(base_engine.trace)


def test_perfect_drafts_need_a_fifth_of_the_decode_steps(loaded):
    base, base_engine = generate(loaded, block_size=4, num_blocks=200)
    tokens, eng = generate(
        loaded, block_size=4, num_blocks=200, speculative_config=SPEC, oracle_spoil=lambda c: None
    )
    assert tokens == base
    decode_steps = lambda e: sum(1 for s in e.trace if s.num_decode_rows)
    # the longest request: 1 token from its prefill, then 29 more at up to 5 a step -> 6 decode
    # steps, not 29
    assert decode_steps(base_engine) == 29 and decode_steps(eng) == 6
    assert eng.runner.spec_stats.acceptance_rate == 1.0


@pytest.mark.parametrize(
    "how", ["stop_token", "stop_string", "max_tokens", "stop_string_then_stop_token"]
)
def test_stopping_inside_accepted_drafts_is_like_without(loaded, how):
    """A stop token, a stop string or max_tokens reached in the middle of the drafts a step accepts:
    the output ends exactly where decoding one token at a time ends, and the drafts past it are
    dropped."""
    llm = LLM.from_loaded(loaded, dtype="float64", block_size=4, num_blocks=200)
    free = llm.generate(
        [PROMPTS[0]], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    # the 7th token: inside the second step's drafts (tokens 2..6 come from one verification)
    cut = 6
    word = llm.get_tokenizer().decode([free.token_ids[cut]])
    assert free.token_ids[cut + 2] not in free.token_ids[: cut + 1]
    kw = {
        "stop_token": dict(stop_token_ids=[free.token_ids[cut]]),
        "max_tokens": dict(max_tokens=cut + 1),
        "stop_string": dict(
            stop=[word]
        ),  # and below: a stop token two tokens later, in the same step
        "stop_string_then_stop_token": dict(stop=[word], stop_token_ids=[free.token_ids[cut + 2]]),
    }[how]
    params = SamplingParams(temperature=0, **({"max_tokens": 30} | kw))
    want = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    spec = LLM.from_loaded(
        loaded, dtype="float64", block_size=4, num_blocks=200, speculative_config=SPEC
    )
    spec.engine.proposer = Oracle({tuple(PROMPTS[0]): free.token_ids}, 4, lambda c: None)
    out = spec.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    got = out.outputs[0]
    # one time per token kept, none for dropped drafts
    assert len(out.metrics.token_times) == len(got.token_ids)
    assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
        want.token_ids,
        want.text,
        want.finish_reason,
        want.stop_reason,
    )
    assert len(got.token_ids) <= cut + 1 and any(
        r.num_accepted > 1 for s in spec.engine.trace for r in s.rows
    )
    assert spec.engine.scheduler.block_manager.num_used_blocks == 0


def test_drafts_count_in_the_token_budget(loaded):
    tokens, eng = generate(
        loaded,
        block_size=4,
        num_blocks=200,
        max_num_batched_tokens=6,
        speculative_config=SPEC,
        oracle_spoil=lambda c: None,
    )
    assert tokens == generate(loaded, block_size=4, num_blocks=200)[0]
    assert all(s.num_batched_tokens <= 6 for s in eng.trace)
    assert any(0 < r.num_drafts < 4 for s in eng.trace for r in s.rows), (
        "no draft was trimmed by the budget"
    )


@pytest.mark.parametrize("num_blocks,row_tokens", [(5, [1, 1]), (6, [4, 1])])
def test_drafts_are_dropped_before_anyone_is_preempted(num_blocks, row_tokens):
    """Two decoding requests whose drafts need 2 more blocks each: with 1 free block both drop their
    drafts, with 2 the first keeps them; nobody is preempted for a draft."""
    sched = Scheduler(EngineConfig(block_size=2, num_blocks=num_blocks, max_num_seqs=4))
    reqs = [Request(str(i), [1, 2, 3], SamplingParams(max_tokens=8)) for i in range(2)]
    for r in reqs:
        sched.add_request(r)
    sched.update(sched.schedule(), [7, 7])  # both prompts: 2 blocks each
    for r in reqs:
        r.spec_token_ids = [5, 6, 7]  # 4 tokens fed from position 3: 7 tokens, 4 blocks
    out = sched.schedule()
    assert [r.num_tokens for r in out.scheduled] == row_tokens and not out.preempted
    assert [len(r.spec_token_ids) for r in out.scheduled] == [n - 1 for n in row_tokens]
    # two of three drafts kept
    sched.update(out, [7, 7], {"0": [5, 6]} if row_tokens[0] == 4 else {})
    assert reqs[0].num_tokens == 4 + 1 + (2 if row_tokens[0] == 4 else 0)
    assert reqs[0].num_computed_tokens == reqs[0].num_tokens - 1
    assert len(sched.block_manager.block_tables["0"]) == sched.block_manager.blocks_for(
        reqs[0].num_computed_tokens
    )
    sched.block_manager.check_invariants()


def test_requests_that_cannot_speculate_run_without_drafts(loaded):
    """Penalties and logprobs make a draft position's logits depend on the drafts before it: no
    drafts for them, and the same outputs as an engine without speculation."""
    params = [
        SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.3),
        SamplingParams(max_tokens=12, temperature=0, logprobs=2),
        SamplingParams(max_tokens=12, temperature=0),
    ]
    runs = []
    for spec in (None, SPEC):
        llm = LLM.from_loaded(
            loaded, dtype="float64", block_size=4, num_blocks=200, speculative_config=spec
        )
        if spec:  # one-token lookups: drafts for nearly every step of a request that may have them
            llm.engine.proposer = NgramProposer(
                SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=1)
            )
        outs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
        runs.append(
            [
                (
                    o.outputs[0].token_ids,
                    [
                        {t: (lp.rank, lp.logprob) for t, lp in e.items()}
                        for e in o.outputs[0].logprobs or []
                    ],
                )
                for o in outs
            ]
        )
    assert [t for t, _ in runs[0]] == [t for t, _ in runs[1]]
    for a, b in zip(
        runs[0][1][1], runs[1][1][1]
    ):  # the batch's shapes differ: the last bits may too
        assert a.keys() == b.keys()
        assert all(a[t][0] == b[t][0] and a[t][1] == pytest.approx(b[t][1], abs=1e-12) for t in a)
    drafted = {r.request_id for s in llm.engine.trace for r in s.rows if r.num_drafts}
    assert drafted == {outs[2].request_id}, (
        f"only the plain request may speculate, got drafts for {drafted}"
    )


@pytest.mark.parametrize("backend", ["gather", "flash_pages"])
def test_verification_runs_inside_emulated_cuda_graphs(loaded, backend):
    eager, _ = generate(loaded, block_size=4, num_blocks=200)
    tokens, eng = generate(
        loaded,
        block_size=4,
        num_blocks=200,
        max_model_len=64,
        use_cuda_graph=True,
        speculative_config=SPEC,
        oracle_spoil=lambda c: [None, 1][c % 2],
        attention_backend=backend,
    )
    assert tokens == eager
    graphed = [
        s for s in eng.trace if s.graph_bucket is not None and any(r.num_drafts for r in s.rows)
    ]
    assert graphed, "no verifying step ran in a graph"
    # a verifying row is one graph row of 1 + k tokens, in a uniform verify batch (vLLM V1)
    k = SPEC["num_speculative_tokens"]
    assert all(s.graph_bucket >= len(s.rows) for s in graphed)
    assert all(r.num_tokens == 1 + k for s in graphed for r in s.rows)
    mixed = [
        s
        for s in eng.trace
        if s.rows and not s.num_prefill_rows and len({r.num_tokens for r in s.rows}) > 1
    ]
    assert mixed and all(s.graph_bucket is None for s in mixed), "mixed query lengths run eagerly"


def test_sampling_with_drafts_keeps_the_distribution(loaded):
    """The second token of a sampled request, drawn with and without a draft to verify: the same
    distribution (two samples of 1,200, each token's frequency within 5 standard errors of the
    other's). The draft is the greedy token after the first, so it is kept often, but not always."""
    n, prompt = 1200, PROMPTS[1]
    greedy = LLM.from_loaded(loaded, dtype="float64", block_size=4, num_blocks=200)
    after = lambda first: (
        greedy.generate(
            [prompt + [first]], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
    drafts = {}
    proposer = type(
        "Greedy",
        (),
        {
            "forget": lambda self, rid: None,
            "propose": lambda self, rid, t, m: drafts.setdefault(t[-1], after(t[-1]))[:m],
        },
    )()
    second = []
    for spec in (None, SPEC):
        llm = LLM.from_loaded(
            loaded,
            dtype="float64",
            block_size=4,
            num_blocks=2000,
            max_num_seqs=256,
            max_num_batched_tokens=4096,
            speculative_config=spec,
            seed=7,
        )
        if spec:
            llm.engine.proposer = proposer
        params = SamplingParams(max_tokens=3, temperature=1.0, top_k=3, ignore_eos=True)
        outs = llm.generate([prompt] * n, params, use_tqdm=False)
        second.append(torch.tensor([o.outputs[0].token_ids[1] for o in outs]))
    stats = llm.engine.runner.spec_stats
    # some kept, some not
    assert stats.num_drafts >= n and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    a, b = (torch.bincount(x, minlength=128).double() / n for x in second)
    se = ((a * (1 - a) + b * (1 - b)) / n).sqrt()
    assert ((a - b).abs() <= 5 * se + 1e-9).all(), (a[a > 0], b[b > 0])


def test_the_draft_figures_draw_what_the_trace_says(loaded):
    """draft_slots writes one label per row in view and frames exactly the rows that rejected a
    draft; speculation_runs counts the kept drafts of every verifying row."""
    from matplotlib.patches import Rectangle

    from minicb.viz.speculation import draft_slots, speculation_runs, tokens_yielded

    _, off = generate(loaded, block_size=4, num_blocks=200)
    _, on = generate(
        loaded,
        block_size=4,
        num_blocks=200,
        speculative_config=SPEC,
        oracle_spoil=lambda c: [None, 1][c % 2],
    )
    fig = draft_slots(on.trace, steps=(1, 8))
    ax = fig.axes[0]
    rows = [r for s in on.trace.steps if s.step <= 8 for r in s.rows]
    labels = [t.get_text() for t in ax.texts]
    assert labels == [
        f"{r.request_id}\n+{tokens_yielded(r)}"
        + (f"\n{r.num_accepted}/{r.num_drafts}" if r.num_drafts else "")
        for r in rows
    ]
    frames = [
        p
        for p in ax.patches
        if isinstance(p, Rectangle)
        and p.get_edgecolor()[0] > 0.7
        and p.get_fill() is False
        and p.get_linewidth() > 1
    ]
    assert len(frames) == sum(r.num_accepted < r.num_drafts for r in rows) > 0
    bars = speculation_runs(off.trace, on.trace, k=4).axes[1].patches
    assert [b.get_height() for b in bars] == [
        sum(r.num_accepted == j for s in on.trace for r in s.rows if r.num_drafts) for j in range(5)
    ]
