"""Sampler: greedy, temperature / top-k / top-p against their definitions, seeded
reproducibility."""

import math

import pytest
import torch

from minicb.sample.sampler import Sampler
from minicb.sampling_params import SamplingParams

LOGITS6 = [2.0, 1.5, 1.0, 0.5, 0.0, -1.0]  # six tokens, already sorted: token i has rank i


def expected_distribution(logits, temperature=1.0, top_k=0, top_p=1.0):
    """The definition, in plain Python: softmax(logits / T), keep top-k, renormalize, keep top-p."""
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    if top_k > 0:
        order = order[:top_k]
    weights = {i: math.exp(logits[i] / temperature) for i in order}
    total = sum(weights.values())
    kept, mass = [], 0.0
    for i in order:  # smallest prefix whose probability reaches top_p
        kept.append(i)
        mass += weights[i] / total
        if mass >= top_p:
            break
    total = sum(weights[i] for i in kept)
    return [weights[i] / total if i in kept else 0.0 for i in range(len(logits))]


def assert_matches(tokens, expected, vocab):
    """Empirical frequencies within 5 standard errors; tokens outside the kept set never appear."""
    n = tokens.numel()
    counts = torch.bincount(tokens, minlength=vocab).tolist()
    for token, (count, p) in enumerate(zip(counts, expected)):
        if p == 0.0:
            assert count == 0, f"token {token} was truncated but sampled {count} times"
        else:
            tolerance = 5 * math.sqrt(p * (1 - p) / n)
            assert abs(count / n - p) <= tolerance, (token, count / n, p, tolerance)


def sample_many(params, n, seed=0, dtype=torch.float32):
    """n samples of the LOGITS6 row under `params`, drawn in one batched call."""
    logits = torch.tensor([LOGITS6] * n, dtype=dtype)
    return Sampler(seed)(logits, [params] * n, [None] * n)


def test_expected_distribution_reference():
    # The reference itself, on hand-checkable cases.
    assert expected_distribution([0.0, 0.0], top_k=1) == [1.0, 0.0]
    p = expected_distribution([math.log(5), math.log(3), math.log(2)], top_p=0.7)
    assert p == pytest.approx([5 / 8, 3 / 8, 0.0])


def test_greedy_is_argmax():
    logits = torch.randn(7, 50, generator=torch.Generator().manual_seed(0))
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # a tie: the lowest id wins
    params = [SamplingParams(temperature=0.0)] * 7
    tokens = Sampler()(logits, params, [None] * 7)
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, logits.argmax(dim=-1))
    assert tokens[3] == 10


def test_mixed_batch_gives_greedy_rows_their_argmax():
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(1))
    sampler = Sampler()
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=5.0, top_k=50)
    params = [greedy if i % 2 else hot for i in range(16)]
    gens = [sampler.generator_for(i if i % 4 == 0 else None, "cpu") for i in range(16)]
    tokens = sampler(logits, params, gens)
    argmax = logits.argmax(dim=-1)
    assert torch.equal(tokens[1::2], argmax[1::2])
    assert not torch.equal(tokens[0::2], argmax[0::2])  # at T=5 the sampled rows do wander


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [
        (1.0, 0, 1.0),  # plain softmax
        (0.5, 0, 1.0),  # sharper
        (2.0, 0, 1.0),  # flatter
        (1.0, 3, 1.0),  # top-k alone
        (1.0, 0, 0.8),  # top-p cutting in the middle: keeps tokens 0..2
        (1.0, 4, 0.88),  # top-k, then top-p on the renormalized top-4: keeps tokens 0..2
        (2.0, 4, 0.6),  # the same at a higher temperature: keeps tokens 0..1
    ],
)
def test_distribution_matches_definition(temperature, top_k, top_p):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    expected = expected_distribution(LOGITS6, temperature, top_k, top_p)
    assert_matches(sample_many(params, 20_000), expected, vocab=6)


def test_top_p_cuts_are_in_the_middle():
    # Guards the parametrized cases above against testing only trivial cuts.
    def kept(*args):
        return sum(p > 0 for p in expected_distribution(LOGITS6, *args))

    assert kept(1.0, 0, 0.8) == 3
    assert kept(2.0, 4, 0.6) == 2
    # Order matters: top-p on the renormalized top-4 keeps 3 tokens, while top-p on the full
    # distribution would reach 0.88 only with the 4th token.
    assert kept(1.0, 4, 0.88) == 3
    assert kept(1.0, 0, 0.88) == 4


def test_per_row_parameters_in_one_batch():
    # Different settings interleaved in a single call: each row uses its own.
    configs = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.8),
        SamplingParams(temperature=1.5, top_k=2),
        SamplingParams(temperature=0.0),
    ]
    n = 8_000
    params = configs * n
    logits = torch.tensor([LOGITS6] * len(params))
    tokens = Sampler(3)(logits, params, [None] * len(params))
    for j, p in enumerate(configs):
        if p.temperature == 0:
            assert torch.all(tokens[j::4] == 0)
        else:
            expected = expected_distribution(LOGITS6, p.temperature, p.top_k, p.top_p)
            assert_matches(tokens[j::4], expected, vocab=6)


