"""Logits processors and min-p, each checked against a plain, loop-by-loop reference on random
logits, and end to end: greedy decoding with penalties equals a reference decoder on transformers'
logits."""

import random
import types

import pytest
import torch

from minicb import LLM, SamplingParams
from minicb.model_executor.loader import load_model, make_tiny_model, save_tiny_model
from minicb.sample.penalties import process_logits
from minicb.sample.sampler import Sampler

VOCAB = 50


def seq(prompt, output, stop=(1,)):
    return types.SimpleNamespace(
        prompt_token_ids=prompt, output_token_ids=output, stop_token_ids=frozenset(stop)
    )


def reference(logits: list[float], p: SamplingParams, s) -> list[float]:
    """The processors written out one token at a time, in vLLM's order."""
    out = list(logits)
    if len(s.output_token_ids) < p.min_tokens:
        for t in s.stop_token_ids:
            out[t] = float("-inf")
    for t, b in (p.logit_bias or {}).items():
        out[t] += b
    for t in set(s.prompt_token_ids) | set(s.output_token_ids):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in range(len(out)):
        count = s.output_token_ids.count(t)
        out[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out


CASES = {
    "repetition": SamplingParams(repetition_penalty=1.7),
    "repetition_below_1": SamplingParams(repetition_penalty=0.6),
    "frequency": SamplingParams(frequency_penalty=0.8),
    "presence": SamplingParams(presence_penalty=-1.2),
    "logit_bias": SamplingParams(logit_bias={3: 5.0, 7: -100, 49: 0.5}),
    "min_tokens": SamplingParams(min_tokens=4, max_tokens=10),
    "all": SamplingParams(
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=0.4,
        min_tokens=9,
        max_tokens=20,
        logit_bias={1: 2.0, 4: -3.0},
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_processors_match_the_plain_reference(name):
    rng = random.Random(name)
    torch.manual_seed(len(name))
    logits = torch.randn(3, VOCAB, dtype=torch.float64) * 3
    seqs = [
        seq(
            [rng.randrange(VOCAB) for _ in range(12)],
            [rng.randrange(VOCAB) for _ in range(n)],
            stop=(1, 2),
        )
        for n in (0, 5, 12)
    ]
    neutral = SamplingParams()
    params = [CASES[name], neutral, CASES[name]]
    got = process_logits(logits, params, seqs)
    for i, (p, s) in enumerate(zip(params, seqs)):
        assert got[i].tolist() == pytest.approx(
            reference(logits[i].tolist(), p, s), rel=1e-12, abs=1e-12
        )
    assert torch.equal(got[1], logits[1])  # a row without processors is untouched


def test_neutral_values_change_nothing_not_even_the_tensor():
    logits = torch.randn(4, VOCAB)
    params = [
        SamplingParams(
            frequency_penalty=0,
            presence_penalty=0.0,
            repetition_penalty=1.0,
            min_tokens=0,
            logit_bias={},
        )
    ] * 4
    assert process_logits(logits, params, [seq([1, 2], [3])] * 4) is logits
    # and so a seeded draw is the same with the penalty at 0 as without it
    s = Sampler()
    draws = [
        s(logits, [p] * 4, [s.generator_for(9, "cpu")] * 4).tolist()
        for p in (
            SamplingParams(temperature=1.0, seed=9),
            SamplingParams(temperature=1.0, seed=9, presence_penalty=0),
        )
    ]
    assert draws[0] == draws[1]


def test_processors_work_in_float32_on_bf16_logits():
    logits = torch.randn(2, VOCAB).to(torch.bfloat16)
    got = process_logits(
        logits, [SamplingParams(frequency_penalty=0.1)] * 2, [seq([1], [2, 2])] * 2
    )
    assert got.dtype == torch.float32
    assert got[0, 2].item() == pytest.approx(logits[0, 2].float().item() - 0.2, abs=1e-6)


def test_min_p_keeps_the_tokens_above_the_threshold():
    # min_p after temperature: a token survives iff p >= min_p * max p, so draws only ever land
    # there.
    torch.manual_seed(0)
    logits = torch.linspace(0, -4, VOCAB)[torch.randperm(VOCAB)][None]  # (1, VOCAB), evenly spread
    for temperature, min_p in [(1.0, 0.3), (0.5, 0.1), (2.0, 0.6)]:
        probs = torch.softmax(logits[0] / temperature, dim=-1)
        allowed = set(torch.nonzero(probs >= min_p * probs.max()).flatten().tolist())
        assert 1 < len(allowed) < VOCAB // 2  # the threshold keeps some tokens and cuts most
        s = Sampler()
        seen = {
            s(
                logits,
                [SamplingParams(temperature=temperature, min_p=min_p, seed=k)],
                [s.generator_for(k, "cpu")],
            ).item()
            for k in range(300)
        }
        assert seen == allowed  # never outside, and nothing inside is cut


def test_min_p_zero_changes_no_draw():
    logits = torch.randn(3, VOCAB)
    s = Sampler()
    a = s(logits, [SamplingParams(temperature=0.8, seed=1)] * 3, [s.generator_for(1, "cpu")] * 3)
    b = s(
        logits,
        [SamplingParams(temperature=0.8, seed=1, min_p=0.0)] * 3,
        [s.generator_for(1, "cpu")] * 3,
    )
    assert torch.equal(a, b)


# ---------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama", seed=5)
    return load_model(path, dtype=torch.float64), make_tiny_model(
        "llama", seed=5, dtype=torch.float64
    )


def greedy_with_reference_processors(hf, prompt, p: SamplingParams, eos=1) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        while len(tokens) - len(prompt) < p.max_tokens:
            logits = hf(torch.tensor([tokens])).logits[0, -1].tolist()
            out = reference(
                logits, p, seq(prompt, tokens[len(prompt) :], stop=() if p.ignore_eos else (eos,))
            )
            tokens.append(max(range(len(out)), key=lambda t: (out[t], -t)))
            if tokens[-1] == eos and not p.ignore_eos:
                break
    return tokens[len(prompt) :]


PROMPT = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]  # repetitive: penalties bite


@pytest.mark.parametrize(
    "params",
    [
        dict(frequency_penalty=1.5),
        dict(presence_penalty=1.5),
        dict(repetition_penalty=2.0),
        dict(logit_bias={9: 3.0}),
        dict(frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.4),
    ],
)
def test_greedy_with_penalties_matches_a_reference_decoder(model, params):
    loaded, hf = model
    p = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, **params)
    llm = LLM.from_loaded(loaded, dtype="float64", block_size=4, num_blocks=64)
    plain = llm.generate(
        [PROMPT], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), use_tqdm=False
    )
    got = llm.generate([PROMPT, PROMPT[:4]], [p, p], use_tqdm=False)
    assert got[0].outputs[0].token_ids == greedy_with_reference_processors(hf, PROMPT, p)
    assert got[1].outputs[0].token_ids == greedy_with_reference_processors(hf, PROMPT[:4], p)
    # the penalty changed the output
    assert got[0].outputs[0].token_ids != plain[0].outputs[0].token_ids


