"""Mixtures of experts over two processes (worker/parallel.py, worker/expert_parallel.py): experts
split like dense MLPs, or kept whole with expert parallelism; both give one process's tokens through
chunked prefill and preemption, and every all-to-all and all-gather moves the bytes the routing
says it must."""

import pytest
import torch
import torch.distributed as dist

# tensor parallelism's workload: chunked prompts, mixed steps, preemption, seeded samples
from test_tensor_parallel import PARAMS, PROMPTS, TIGHT

from minicb import LLM
from minicb.model_executor.loader import load_model, make_tiny_model, save_tiny_model
from minicb.model_executor.tiny_models import tiny_config
from minicb.model_executor.weights import per_expert_names
from minicb.worker.expert_parallel import token_shares
from minicb.worker.parallel import check_tensor_parallel, shard_config, shard_state_dict


def test_token_shares_split_like_tensor_split():
    for t in range(0, 12):
        for n in (1, 2, 3, 4):
            sizes = [len(c) for c in torch.arange(t).tensor_split(n)]
            bounds = token_shares(t, n)
            assert [b - a for a, b in zip(bounds, bounds[1:])] == sizes


def test_refusals_name_the_numbers():
    dense = tiny_config("llama")
    with pytest.raises(ValueError, match="enable_expert_parallel needs a mixture-of-experts"):
        check_tensor_parallel(dense, 2, expert_parallel=True)
    moe = tiny_config("qwen3_moe", num_experts=6, moe_intermediate_size=33, num_key_value_heads=4)
    with pytest.raises(ValueError, match="must divide num_experts=6 with enable_expert_parallel"):
        check_tensor_parallel(moe, 4, expert_parallel=True)
    with pytest.raises(ValueError, match="experts' intermediate size 33"):
        check_tensor_parallel(moe, 2)
    check_tensor_parallel(moe, 2, expert_parallel=True)  # whole experts: 33 need not split


def test_expert_shards_put_back_together_are_the_experts():
    hf = make_tiny_model("mixtral", seed=2)
    sd = per_expert_names(hf.state_dict())  # Mixtral's w1/w3/w2, by the names every family shares
    shards = [shard_state_dict(hf.state_dict(), r, 2, hf.config) for r in range(2)]
    for layer in range(2):
        for e in range(4):
            rank, local = divmod(e, 2)  # 4 experts: rank 0 holds 0-1, rank 1 holds 2-3
            for proj in ("gate_proj", "up_proj", "down_proj"):
                whole = sd[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"]
                mine = shards[rank][f"model.layers.{layer}.mlp.experts.{local}.{proj}.weight"]
                assert torch.equal(mine, whole)
        router = f"model.layers.{layer}.mlp.gate.weight"
        assert all(torch.equal(s[router], sd[router]) for s in shards)  # every rank routes
    local = shard_config(hf.config, 2, expert_parallel=True)
    assert (local.ep_size, local.intermediate_size, local.num_attention_heads) == (2, 128, 2)
    assert shard_config(hf.config, 2).intermediate_size == 64  # split experts: half of each


def test_gpt_oss_shards_put_back_together_are_its_sinks_and_experts():
    """gpt-oss keeps its experts stacked, gate and up interleaved, with biases: split like a dense
    MLP, the shards rebuild them (the down projection's bias counted once); kept whole, each rank
    holds E / 2 of them; either way a rank holds the sinks of its own heads."""
    hf = make_tiny_model("gpt_oss", seed=2)
    sd = hf.state_dict()
    split = [shard_state_dict(sd, r, 2) for r in range(2)]
    whole = [shard_state_dict(sd, r, 2, hf.config) for r in range(2)]
    experts = "model.layers.0.mlp.experts."
    cat = lambda shards, name, dim: torch.cat([s[name] for s in shards], dim=dim)
    for shards in (split, whole):
        assert torch.equal(
            cat(shards, "model.layers.0.self_attn.sinks", 0), sd["model.layers.0.self_attn.sinks"]
        )
    for name, dim in (("gate_up_proj", -1), ("gate_up_proj_bias", -1), ("down_proj", 1)):
        assert torch.equal(cat(split, experts + name, dim), sd[experts + name])
        assert torch.equal(cat(whole, experts + name, 0), sd[experts + name])
    bias = experts + "down_proj_bias"
    assert torch.equal(split[0][bias] + split[1][bias], sd[bias]) and not split[1][bias].any()
    router = "model.layers.0.mlp.router.weight"
    assert all(torch.equal(s[router], sd[router]) for s in split + whole)
    local = shard_config(hf.config, 2, expert_parallel=True)
    assert local.intermediate_size == hf.config.intermediate_size  # whole experts
    assert shard_config(hf.config, 2).intermediate_size == hf.config.intermediate_size // 2


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "gpt_oss"])
def loaded(request, tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param, seed=4)
    return load_model(path, dtype=torch.float64)


