"""Beam search (vLLM's LLM.beam_search) inside the continuous batch, in float64 on tiny models.

While no beam ends early it returns transformers' generate(num_beams=...) beams, in its order; the
scores are the float64 log-probabilities transformers' own forward pass gives those tokens
(transformers scores its beams in float32, so its own sequences_scores are compared within float32
rounding). With EOS it follows vLLM's ranking, checked against that rule written out below. The
beams are rows that share their blocks: the block manager's books hold after every step, prompt
blocks are shared by every beam, a block being written never is, and a dropped beam's blocks are
free before the next step. Any configuration (preemption, a tiny token budget, swap, static
batching) gives the same beams, and requests beside them the same tokens.
"""

import pytest
import torch
from reference import add_word_tokenizer

from minicb import LLM, BeamSearchParams, SamplingParams
from minicb.engine.beam_search import BeamSearch, get_beam_search_score
from minicb.model_executor.loader import load_model, make_tiny_model, save_tiny_model

PROMPTS = [[5, 9, 17, 33, 2, 8, 44, 71, 12], [100, 3], [7, 7, 7, 64, 90, 31]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(LoadedModel, the same weights in transformers), float64."""
    path = save_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama", seed=3)
    return load_model(path, dtype=torch.float64), make_tiny_model("llama", seed=3)


def make(loaded, **config):
    config = dict(dict(block_size=4, num_blocks=96, max_model_len=64), **config)
    return LLM.from_loaded(loaded, dtype="float64", **config)


def run_checked(llm, prompts, params, after_update=None):
    """LLM.beam_search's loop, checking the block manager's books after every step."""
    search = BeamSearch(llm.engine, params)
    for prompt in prompts:
        search.add(prompt)
    bm = llm.engine.scheduler.block_manager
    while not search.finished:
        llm.engine.step()
        bm.check_invariants()
        before = {rid: list(t) for rid, t in bm.block_tables.items()}
        num_free = bm.num_free_blocks
        search.update()
        bm.check_invariants()
        if after_update is not None:
            after_update(llm.engine, before, num_free)
    while llm.engine.has_unfinished_requests() or llm.engine.scheduler.finished:
        llm.engine.step()  # flush the last rows' outputs
    assert bm.num_used_blocks == 0, "blocks leaked"
    return [search.output(inst) for inst in search.instances]


def teacher_forced(hf, tokens: list[int], num_prompt: int) -> list[float]:
    """transformers' float64 log-probability of each generated token, given those before it."""
    with torch.no_grad():
        logits = hf(torch.tensor([tokens])).logits[0]  # (len, vocab)
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[i - 1, tokens[i]].item() for i in range(num_prompt, len(tokens))]


@pytest.mark.parametrize(
    "width, max_tokens, length_penalty, early_stopping",
    [(2, 7, 1.0, True), (3, 6, 0.5, False), (4, 5, 2.0, "never")],
)
def test_equals_transformers_while_no_beam_ends_early(
    models, width, max_tokens, length_penalty, early_stopping
):
    loaded, hf = models
    params = BeamSearchParams(width, max_tokens, ignore_eos=True, length_penalty=length_penalty)
    outs = make(loaded).beam_search(PROMPTS, params)  # all prompts in one batch
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]),
                num_beams=width,
                num_return_sequences=width,
                do_sample=False,
                max_new_tokens=max_tokens,
                early_stopping=early_stopping,
                length_penalty=length_penalty,
                pad_token_id=0,
                eos_token_id=None,  # no beam ends early
                output_scores=True,
                return_dict_in_generate=True,
            )
        assert [s.tokens for s in out.sequences] == ref.sequences.tolist()
        for seq, hf_score in zip(out.sequences, ref.sequences_scores.tolist()):
            exact = teacher_forced(hf, seq.tokens, len(prompt))
            chosen = [entry[t].logprob for entry, t in zip(seq.logprobs, seq.tokens[len(prompt) :])]
            assert chosen == pytest.approx(exact, abs=1e-9)
            assert seq.cum_logprob == pytest.approx(sum(exact), abs=1e-9)
            # transformers divides by the generated length (vLLM's score by prompt + generated)
            assert seq.cum_logprob / max_tokens**length_penalty == pytest.approx(hf_score, rel=1e-5)
            assert seq.finish_reason == "length" and seq.text is None  # no tokenizer
            assert all(len(entry) >= 2 * width for entry in seq.logprobs)