def test_min_tokens_holds_back_eos(model):
    loaded, hf = model
    llm = LLM.from_loaded(loaded, dtype="float64", block_size=4, num_blocks=64)
    # EOS would come first
    eager_eos = SamplingParams(max_tokens=10, temperature=0, logit_bias={1: 100.0})
    assert llm.generate([PROMPT], eager_eos, use_tqdm=False)[0].outputs[0].token_ids == [1]
    p = SamplingParams(max_tokens=10, temperature=0, logit_bias={1: 100.0}, min_tokens=4)
    out = llm.generate([PROMPT], p, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy_with_reference_processors(hf, PROMPT, p)
    assert len(out.token_ids) == 5 and out.token_ids[-1] == 1 and out.finish_reason == "stop"


def test_logit_bias_outside_the_vocabulary_is_refused(model):
    llm = LLM.from_loaded(model[0], dtype="float64", block_size=4, num_blocks=64)
    with pytest.raises(ValueError, match=r"logit_bias token ids must be in \[0, 128\)"):
        llm.generate([PROMPT], SamplingParams(logit_bias={128: 1.0}), use_tqdm=False)


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(presence_penalty=2.5), "presence_penalty must be a number in"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty must be a number in"),
        (dict(repetition_penalty=0), "repetition_penalty must be a number in \\[0.01, 100\\]"),
        (dict(repetition_penalty=1e-40), "repetition_penalty must be a number in"),
        (dict(min_p=1.5), "min_p must be a number in"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens must be an integer in"),
        (dict(logit_bias={3: 101}), "logit_bias must be a map"),
        (dict(logit_bias={"3": 1.0}), "logit_bias must be a map"),
        (dict(n=0), "n must be an integer >= 1"),
        (dict(logprobs=21), "logprobs must be an integer in"),
        (dict(prompt_logprobs=-1), "prompt_logprobs must be an integer in"),
    ],
)
def test_bad_values_are_refused_by_name(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**bad)
