"""Tensor parallelism (parallel.py): the split of every weight, the refusals, and two real processes
over gloo giving the tokens of one process, through chunked prefill and preemption, with the
collectives of every step checked against 2 x layers all-reduces of tokens x hidden values."""

import pytest
import torch
import torch.distributed as dist

from minicb import LLM, EngineConfig, SamplingParams
from minicb.model_executor.loader import load_model, save_tiny_model
from minicb.model_executor.tiny_models import tiny_config
from minicb.worker.parallel import check_tensor_parallel, shard_config, shard_state_dict


def test_splits_that_do_not_divide_the_heads_are_refused():
    cfg = tiny_config(
        "llama", num_attention_heads=8, num_key_value_heads=2, hidden_size=64, intermediate_size=96
    )
    check_tensor_parallel(cfg, 2)
    with pytest.raises(
        ValueError, match="tensor_parallel_size=3 must divide num_attention_heads=8"
    ):
        check_tensor_parallel(cfg, 3)
    with pytest.raises(
        ValueError, match="tensor_parallel_size=4 must divide num_key_value_heads=2"
    ):
        check_tensor_parallel(cfg, 4)
    smol = tiny_config(
        "llama", num_attention_heads=9, num_key_value_heads=3, hidden_size=72, intermediate_size=96
    )
    check_tensor_parallel(smol, 3)  # SmolLM2-135M's heads: it splits in 3, not in 2
    with pytest.raises(ValueError, match="num_attention_heads=9"):
        check_tensor_parallel(smol, 2)
    with pytest.raises(ValueError, match="not supported with tensor_parallel_size > 1"):
        EngineConfig(tensor_parallel_size=2, use_cuda_graph=True)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig(tensor_parallel_size=0)


def test_shards_put_back_together_are_the_weights():
    cfg = tiny_config(
        "qwen2", num_attention_heads=4, num_key_value_heads=2, hidden_size=32, intermediate_size=48
    )
    from minicb.model_executor.tiny_models import make_tiny_model

    sd = {
        k: v
        for k, v in make_tiny_model(
            "qwen2",
            seed=1,
            **dict(
                num_attention_heads=4, num_key_value_heads=2, hidden_size=32, intermediate_size=48
            ),
        )
        .state_dict()
        .items()
    }
    shards = [shard_state_dict(sd, r, 2) for r in range(2)]
    local = shard_config(cfg, 2)
    assert (
        local.num_attention_heads,
        local.num_key_value_heads,
        local.intermediate_size,
        local.head_dim,
    ) == (2, 1, 24, 8)
    for name, t in sd.items():
        kind = name.split(".")[-2]
        if kind in (
            "q_proj",
            "k_proj",
            "v_proj",
            "gate_proj",
            "up_proj",
        ):  # columns: output features
            assert torch.equal(torch.cat([s[name] for s in shards], 0), t), name
        elif kind in ("o_proj", "down_proj") and name.endswith("weight"):  # rows: input features
            assert torch.equal(torch.cat([s[name] for s in shards], 1), t), name
        else:
            assert all(torch.equal(s[name], t) for s in shards), name
    # two whole heads of 8
    assert shards[0]["model.layers.0.self_attn.q_proj.weight"].shape[0] == 2 * 8


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = save_tiny_model(
        tmp_path_factory.mktemp("tp"),
        arch="llama",
        seed=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        hidden_size=64,
        intermediate_size=96,
    )
    return load_model(path, dtype=torch.float64)


PROMPTS = [
    [5, 9, 2, 7, 1, 3, 8, 4, 6, 10, 11, 12, 13, 3, 5],
    [7] * 21,
    [9, 8, 1],
    [2, 4, 6, 8, 10, 12, 14, 16, 18],
]
PARAMS = [
    SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=9, temperature=1.0, seed=3, ignore_eos=True),
]
TIGHT = dict(
    dtype="float64", block_size=4, num_blocks=14, max_num_batched_tokens=8, max_model_len=64
)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_two_processes_give_the_tokens_of_one_through_chunking_and_preemption(loaded, mode):
    one = LLM.from_loaded(loaded, preemption_mode=mode, **TIGHT)
    expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS, PARAMS, use_tqdm=False)]

    two = LLM.from_loaded(loaded, tensor_parallel_size=2, preemption_mode=mode, **TIGHT)
    try:
        assert two.engine.kv_cache.num_kv_heads == 1  # rank 0 caches one of the 2 KV heads
        got = [o.outputs[0].token_ids for o in two.generate(PROMPTS, PARAMS, use_tqdm=False)]
        assert got == expected
        assert any(r.preempted or r.swapped_out for r in two.engine.trace), "the test must preempt"
        assert any(r.num_prefill_rows and r.num_decode_rows for r in two.engine.trace), (
            "and mix chunks with decodes"
        )
        # Collectives of every step: 2 all-reduces per layer, each of (tokens in the step) x hidden
        # x 8 bytes.
        layers, hidden = loaded.hf_config.num_hidden_layers, loaded.hf_config.hidden_size
        steps = two.engine.tp.log.steps
        assert len(steps) == len(two.engine.trace)
        for record, payloads in zip(two.engine.trace, steps):
            tokens = record.num_batched_tokens
            assert payloads == ([tokens * hidden * 8] * (2 * layers) if tokens else []), record.step
    finally:
        two.engine.shutdown()
    assert not dist.is_initialized() and not any(w.is_alive() for w in two.engine.tp.workers)


