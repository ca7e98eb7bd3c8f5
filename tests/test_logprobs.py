"""logprobs and prompt_logprobs: the values are transformers' log-softmax at the same positions
(float64, so to 1e-12), through chunked prefill, preemption and a busy batch; the greedy token's
entry equals the best one exactly; a request asking for prompt logprobs takes no prefix-cache
hits."""

import math

import pytest
import torch
from reference import add_word_tokenizer

from minicb import LLM, SamplingParams
from minicb.model_executor.loader import load_model, make_tiny_model, save_tiny_model
from minicb.sample.logprobs import gather_logprobs, logprobs

PROMPT = [(11 * i) % 120 + 3 for i in range(37)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = add_word_tokenizer(
        save_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama", seed=7)
    )
    return load_model(path, dtype=torch.float64), make_tiny_model(
        "llama", seed=7, dtype=torch.float64
    )


def hf_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    """(len(tokens), vocab): row i is the distribution of the token after tokens[:i + 1]."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([tokens])).logits[0], dim=-1)


def check_entry(entry, chosen, row: torch.Tensor, k: int):
    assert entry[chosen].logprob == pytest.approx(row[chosen].item(), abs=1e-12)
    assert entry[chosen].rank == 1 + int((row > row[chosen]).sum())
    top = row.topk(k).indices.tolist() if k else []
    assert set(entry) == set(top) | {chosen}
    for r, t in enumerate(top):
        assert (
            entry[t].logprob == pytest.approx(row[t].item(), abs=1e-12) and entry[t].rank == r + 1
        )


CONFIGS = {
    "one_step": dict(),
    "chunked": dict(max_num_batched_tokens=8),
    "recompute": dict(num_blocks=14, max_num_seqs=4, preemption_mode="recompute"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_sampled_and_prompt_logprobs_equal_transformers(model, name):
    loaded, hf = model
    llm = LLM.from_loaded(
        loaded, dtype="float64", block_size=4, **dict(dict(num_blocks=128), **CONFIGS[name])
    )
    p = SamplingParams(
        max_tokens=9, temperature=0.9, seed=4, logprobs=3, prompt_logprobs=2, ignore_eos=True
    )
    # neighbours that ask for nothing
    others = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    outs = llm.generate(
        [PROMPT, PROMPT[:20], PROMPT[::-1], PROMPT], [p, others, others, p], use_tqdm=False
    )
    if name == "recompute":
        assert any(rec.preempted for rec in llm.engine.trace), "nothing was preempted"
    for out in (outs[0], outs[3]):
        sample = out.outputs[0]
        rows = hf_logprobs(hf, PROMPT + sample.token_ids)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
        for i in range(1, len(PROMPT)):
            check_entry(out.prompt_logprobs[i], PROMPT[i], rows[i - 1], 2)
        assert len(sample.logprobs) == len(sample.token_ids) == 9
        for j, (token, entry) in enumerate(zip(sample.token_ids, sample.logprobs)):
            check_entry(entry, token, rows[len(PROMPT) - 1 + j], 3)
        want = sum(rows[len(PROMPT) - 1 + j, t].item() for j, t in enumerate(sample.token_ids))
        assert sample.cumulative_logprob == pytest.approx(want, abs=1e-9)
    assert outs[1].outputs[0].logprobs is None and outs[1].prompt_logprobs is None


def test_greedy_token_equals_the_best_entry_exactly(model):
    llm = LLM.from_loaded(model[0], dtype="float64", block_size=4, num_blocks=128)
    out = llm.generate(
        [PROMPT], SamplingParams(max_tokens=6, temperature=0, logprobs=5), use_tqdm=False
    )[0]
    for token, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        # ==, as lm-eval compares
        assert entry[token].logprob == max(lp.logprob for lp in entry.values())
        assert entry[token].rank == 1


def test_entries_carry_the_token_text(model):
    llm = LLM.from_loaded(model[0], dtype="float64", block_size=4, num_blocks=128)
    out = llm.generate(
        ["w10 w11 w12"],
        SamplingParams(max_tokens=2, temperature=0, logprobs=1, prompt_logprobs=0),
        use_tqdm=False,
    )[0]
    assert out.prompt_logprobs[1][11].decoded_token == "w11"
    for token, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        assert entry[token].decoded_token == llm.get_tokenizer().decode([token])


def test_prompt_logprobs_take_no_prefix_cache_hits(model):
    loaded, hf = model
    llm = LLM.from_loaded(loaded, dtype="float64", block_size=4, num_blocks=128)
    # its blocks are now cached
    llm.generate([PROMPT], SamplingParams(max_tokens=1), use_tqdm=False)
    engine = llm.engine
    engine.add_request(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=1))
    engine.step()
    (row,) = engine.trace.steps[-1].rows
    assert row.num_tokens == len(PROMPT)  # computed from the first token: no hit taken
    engine.add_request(PROMPT, SamplingParams(max_tokens=1))
    engine.step()
    assert engine.trace.steps[-1].rows[0].num_tokens < len(PROMPT)  # without prompt_logprobs: hits


def test_float32_log_softmax_on_bf16_logits():
    torch.manual_seed(0)
    logits = torch.randn(2, 300).to(torch.bfloat16)
    lp = logprobs(logits)
    assert lp.dtype == torch.float32
    assert torch.allclose(lp, torch.log_softmax(logits.float(), dim=-1))
    (entry, _) = gather_logprobs(lp, [5, 7], [3, 0])
    assert math.isclose(sum(math.exp(v) for v in lp[0].tolist()), 1.0, rel_tol=1e-5)
    assert len(entry) in (3, 4) and 5 in entry