@pytest.fixture(scope="module")
def expected(loaded):
    one = LLM.from_loaded(loaded, preemption_mode="recompute", **TIGHT)
    return [o.outputs[0].token_ids for o in one.generate(PROMPTS, PARAMS, use_tqdm=False)]


def run_two(loaded, **config):
    two = LLM.from_loaded(loaded, tensor_parallel_size=2, **TIGHT, **config)
    try:
        got = [o.outputs[0].token_ids for o in two.generate(PROMPTS, PARAMS, use_tqdm=False)]
        return got, two.engine.trace, two.engine.tp.log
    finally:
        two.engine.shutdown()
        assert not dist.is_initialized()


def test_split_experts_give_the_tokens_of_one_process(loaded, expected):
    """Every expert split in two like a dense MLP: one all-reduce per attention, one per MoE."""
    got, trace, log = run_two(loaded)
    assert got == expected
    hidden, layers = loaded.hf_config.hidden_size, loaded.hf_config.num_hidden_layers
    for record, payloads in zip(trace, log.steps):
        tokens = record.num_batched_tokens
        assert payloads == [tokens * hidden * 8] * (2 * layers), record.step
    assert not any(log.all_to_all) and not any(log.all_gather)


def test_expert_parallel_gives_the_tokens_of_one_process_and_the_bytes_of_its_routing(
    loaded, expected
):
    """Whole experts on each rank: the same tokens through chunked prefill and preemption, and
    each step's collectives, as rank 0 logged them, equal to what the recorded routing implies:
    per MoE layer, a dispatch of rank 0's pairs bound for rank 1's experts, a combine of the
    pairs rank 1 sent to rank 0's, hidden x 8 bytes a row, and an all-gather of one share."""
    got, trace, log = run_two(loaded, enable_expert_parallel=True, preemption_mode="swap")
    assert got == expected
    assert any(r.swapped_out for r in trace), "the test must preempt"
    assert any(r.num_prefill_rows and r.num_decode_rows for r in trace), "and mix steps"
    cfg = loaded.hf_config
    hidden, layers, top_k = cfg.hidden_size, cfg.num_hidden_layers, cfg.num_experts_per_tok
    row = hidden * 8
    crossed = 0
    for record, reduces, to_all, gathers in zip(trace, log.steps, log.all_to_all, log.all_gather):
        tokens = record.num_batched_tokens
        if not tokens:
            continue
        assert reduces == [tokens * row] * layers  # attention's o_proj only
        assert len(record.expert_traffic) == layers
        expected_to_all = []
        for traffic in record.expert_traffic:
            assert sum(map(sum, traffic)) == tokens * top_k  # every pair goes somewhere
            shares = token_shares(tokens, 2)
            assert [sum(r) for r in traffic] == [
                top_k * (b - a) for a, b in zip(shares, shares[1:])
            ]
            expected_to_all += [traffic[0][1] * row, traffic[1][0] * row]
            crossed += traffic[0][1] + traffic[1][0]
        assert to_all == expected_to_all, record.step
        assert gathers == [-(-tokens // 2) * row] * layers
        for rank_load, traffic in zip(record.tokens_per_rank(2), record.expert_traffic):
            for d in range(2):  # the traffic into a rank is the load of its experts
                assert traffic[0][d] + traffic[1][d] == rank_load[d]
    assert crossed > 0, "no token crossed ranks: the test did not test the all-to-all"
