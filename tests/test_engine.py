"""The Engine / LLM surface: streaming, abort, metrics, seeds, memory budget, and bad input
that must be refused clearly while everything already queued keeps running."""

import gc
import time
import weakref

import pytest
import torch

from minicb import LLM, Engine, EngineConfig, SamplingParams
from minicb.model_executor.hf_config import kv_bytes_per_token
from minicb.model_executor.loader import load_model, save_tiny_model
from minicb.sampling_params import RequestOutputKind

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model(
        save_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama", seed=3), dtype=torch.float64
    )


@pytest.fixture
def llm(loaded):
    return LLM.from_loaded(loaded, dtype="float64", block_size=4, num_blocks=64, max_model_len=64)


def test_stream_matches_generate(llm):
    prompts = [[3, 4, 5], [7] * 11, [9, 8]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (5, 2, 7)]
    final = {
        o.request_id: o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
    }
    pieces, finished = {}, set()
    for out in llm.stream(prompts, params):
        assert out.request_id not in finished, "a request yielded after it finished"
        pieces.setdefault(out.request_id, []).extend(out.outputs[0].new_token_ids)
        assert pieces[out.request_id] == out.outputs[0].token_ids
        if out.finished:
            finished.add(out.request_id)
    assert sorted(pieces.values()) == sorted(final.values())
    assert len(finished) == 3


def test_outputs_in_input_order_and_metrics(llm):
    outs = llm.generate(
        [[5] * 20, [6], [7] * 3],
        [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 9, 1)],
        use_tqdm=False,
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 9, 1]
    assert [o.prompt_token_ids for o in outs] == [[5] * 20, [6], [7] * 3]
    for o in outs:
        m = o.metrics
        assert o.outputs[0].finish_reason == "length"
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time


def test_abort_in_any_state_frees_blocks(loaded):
    engine = LLM.from_loaded(
        loaded, dtype="float64", block_size=4, num_blocks=64, max_num_seqs=1
    ).engine
    a = engine.add_request([1, 2, 3, 4, 5], GREEDY)
    b = engine.add_request([6, 7, 8], GREEDY)  # waits: one slot
    engine.step()
    assert engine.scheduler.block_manager.num_used_blocks > 0
    out_a = engine.abort_request(a)  # running
    out_b = engine.abort_request(b)  # waiting
    assert out_a.outputs[0].finish_reason == out_b.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.block_manager.num_used_blocks == 0
    assert engine.abort_request("no-such-id") is None


