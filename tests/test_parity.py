"""minicb against transformers' `generate`, token for token, in float64 on tiny random models.

The contract (design.md): a request's output never depends on what else is in the batch, on
block size, chunk size, preemption or static/continuous batching. Every configuration below
must reproduce the same greedy tokens as transformers running each prompt alone.
"""

import random

import pytest
import torch
from reference import greedy_reference

from minicb import LLM, SamplingParams
from minicb.core.kv_cache_groups import blocks_per_request, kv_cache_groups
from minicb.model_executor.hf_config import sliding_window_of
from minicb.model_executor.loader import load_model, make_tiny_model, save_tiny_model

ARCHS = [
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "mistral_window",
    "qwen2_hybrid",
    "llama3",
    "qwen3_moe",
    "mixtral",
    "deepseek_v3",
    "gemma3",
    "gpt_oss",
]
rng = random.Random(0)
# Very different prompt lengths (1..57) and output lengths (1..28); two prompts share a prefix.
SHARED = [rng.randrange(2, 128) for _ in range(21)]
PROMPTS = [[rng.randrange(2, 128) for _ in range(n)] for n in (1, 57, 9, 33, 4, 17)]
PROMPTS += [SHARED + [5, 6, 7], SHARED + [9, 10]]
MAX_TOKENS = [28, 5, 1, 17, 23, 9, 12, 14]
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tmp_path_factory):
    """(LoadedModel, reference outputs, the transformers model) for one architecture."""
    arch = request.param
    path = save_tiny_model(tmp_path_factory.mktemp(arch), arch=arch, seed=1)
    loaded = load_model(path, dtype=torch.float64)
    hf = make_tiny_model(arch, seed=1, dtype=torch.float64)
    refs = greedy_reference(hf, PROMPTS, MAX_TOKENS)
    return loaded, refs, hf


def run(loaded, **config):
    llm = LLM.from_loaded(loaded, dtype="float64", **config)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    llm.engine.scheduler.block_manager.check_invariants()
    assert llm.engine.scheduler.block_manager.num_used_blocks == 0, "blocks leaked after the run"
    return [o.outputs[0].token_ids for o in outs], llm.engine.trace


CONFIGS = {
    "default": dict(block_size=16, num_blocks=64),
    "block_size_1": dict(block_size=1, num_blocks=1024),
    "block_size_3_no_prefix_cache": dict(block_size=3, num_blocks=400, enable_prefix_caching=False),
    "tiny_token_budget": dict(block_size=4, num_blocks=200, max_num_batched_tokens=5),
    "no_chunked_prefill": dict(
        block_size=8, num_blocks=100, enable_chunked_prefill=False, max_num_batched_tokens=64
    ),
    "two_slots_sjf": dict(block_size=4, num_blocks=100, max_num_seqs=2, scheduling_policy="sjf"),
    "static": dict(block_size=4, num_blocks=100, max_num_seqs=3, batching="static"),
    # Speculative decoding: prompt-lookup drafts verified in the step (with block_size 1 every
    # rejected draft frees a block; a budget of 7 trims drafts). A random model guesses badly: most
    # drafts are rejected.
    "spec_ngram": dict(block_size=4, num_blocks=200, speculative_config=SPEC),
    "spec_block_size_1_tiny_budget": dict(
        block_size=1, num_blocks=400, max_num_batched_tokens=7, speculative_config=SPEC
    ),
}