def test_seeded_rows_follow_the_distribution_too():
    # The per-request-generator path, one distinct seed per row.
    n = 4_000
    sampler = Sampler()
    params = SamplingParams(temperature=1.0, top_k=4, top_p=0.9, seed=0)
    logits = torch.tensor([LOGITS6] * n)
    tokens = sampler(logits, [params] * n, [sampler.generator_for(s, "cpu") for s in range(n)])
    assert_matches(tokens, expected_distribution(LOGITS6, 1.0, 4, 0.9), vocab=6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sampling_is_the_exponential_race_on_the_rows_own_noise(dtype):
    # Pins the draw: argmax(softmax(logits / T) / E), E = -log(1 - U) with U `vocab` uniform
    # draws from the row's generator each step, in the logits' dtype (float64 stays float64).
    logits = torch.randn(50, 30, dtype=dtype, generator=torch.Generator().manual_seed(2))
    sampler = Sampler()
    mine, reference = sampler.generator_for(7, "cpu"), torch.Generator().manual_seed(7)
    params = [SamplingParams(temperature=0.9, seed=7)]
    for step in range(50):
        got = sampler(logits[step : step + 1], params, [mine])
        noise = -torch.log1p(-torch.rand(30, dtype=dtype, generator=reference))
        assert got.item() == (torch.softmax(logits[step] / 0.9, dim=-1) / noise).argmax().item()


def row_logits(key, step, vocab=64):
    """Deterministic logits for request `key` at `step`, independent of the batch it sits in."""
    return torch.randn(vocab, generator=torch.Generator().manual_seed(1000 * key + step))


def test_seeded_request_is_independent_of_the_batch():
    steps = 6
    me = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    others = [
        SamplingParams(temperature=0.8, top_k=5, seed=99),
        SamplingParams(temperature=1.2),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_p=0.5),
    ]

    def tokens_of_me(batch_params, me_at):
        sampler = Sampler(seed=len(batch_params))  # the shared generator differs between runs too
        gens = [sampler.generator_for(p.seed, "cpu") for p in batch_params]
        keys = [0 if i == me_at else i + 1 for i in range(len(batch_params))]
        mine = []
        for step in range(steps):
            logits = torch.stack([row_logits(k, step) for k in keys])
            mine.append(sampler(logits, batch_params, gens)[me_at].item())
        return mine

    alone = tokens_of_me([me], 0)
    assert tokens_of_me(others[:2] + [me], 2) == alone
    assert tokens_of_me([me] + others, 0) == alone
    assert tokens_of_me(others[2:] + [me] + others[:2], 2) == alone
    # A different seed gives a different sequence.
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=4321)
    assert tokens_of_me([other_seed], 0) != alone


def test_same_seed_same_tokens_different_seed_different_tokens():
    sampler = Sampler()
    logits = torch.zeros(1, 1000)  # uniform: every seed picks its own token
    params = [SamplingParams(temperature=1.0)]

    def sequence(seed):
        g = sampler.generator_for(seed, "cpu")
        return [sampler(logits, params, [g]).item() for _ in range(8)]

    assert sequence(5) == sequence(5)
    assert sequence(5) != sequence(6)
    assert len(set(sequence(5))) > 1  # the generator advances from step to step
    assert sampler.generator_for(None, "cpu") is None


def test_unseeded_rows_share_the_samplers_generator():
    logits = torch.zeros(4, 1000)
    params = [SamplingParams(temperature=1.0)] * 4
    a, b = Sampler(seed=1), Sampler(seed=1)
    assert torch.equal(a(logits, params, [None] * 4), b(logits, params, [None] * 4))
    assert not torch.equal(
        a(logits, params, [None] * 4), Sampler(seed=2)(logits, params, [None] * 4)
    )


def test_top_k_larger_than_vocab_and_top_p_one_are_no_ops():
    # Seeded rows draw the same noise, so "off" must give exactly the same tokens as plain sampling.
    n = 300
    logits = torch.randn(n, 6, generator=torch.Generator().manual_seed(4))
    sampler = Sampler()

    def tokens(**kw):
        params = [SamplingParams(temperature=1.0, seed=s, **kw) for s in range(n)]
        return sampler(logits, params, [sampler.generator_for(s, "cpu") for s in range(n)])

    plain = tokens()
    assert torch.equal(tokens(top_k=100), plain)
    assert torch.equal(tokens(top_p=1.0), plain)
    assert torch.equal(tokens(top_k=6, top_p=1.0), plain)
    assert len(set(plain.tolist())) == 6  # not trivially constant


@pytest.mark.parametrize("temperature", [1e-3, 1e-6, 1e-20, 1e-300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_very_small_temperature_is_greedy(temperature, dtype):
    # Logits of LLM-like size (tens): divided by 1e-300 they would overflow without care.
    logits = (10 * torch.randn(64, 32, generator=torch.Generator().manual_seed(5))).to(dtype)
    logits[:, 0] += 0.5  # keep clear of near-ties, where a tiny T can still pick either
    top2 = logits.float().topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.2
    params = [SamplingParams(temperature=temperature, top_p=0.9)] * 64
    tokens = Sampler()(logits, params, [None] * 64)
    assert torch.equal(tokens[clear], logits.argmax(dim=-1)[clear])
    assert clear.sum() > 32


def test_float64_logits_keep_float64_precision():
    # A gap of 1e-12 is invisible in float32 (both logits round to 1.0), but at T = 1e-14 it
    # makes token 1 e^100 times more likely than token 0.
    logits = torch.tensor([[1.0, 1.0 + 1e-12]] * 200, dtype=torch.float64)
    params = [SamplingParams(temperature=1e-14)] * 200
    assert torch.all(Sampler()(logits, params, [None] * 200) == 1)


def test_low_precision_logits_are_sampled_in_float32():
    # bf16 logits are upcast before scaling; the result is still valid int64 ids.
    tokens = sample_many(SamplingParams(temperature=1.0, top_p=0.8), 20_000, dtype=torch.bfloat16)
    assert tokens.dtype == torch.int64
    bf16_row = torch.tensor(LOGITS6, dtype=torch.bfloat16).double().tolist()
    assert_matches(tokens, expected_distribution(bf16_row, 1.0, 0, 0.8), vocab=6)


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="2 rows but got 1 params"):
        Sampler()(torch.zeros(2, 5), [SamplingParams()], [None, None])