def test_tensor_parallel_doubles_the_blocks_of_a_byte_budget(loaded):
    per_rank = EngineConfig(dtype="float64", block_size=4, kv_cache_memory_bytes=2**20)
    from minicb.engine.llm_engine import resolve_config

    one = resolve_config(per_rank, loaded).num_blocks
    assert resolve_config(per_rank.replace(tensor_parallel_size=2), loaded).num_blocks == 2 * one


def test_a_worker_that_raises_leaves_no_process_group_behind(loaded):
    llm = LLM.from_loaded(loaded, tensor_parallel_size=2, **TIGHT)
    tp = llm.engine.tp
    try:
        tp.send(("explode",))  # the worker refuses an unknown message and exits through its finally
        tp.workers[0].join(30)
        assert tp.workers[0].exitcode not in (0, None)
    finally:
        llm.engine.shutdown()
    assert not dist.is_initialized()
    llm.engine.shutdown()  # twice is fine
    with pytest.raises(RuntimeError, match="shut down"):
        tp.send(("step", [], [], [], None))


def test_the_split_and_ring_figures_draw():
    from minicb.viz.parallel import ring_bytes, tp_split

    fig = tp_split(576, 9, 3, 64, 1536, 3)
    # qkv, o, gate_up, down, the legend
    assert len(fig.axes[0].patches) == 3 * 3 + 3 + 2 * 3 + 3 + 3
    assert ring_bytes([2, 4, 8]).axes[0].lines[0].get_ydata().tolist() == [1.0, 1.5, 1.75]


def test_an_fp8_cache_splits_too(loaded):
    # Scale 1.0 on every rank is scale 1.0 for every head: the same bytes as one process would
    # store.
    one = LLM.from_loaded(loaded, kv_cache_dtype="fp8", **TIGHT)
    expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS, PARAMS, use_tqdm=False)]
    two = LLM.from_loaded(loaded, tensor_parallel_size=2, kv_cache_dtype="fp8", **TIGHT)
    try:
        assert [
            o.outputs[0].token_ids for o in two.generate(PROMPTS, PARAMS, use_tqdm=False)
        ] == expected
    finally:
        two.engine.shutdown()


def test_speculative_decoding_over_two_processes_gives_the_tokens_of_one(loaded):
    """Verifying rows are one attention row per token on every rank; rank 0 verifies, the workers
    only compute."""
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 2,
        "prompt_lookup_min": 1,
    }
    greedy = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * len(PROMPTS)
    expected = [
        o.outputs[0].token_ids
        for o in LLM.from_loaded(loaded, **TIGHT).generate(PROMPTS, greedy, use_tqdm=False)
    ]
    two = LLM.from_loaded(loaded, tensor_parallel_size=2, speculative_config=spec, **TIGHT)
    try:
        assert [
            o.outputs[0].token_ids for o in two.generate(PROMPTS, greedy, use_tqdm=False)
        ] == expected
        assert any(r.num_drafts for s in two.engine.trace for r in s.rows), "no draft was verified"
    finally:
        two.engine.shutdown()


def test_async_scheduling_over_two_processes_gives_the_tokens_of_one(loaded):
    """The step in flight feeds the next one's placeholders; the workers get the tokens themselves
    (rank 0 reads them back before broadcasting the step)."""
    one = LLM.from_loaded(loaded, **TIGHT)
    expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS, PARAMS, use_tqdm=False)]
    two = LLM.from_loaded(loaded, tensor_parallel_size=2, async_scheduling=True, **TIGHT)
    try:
        got = [o.outputs[0].token_ids for o in two.generate(PROMPTS, PARAMS, use_tqdm=False)]
        assert got == expected and two.engine.batch_queue.executor.num_placeholders > 0
    finally:
        two.engine.shutdown()