def vllm_rule(hf, prompt, width, max_tokens, eos, length_penalty):
    """vLLM's beam search written out (vllm/entrypoints/llm.py) on transformers' float64 logits:
    (tokens, cum_logprob, finish_reason) of the best `width`, best first."""
    score = lambda b: get_beam_search_score(b[0], b[1], eos, length_penalty)
    beams, completed = [(list(prompt), 0.0, None)], []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cum, _ in beams:
            with torch.no_grad():
                lp = torch.log_softmax(hf(torch.tensor([tokens])).logits[0, -1], dim=-1)
            top = lp.topk(2 * width)
            for value, token in zip(top.values.tolist(), top.indices.tolist()):
                if token in eos:
                    completed.append((tokens + [token], cum + value, "stop"))
                else:
                    candidates.append((tokens + [token], cum + value, "length"))
        beams = sorted(candidates, key=score, reverse=True)[:width]
    return sorted(completed + beams, key=score, reverse=True)[:width]


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 3.0])
def test_finished_beams_are_ranked_as_vllm_ranks_them(tmp_path, models, length_penalty):
    """An EOS the model proposes (the second likeliest first token of PROMPTS[0]): beams that end
    with it finish at once and are ranked by vLLM's length-normalized score."""
    _, hf = models
    with torch.no_grad():
        eos = hf(torch.tensor([PROMPTS[0]])).logits[0, -1].topk(2).indices[1].item()
    loaded = load_model(save_tiny_model(tmp_path, seed=3, eos_token_id=eos), dtype=torch.float64)
    llm = make(loaded)
    assert llm.engine.eos_token_ids == {eos}
    width, max_tokens = 3, 5
    params = BeamSearchParams(width, max_tokens, length_penalty=length_penalty)
    outs = run_checked(llm, PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        ref = vllm_rule(hf, prompt, width, max_tokens, {eos}, length_penalty)
        assert [(s.tokens, s.finish_reason) for s in out.sequences] == [(r[0], r[2]) for r in ref]
        assert [s.cum_logprob for s in out.sequences] == pytest.approx([r[1] for r in ref], 1e-9)
        for seq in out.sequences:
            assert (seq.stop_reason == eos) == (seq.finish_reason == "stop")
    # the beam that ended after one token ranks among the best, unless the penalty favours length
    has_stop = any(s.finish_reason == "stop" for out in outs for s in out.sequences)
    assert has_stop == (length_penalty <= 1.0)


def num_shared_blocks(rec) -> int:
    """Blocks of a StepRecord held by more than one request (counted once per extra holder)."""
    held = [b for table in rec.block_tables.values() for b in table]
    return len(held) - len(set(held))


def test_beams_share_prompt_blocks_and_dropped_beams_free_theirs_at_once(models):
    loaded, _ = models
    llm = make(loaded)
    width, prompt = 3, PROMPTS[0]  # 9 tokens: 2 full blocks of 4, and 1 token over
    seen = {"shared": 0, "freed": 0}

    def check(engine, before, num_free_before):
        bm = engine.scheduler.block_manager
        rows = [r for r in engine.scheduler.running if r.num_output_tokens > 0]
        if len(rows) == width:  # several beams live: the prompt's full blocks are shared by all
            prompt_blocks = bm.block_tables[rows[0].request_id][:2]
            assert all(bm.block_tables[r.request_id][:2] == prompt_blocks for r in rows)
            assert [bm.ref_counts[b] for b in prompt_blocks] == [width, width]
            seen["shared"] += 1
        # rows the pruning dropped gave back at once the blocks only they held
        dropped = [rid for rid in before if rid not in bm.block_tables]
        held = {b for rid, table in before.items() if rid not in dropped for b in table}
        alone = {b for rid in dropped for b in before[rid] if b not in held}
        assert bm.num_free_blocks == num_free_before + len(alone)
        seen["freed"] += len(alone)

    params = BeamSearchParams(width, 8, ignore_eos=True)
    (out,) = run_checked(llm, [prompt], params, check)
    assert len(out.sequences) == width
    assert seen["shared"] >= 5 and seen["freed"] > 0
    # the trace shows it: blocks held by several beam rows in one step, dropped rows finishing
    steps = llm.engine.trace.steps
    assert sum(num_shared_blocks(s) > 0 for s in steps) >= 5
    assert any(s.finished for s in steps[:-1]), "no beam was dropped before the last step"


def test_copy_on_write_gives_each_beam_its_own_partial_block(models):
    """After the fork every beam writes its first token into the prompt's partly filled block:
    all but the last writer copy it first, so afterwards no two beams share it."""
    loaded, _ = models
    llm = make(loaded)
    search = BeamSearch(llm.engine, BeamSearchParams(3, 4, ignore_eos=True))
    search.add(PROMPTS[0])  # 9 tokens: the third block holds 1
    bm = llm.engine.scheduler.block_manager
    llm.engine.step()  # the prefill; the two reserved seats fork and share all three blocks
    search.update()
    rows = [llm.engine.scheduler.requests[r] for r in ("0", "1_0", "2_0")]
    assert {tuple(bm.block_tables[r.request_id]) for r in rows} == {tuple(bm.block_tables["0"])}
    assert bm.ref_counts[bm.block_tables["0"][2]] == 3
    assert len({r.token_ids[-1] for r in rows}) == 3  # the three best first tokens
    llm.engine.step()
    third = [bm.block_tables[r.request_id][2] for r in rows]
    assert len(set(third)) == 3 and all(bm.ref_counts[b] == 1 for b in third)
    assert all(bm.ref_counts[bm.block_tables["0"][i]] == 3 for i in (0, 1))


resubmitted = lambda trace: any(
    r.is_prefill and r.start > 0 and "_" in r.request_id for s in trace for r in s.rows
)
CONFIGS = {  # each with what shows that it took its path
    # a prompt's beams run in different steps: those that sampled first come back as new requests
    "tiny_token_budget": (dict(max_num_batched_tokens=2), resubmitted),
    "preemption": (dict(num_blocks=9), lambda trace: any(s.preempted for s in trace)),
    "swap": (
        dict(num_blocks=9, preemption_mode="swap"),
        lambda trace: any(s.swapped_out for s in trace),
    ),
    "static": (dict(batching="static", max_num_seqs=4), lambda trace: True),
    "no_prefix_cache": (dict(enable_prefix_caching=False, max_num_batched_tokens=2), resubmitted),
    "block_size_1": (dict(block_size=1, num_blocks=300), lambda trace: True),
    # one prompt at a time (3 seats), the others wait
    "seats_for_one_prompt": (
        dict(max_num_seqs=3),
        lambda trace: max(s.num_running for s in trace) == 3,
    ),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_any_configuration_gives_the_same_beams(models, name):
    loaded, _ = models
    params = BeamSearchParams(3, 6, ignore_eos=True)
    expected = make(loaded).beam_search(PROMPTS, params)
    config, took_its_path = CONFIGS[name]
    llm = make(loaded, **config)
    got = run_checked(llm, PROMPTS, params)
    assert took_its_path(llm.engine.trace.steps)
    for out, ref in zip(got, expected):
        assert [s.tokens for s in out.sequences] == [s.tokens for s in ref.sequences]
        # A beam that comes back as a request recomputes its prefix as a prefill chunk, not as
        # decodes: minicb keeps transformers' float32 RMSNorm and RoPE angles in a float64 model,
        # so another path moves a log-probability by up to ~1e-8 (1.8e-8 measured).
        cums = [s.cum_logprob for s in ref.sequences]
        assert [s.cum_logprob for s in out.sequences] == pytest.approx(cums, abs=1e-6)


# A row that copied its shared block on write and was then swapped out in the same step used to be
# swapped out from the copy's target before the copy was made (ModelRunner.execute swaps out first):
# BlockManager.swap_out now swaps out the pending copy's source and cancels the copy.
def test_a_row_swapped_out_in_the_step_of_its_copy_on_write_keeps_its_cache(models):
    loaded, _ = models
    params = BeamSearchParams(2, 8, ignore_eos=True)
    expected = make(loaded).beam_search([[100]], params)
    config = dict(block_size=8, num_blocks=3, max_num_batched_tokens=3, preemption_mode="swap")
    llm = make(loaded, batching="static", **config)
    for prompt in ([77, 122, 79, 71, 103, 16, 114, 38, 19, 5], [6, 89, 76, 63, 8]):
        llm.engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    got = llm.beam_search([[100]], params)
    assert [s.tokens for s in got[0].sequences] == [s.tokens for s in expected[0].sequences]


def test_beside_ordinary_requests_changes_nobody(models):
    loaded, _ = models
    plain = [
        SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=0.9, seed=5, ignore_eos=True),
        SamplingParams(n=2, max_tokens=5, temperature=1.0, seed=8, ignore_eos=True),
    ]
    others = [[40, 41, 42, 43, 44], [3] * 10, [60, 61]]
    alone = make(loaded).generate(others, plain, use_tqdm=False)
    params = BeamSearchParams(3, 7, ignore_eos=True)
    beams_alone = make(loaded).beam_search(PROMPTS[:2], params)

    llm = make(loaded)
    ids = [llm.engine.add_request(p, sp) for p, sp in zip(others, plain)]
    search = BeamSearch(llm.engine, params)
    for prompt in PROMPTS[:2]:
        search.add(prompt)
    done = {}
    while not search.finished or len(done) < len(ids):
        outs = llm.engine.step()  # the beams' rows have outputs too: not for us
        done.update((o.request_id, o) for o in outs if o.finished and o.request_id in ids)
        search.update()
        llm.engine.scheduler.block_manager.check_invariants()
    for rid, ref in zip(ids, alone):
        assert [c.token_ids for c in done[rid].outputs] == [c.token_ids for c in ref.outputs]
    for inst, ref in zip(search.instances, beams_alone):
        assert [s.tokens for s in search.output(inst).sequences] == [
            s.tokens for s in ref.sequences
        ]


def test_text_prompts_and_text_as_vllm(tmp_path, models):
    """Prompts as text or vLLM's dicts; each sequence's text is all its tokens decoded, the
    prompt's included, as vLLM's."""
    path = add_word_tokenizer(save_tiny_model(tmp_path, seed=3))
    llm = make(load_model(path, dtype=torch.float64))
    tokenizer = llm.get_tokenizer()
    params = BeamSearchParams(2, 4, ignore_eos=True)
    outs = llm.beam_search(["w10 w11 w12", {"prompt_token_ids": [20, 21]}], params)
    by_ids = llm.beam_search([[10, 11, 12]], params)[0]
    assert [s.tokens for s in outs[0].sequences] == [s.tokens for s in by_ids.sequences]
    for out in outs:
        for seq in out.sequences:
            assert seq.text == tokenizer.decode(seq.tokens, skip_special_tokens=True)
    assert outs[0].sequences[0].text.startswith("w10 w11 w12 ")


def test_sampled_candidates_and_abort(models):
    loaded, _ = models
    llm = make(loaded)
    outs = llm.beam_search(PROMPTS, BeamSearchParams(3, 5, temperature=0.8))
    assert [len(o.sequences) for o in outs] == [3, 3, 3]
    search = BeamSearch(llm.engine, BeamSearchParams(2, 20, ignore_eos=True))
    inst = search.add(PROMPTS[0])
    for _ in range(4):
        llm.engine.step()
        search.update()
    llm.engine.abort_request(inst.request_id)  # from outside: the search ends, as vLLM's
    llm.engine.step()
    search.update()
    assert search.finished
    assert {s.finish_reason for s in search.output(inst).sequences} == {"abort"}
    llm.engine.step()
    assert llm.engine.scheduler.block_manager.num_used_blocks == 0


def test_bad_params_are_refused_with_the_field_and_the_limit(models):
    loaded, _ = models
    for kwargs, words in [
        (dict(beam_width=0, max_tokens=4), "beam_width must be an integer in [1, 10]"),
        (dict(beam_width=11, max_tokens=4), "logprobs are limited to 20"),
        (dict(beam_width=2, max_tokens=0), "max_tokens must be an integer >= 1"),
        (dict(beam_width=2, max_tokens=4, temperature=-1), "temperature must be"),
        (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty"),
    ]:
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            BeamSearchParams(**kwargs)
    llm = make(loaded, max_num_seqs=4)
    with pytest.raises(ValueError, match="beam_width=5 needs 5 slots .* max_num_seqs is 4"):
        llm.beam_search(PROMPTS, BeamSearchParams(5, 4))
    with pytest.raises(ValueError, match="prompt 1: .*max_model_len 64"):
        llm.beam_search([PROMPTS[0], [3] * 60], BeamSearchParams(2, 8))
    assert not llm.engine.has_unfinished_requests()  # all or nothing
    with pytest.raises(ValueError, match="params must be a BeamSearchParams"):
        llm.beam_search(PROMPTS, SamplingParams())