@pytest.mark.parametrize("spec", [None, SPEC], ids=["", "spec"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_transformers(model, name, spec):
    """Every configuration, and every configuration again with speculative decoding on."""
    loaded, refs, _ = model
    tokens, trace = run(loaded, **CONFIGS[name] | ({"speculative_config": spec} if spec else {}))
    assert tokens == refs
    if spec or "speculative_config" in CONFIGS[name]:
        assert any(r.num_drafts for s in trace for r in s.rows), (
            "no draft was verified: the test did not test it"
        )


ASYNC_CONFIGS = [name for name, c in CONFIGS.items() if "speculative_config" not in c] + [
    "preempt_recompute",
    "preempt_swap",
]
PREEMPTING = dict(block_size=4, num_blocks=24, max_num_batched_tokens=32)


def preempting_blocks(loaded) -> int:
    """24 blocks of 4 tokens: the longest request needs 21 on its own, so the batch must preempt.
    A windowed model's KV cache groups keep fewer in a window's group (a window of 8: at most
    cdiv(8 - 1 + 32, 4) + 1 = 11): it gets one block more than its longest request needs."""
    hf = loaded.hf_config
    windows = [sliding_window_of(hf, i) for i in range(hf.num_hidden_layers)]
    if not any(windows):
        return 24
    longest = max(len(p) for p in PROMPTS) + max(MAX_TOKENS) - 1
    return blocks_per_request(kv_cache_groups(windows), longest, 4, 32) + 1


@pytest.mark.parametrize("name", ASYNC_CONFIGS)
def test_async_scheduling_matches_transformers(model, name):
    """Async scheduling (the next step scheduled before this one's tokens land) gives the same
    tokens in every configuration; drafts are refused with it (test_async_scheduling.py)."""
    loaded, refs, _ = model
    config = CONFIGS.get(name) or PREEMPTING | {
        "preemption_mode": name.removeprefix("preempt_"),
        "num_blocks": preempting_blocks(loaded),
    }
    tokens, trace = run(loaded, async_scheduling=True, **config)
    assert tokens == refs
    if name.startswith("preempt"):
        assert any(s.preempted or s.swapped_out for s in trace), "nothing was preempted"


@pytest.mark.parametrize("mode,spec", [("recompute", None), ("swap", None), ("recompute", SPEC)])
def test_preemption_keeps_outputs_exact(model, mode, spec):
    loaded, refs, _ = model
    tokens, trace = run(
        loaded,
        block_size=4,
        num_blocks=preempting_blocks(loaded),
        max_num_batched_tokens=32,
        preemption_mode=mode,
        speculative_config=spec,
    )
    assert tokens == refs
    events = [r for s in trace for r in (s.preempted if mode == "recompute" else s.swapped_out)]
    assert events, f"no {mode} preemption happened: the test did not test it"
    if mode == "swap":
        assert any(s.swapped_in for s in trace)


def test_prefix_cache_is_used_and_exact(model):
    loaded, refs, _ = model
    # One slot: the second shared-prefix prompt runs after the first and finds its blocks cached.
    llm = LLM.from_loaded(loaded, dtype="float64", block_size=4, num_blocks=100, max_num_seqs=1)
    params = SamplingParams(max_tokens=MAX_TOKENS[6], temperature=0.0, ignore_eos=True)
    a = llm.generate([PROMPTS[6]], params, use_tqdm=False)[0]
    params = SamplingParams(max_tokens=MAX_TOKENS[7], temperature=0.0, ignore_eos=True)
    b = llm.generate([PROMPTS[7]], params, use_tqdm=False)[0]
    assert (a.outputs[0].token_ids, b.outputs[0].token_ids) == (refs[6], refs[7])
    first_row_b = next(r for s in llm.engine.trace for r in s.rows if r.request_id == b.request_id)
    assert first_row_b.start == 20  # 5 full blocks of the 21-token shared prefix were reused


def test_eos_stops_like_transformers(model):
    loaded, _, hf = model
    # Declare a token the model does produce as a stop token: both must stop right after it.
    llm = LLM.from_loaded(loaded, dtype="float64", block_size=4, num_blocks=100)
    free_run = (
        llm.generate(
            [PROMPTS[0]],
            SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    stop = free_run[7]
    # EOS ignored, as transformers' eos_token_id=stop ignores the model's: only the stop token ends
    # the run (the tiny Gemma 3 emits its EOS, token 1, before free_run[7])
    out = llm.generate(
        [PROMPTS[0]],
        SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop], ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert (
        out.outputs[0].token_ids == free_run[: free_run.index(stop) + 1]
        and out.outputs[0].finish_reason == "stop"
    )
    # a user stop token is the stop_reason (vLLM); EOS gives None
    assert out.outputs[0].stop_reason == stop
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([PROMPTS[0]]),
            max_new_tokens=20,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=stop,
        )[0, 1:].tolist()
    assert out.outputs[0].token_ids == ref