def test_seeded_sampling_independent_of_batch(llm):
    p = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=1234)
    alone = llm.generate([[4, 5, 6]], p, use_tqdm=False)[0].outputs[0].token_ids
    others = [
        SamplingParams(max_tokens=5, temperature=1.0),
        SamplingParams(max_tokens=8, temperature=1.2, seed=7),
    ]
    crowd = llm.generate([[9] * 13, [4, 5, 6], [2, 3]], [others[0], p, others[1]], use_tqdm=False)
    assert crowd[1].outputs[0].token_ids == alone
    other_seed = (
        llm.generate(
            [[4, 5, 6]],
            SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=99),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    assert other_seed != alone


def test_kv_cache_sized_from_byte_budget(loaded):
    per_block = kv_bytes_per_token(loaded.hf_config, torch.float64) * 8
    engine = Engine(
        EngineConfig(dtype="float64", block_size=8, kv_cache_memory_bytes=10 * per_block + 5),
        loaded,
    )
    assert engine.config.num_blocks == 10
    assert engine.kv_cache.k_caches[0].shape[0] == 11  # plus the sink block
    with pytest.raises(ValueError, match="smaller than one KV block"):
        Engine(
            EngineConfig(dtype="float64", block_size=8, kv_cache_memory_bytes=per_block - 1), loaded
        )


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ([], GREEDY, "prompt is empty"),
        ([1] * 70, GREEDY, "exceeds max_model_len 64"),
        ([1] * 60, SamplingParams(max_tokens=10), "exceeds max_model_len 64"),
        ([1, 2, 500], GREEDY, r"\[0, 128\)"),
        ([1, -1], GREEDY, r"\[0, 128\)"),
        ("some text", GREEDY, "no tokenizer"),
        ([1, 2], "not params", "SamplingParams"),
    ],
)
def test_bad_requests_are_refused_and_the_rest_keeps_running(llm, prompt, params, match):
    engine = llm.engine
    good = engine.add_request([3, 4, 5], GREEDY)
    engine.step()
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert outs[-1].request_id == good and len(outs[-1].outputs[0].token_ids) == 6


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(output_kind=1), "output_kind"),  # vLLM's DELTA: new_token_ids holds the delta
    ],
)
def test_invalid_sampling_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_generate_is_all_or_nothing(llm):
    with pytest.raises(ValueError, match="prompt 1"):
        llm.generate([[1, 2, 3], [], [4]], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.block_manager.num_used_blocks == 0


def test_prepacked_cpu_weights_change_nothing_but_rounding(tmp_path, monkeypatch):
    loaded32 = load_model(
        save_tiny_model(tmp_path / "m", arch="qwen2", seed=5), dtype=torch.float32
    )
    prompts = [[3, 4, 5, 6], [9] * 17, [2, 7]]
    # Teacher-forced: the log-probability of every prompt token, so that no sampled token steers the
    # run.
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    runs = {}
    for packed in (False, True, "auto", "other", "auto under MINICB_CPU_KERNELS=other"):
        mode = packed
        if packed == "auto under MINICB_CPU_KERNELS=other":
            monkeypatch.setenv("MINICB_CPU_KERNELS", "other")
            mode = "auto"
        llm = LLM.from_loaded(loaded32, block_size=4, num_blocks=64, prepack_cpu_weights=mode)
        layer = llm.engine.runner.model.layers[0].self_attn.qkv_proj
        if packed in (True, False):
            assert type(layer).__name__ == ("PackedLinear" if packed else "Linear")
        else:  # the kernel this machine timed faster for the shape, or the other one
            shape = f"{layer.in_features}x{layer.out_features}"
            chosen = llm.engine.cpu_kernels[shape]
            assert (
                type(layer).__name__
                == {"onednn": "PackedLinear", "matmul": "Linear"}[chosen["kernel"]]
            )
            is_other = packed != "auto"
            fastest = min(chosen["seconds"], key=chosen["seconds"].get)
            assert (chosen["kernel"] != fastest) == (is_other and len(chosen["seconds"]) > 1)
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[packed] = [
            [next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] for o in outs
        ]
    # Float32: the kernels block their sums differently, so the results agree to a tolerance, not
    # bit for bit (and a greedy token could flip on a near tie: never asserted, see style.md).
    for packed, logprobs in runs.items():
        for got, want in zip(logprobs, runs[False]):
            assert got == pytest.approx(want, abs=1e-4), packed


def test_from_loaded_keeps_the_loaded_dtype_and_says_when_it_converts(tmp_path):
    loaded64 = load_model(
        save_tiny_model(tmp_path / "m", arch="llama", seed=1), dtype=torch.float64
    )
    llm = LLM.from_loaded(loaded64, block_size=4, num_blocks=16)
    assert llm.engine.config.dtype == "float64"
    assert llm.engine.runner.model.embed_tokens.weight.dtype == torch.float64
    with pytest.warns(UserWarning, match="loaded in float64.*converts its weights to float32"):
        llm32 = LLM.from_loaded(loaded64, block_size=4, num_blocks=16, dtype="float32")
    assert llm32.engine.runner.model.embed_tokens.weight.dtype == torch.float32


def test_abort_inside_stream_ends_the_stream(llm):
    seen = []
    for out in llm.stream(
        [[3, 4, 5], [6, 7]], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    ):
        seen.append((out.request_id, out.outputs[0].finish_reason))
        if out.outputs[0].finish_reason is None:
            llm.engine.abort_request(out.request_id)  # e.g. a client that went away
    assert sorted(r for r, reason in seen if reason == "abort") == sorted({r for r, _ in seen})
    assert not llm.engine.has_unfinished_requests()


def test_priorities_must_match_prompts(llm):
    with pytest.raises(ValueError, match="1 priorities for 2 prompts"):
        llm.generate([[5, 6, 7], [8, 9, 10]], GREEDY, priority=[1], use_tqdm=False)


def test_generate_waits_for_its_own_requests_only(llm):
    """Outputs of requests added beside generate (here two aborted ones, reported again in the next
    step) neither count toward its results nor replace them."""
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for prompt in ([5, 6], [7, 8]):
        llm.engine.abort_request(llm.engine.add_request(prompt, params))
    (out,) = llm.generate([[9, 10, 11]], params, use_tqdm=False)
    assert out.finished and len(out.outputs[0].token_ids) == 3


def test_final_only_outputs_come_once_and_equal_the_cumulative_last(llm):
    """vLLM's output_kind: a FINAL_ONLY request (what LLM.generate asks for) gets no output while
    it runs, and its one output is the CUMULATIVE request's last, text and metrics included."""
    engine, by_kind = llm.engine, {}
    for kind in RequestOutputKind:
        params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, output_kind=kind)
        rid = engine.add_request([3, 4, 5], params)
        outs = []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.request_id == rid]
        by_kind[kind] = outs
    final_only, cumulative = (
        by_kind[RequestOutputKind.FINAL_ONLY],
        by_kind[RequestOutputKind.CUMULATIVE],
    )
    assert len(cumulative) == 5 and len(final_only) == 1 and final_only[0].finished
    last, one = cumulative[-1], final_only[0]
    assert one.outputs[0].token_ids == last.outputs[0].token_ids
    assert one.outputs[0].text == last.outputs[0].text
    assert len(one.metrics.token_times) == len(last.metrics.token_times) == 5


def test_an_engine_freezes_the_heap_until_it_shuts_down(loaded):
    """vLLM V1's freeze_gc_heap: what is alive once the engine is built is left out of the garbage
    collector's passes between steps; shutdown() thaws it, so engines made one after another (tests,
    benchmarks) are collected."""
    gc.unfreeze()
    engine = LLM.from_loaded(loaded, dtype="float64", block_size=4, num_blocks=64).engine
    assert gc.get_freeze_count() > 0
    engine.shutdown()
    assert gc.get_freeze_count() == 0


def test_an_async_engine_dropped_without_shutdown_is_freed(loaded):
    """The heap an engine froze is out of the collector's reach, so an engine must not be a
    reference cycle: an async one (its batch queue points back at it) is freed by reference
    counting."""
    llm = LLM.from_loaded(
        loaded, dtype="float64", block_size=4, num_blocks=64, async_scheduling=True
    )
    llm.generate([[3, 4, 5]], GREEDY, use_tqdm=False)
    engine, kv_cache = weakref.ref(llm.engine), weakref.ref(llm.engine.kv_cache)
    del llm
    gc.collect()
    assert gc.get_freeze_count() > 0  # still frozen: only reference counting could free it
    # The device thread set the step's result before it returned from the step, whose frame holds
    # the executor (and through its runner the cache): on a busy machine it may not have returned
    # yet. Wait for that, not for a collector pass (the loop never calls gc).
    deadline = time.monotonic() + 30
    while (engine() is not None or kv_cache() is not None) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine() is None and kv_cache() is None
