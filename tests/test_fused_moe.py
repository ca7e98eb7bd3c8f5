"""The fused mixture of experts (model_executor/fused_moe.py) against the loop over experts, the
router against transformers', and what the engine records of each step's routing."""

from functools import partial

import pytest
import torch
import torch.nn.functional as F
import transformers

from minicb import LLM, SamplingParams
from minicb.model_executor.fused_moe import (
    fused_moe,
    grouped_mm_supported,
    moe_loop,
    select_experts,
    sort_by_expert,
    tokens_per_expert,
)
from minicb.model_executor.gpt_oss import GptOssRouter, gpt_oss_weights, swigluoai
from minicb.model_executor.loader import load_model, save_tiny_model
from minicb.worker.graph_safety import NoHostReads

F64_METHODS = ["segments", "padded"]  # torch._grouped_mm has no float64 kernel


def problem(num_tokens, num_experts=6, top_k=2, hidden=16, inter=8, seed=0, only=None, dtype=None):
    """Random tokens and experts, and a routing: top_k distinct experts per token, drawn from
    `only` (a subset, so the others get no token) or from all of them."""
    g = torch.Generator().manual_seed(seed)
    dtype = dtype or torch.float64
    x = torch.randn(num_tokens, hidden, generator=g, dtype=torch.float64)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g, dtype=torch.float64) * 0.3
    w2 = torch.randn(num_experts, hidden, inter, generator=g, dtype=torch.float64) * 0.3
    pool = torch.tensor(only if only is not None else range(num_experts))
    picks = torch.rand(num_tokens, len(pool), generator=g).argsort(dim=1)[:, :top_k]
    ids = pool[picks]
    weights = torch.rand(num_tokens, top_k, generator=g).float()
    return x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids


@pytest.mark.parametrize("method", F64_METHODS)
@pytest.mark.parametrize("num_tokens", [1, 2, 7, 33])
def test_fused_equals_the_loop_in_float64(method, num_tokens):
    x, w13, w2, weights, ids = problem(num_tokens, seed=num_tokens)
    ref = moe_loop(x, w13, w2, weights, ids)
    out = fused_moe(x, w13, w2, weights, ids, method=method)
    torch.testing.assert_close(out, ref, rtol=1e-13, atol=1e-13)  # float64 rounding only


@pytest.mark.parametrize("method", F64_METHODS)
def test_experts_without_tokens_change_nothing(method):
    """Experts 0, 2 and 5 get no token: their runs are empty, their weights unread."""
    x, w13, w2, weights, ids = problem(9, only=[1, 3, 4], seed=3)
    counts = tokens_per_expert(ids, 6)
    assert counts[[0, 2, 5]].tolist() == [0, 0, 0] and counts.sum() == 9 * 2
    ref = moe_loop(x, w13, w2, weights, ids)
    w13_poisoned, w2_poisoned = w13.clone(), w2.clone()
    w13_poisoned[[0, 2, 5]] = float("nan")
    w2_poisoned[[0, 2, 5]] = float("nan")
    # NaN weights for the empty experts: nothing they compute may reach a token's output
    out = fused_moe(x, w13_poisoned, w2_poisoned, weights, ids, method=method)
    torch.testing.assert_close(out, ref, rtol=1e-13, atol=1e-13)


@pytest.mark.skipif(
    not grouped_mm_supported(torch.device("cpu"), torch.float32),
    reason="this PyTorch has no CPU torch._grouped_mm",
)
@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_grouped_mm_equals_the_loop_in_float32(num_tokens):
    # float32: the grouped kernel blocks its sums differently from F.linear (tolerance 1e-5)
    x, w13, w2, weights, ids = problem(num_tokens, only=[0, 1, 4, 5], dtype=torch.float32)
    ref = moe_loop(x, w13, w2, weights, ids)
    out = fused_moe(x, w13, w2, weights, ids, method="grouped_mm")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_sort_puts_each_experts_pairs_together_in_token_order():
    ids = torch.tensor([[2, 0], [0, 1], [2, 1]])  # token 0 picks 2 then 0, ...
    order, expert_of_row, counts = sort_by_expert(ids, 4)
    assert expert_of_row.tolist() == [0, 0, 1, 1, 2, 2]
    assert (order // 2).tolist() == [0, 1, 1, 2, 0, 2]  # tokens, in order within each expert
    assert counts.tolist() == [2, 2, 2, 0]


def test_the_static_path_holds_in_a_graph_and_the_eager_one_does_not():
    """Inside a (emulated) CUDA graph nothing may read the routing on the host: the padded path
    runs, the segment loop (one host read of the counts) is refused, and "auto" picks padded."""
    x, w13, w2, weights, ids = problem(5)
    ref = moe_loop(x, w13, w2, weights, ids)
    with NoHostReads():
        padded = fused_moe(x, w13, w2, weights, ids, method="padded")
        auto = fused_moe(x, w13, w2, weights, ids)
        with pytest.raises(RuntimeError, match="host"):
            fused_moe(x, w13, w2, weights, ids, method="segments")
    torch.testing.assert_close(padded, ref, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(auto, ref, rtol=1e-13, atol=1e-13)


def test_no_probe_inside_a_capture_decides_for_later_steps():
    """The first MoE step of an engine may be a graph's capture: the grouped kernel's probe cannot
    run there, and what it could not find out is not remembered as "unsupported"."""
    from minicb.model_executor import fused_moe as module

    saved = dict(module.GROUPED_MM_SUPPORT)
    module.GROUPED_MM_SUPPORT.clear()
    try:
        with NoHostReads():
            assert not grouped_mm_supported(torch.device("cpu"), torch.float32)
        assert module.GROUPED_MM_SUPPORT == {}
    finally:
        module.GROUPED_MM_SUPPORT.update(saved)


def test_unknown_method_is_named():
    x, w13, w2, weights, ids = problem(2)
    with pytest.raises(ValueError, match="unknown fused MoE method 'triton'"):
        fused_moe(x, w13, w2, weights, ids, method="triton")


@pytest.mark.parametrize(
    "router_class,renormalize",
    [("Qwen3MoeTopKRouter", False), ("Qwen3MoeTopKRouter", True), ("MixtralTopKRouter", True)],
)
def test_routing_is_transformers_routing(router_class, renormalize):
    """Softmax in float32, top_k, renormalized where the model says: the same experts and
    weights as transformers' routers (whose weights they cast to the model's dtype or not)."""
    config = transformers.Qwen3MoeConfig(
        hidden_size=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=renormalize
    )
    if router_class == "MixtralTopKRouter":
        config = transformers.MixtralConfig(
            hidden_size=16, num_local_experts=8, num_experts_per_tok=3
        )
    module = getattr(transformers.models, config.model_type)
    router = getattr(getattr(module, f"modeling_{config.model_type}"), router_class)(config)
    torch.nn.init.normal_(router.weight, std=1.0)
    router = router.double()
    x = torch.randn(11, 16, dtype=torch.float64)
    _, hf_weights, hf_ids = router(x)
    weights, ids = select_experts(F.linear(x, router.weight), 3, renormalize)
    assert torch.equal(ids, hf_ids)
    assert torch.equal(weights.double(), hf_weights.double())


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_the_trace_records_tokens_per_expert(tmp_path, arch):
    """Every step's record holds, per MoE layer, the tokens routed to each expert: top_k per token
    the step ran."""
    loaded = load_model(save_tiny_model(tmp_path, arch=arch, seed=1), dtype=torch.float64)
    llm = LLM.from_loaded(loaded, dtype="float64", block_size=4, num_blocks=64)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm.generate([[5, 6, 7, 8, 9], [3, 4]], params, use_tqdm=False)
    top_k, num_experts = loaded.hf_config.num_experts_per_tok, 8 if arch == "qwen3_moe" else 4
    for s in llm.engine.trace:
        assert len(s.expert_load) == loaded.hf_config.num_hidden_layers
        for layer in s.expert_load:
            assert len(layer) == num_experts
            assert sum(layer) == top_k * s.num_batched_tokens, s


def test_the_gpu_bench_moe_is_qwen3_30b_a3b():
    """The GPU bench's random:qwen3-30b-a3b has the published model's sizes: 30.5B parameters,
    3.3B active per token (8 of 128 experts), 29.9B without the embedding and the LM head."""
    from minicb.bench.gpu import RANDOM_CONFIGS
    from minicb.model_executor.model import CausalLM

    class_name, fields = RANDOM_CONFIGS["qwen3-30b-a3b"]
    config = getattr(transformers, class_name)(**fields)
    with torch.device("meta"):  # shapes only
        model = CausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    active = total - experts * (128 - 8) // 128
    embeddings = 2 * config.vocab_size * config.hidden_size
    assert round(total / 1e9, 1) == 30.5
    assert int(active / 1e8) == 33  # 3.35B, which the model card writes as 3.3B
    assert round((total - embeddings) / 1e9, 1) == 29.9


def test_dense_layers_between_moe_layers_and_renormalized_qwen3_moe(tmp_path):
    """Qwen3-MoE's config can keep some MLPs dense (mlp_only_layers, decoder_sparse_step) and
    renormalize the top-k probabilities (norm_topk_prob, as Qwen3-30B-A3B does): transformers'
    tokens, with only the MoE layers in the trace's routing."""
    from reference import greedy_reference

    from minicb.model_executor.loader import make_tiny_model

    variant = dict(num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True)
    path = save_tiny_model(tmp_path, arch="qwen3_moe", seed=3, **variant)
    hf = make_tiny_model("qwen3_moe", seed=3, **variant)
    prompts, max_tokens = [[5, 6, 7, 8, 9, 10], [3, 4], list(range(20, 45))], [12, 7, 9]
    refs = greedy_reference(hf, prompts, max_tokens)
    loaded = load_model(path, dtype=torch.float64)
    llm = LLM.from_loaded(loaded, dtype="float64", block_size=4, num_blocks=64)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert type(llm.engine.runner.model.layers[1].mlp).__name__ == "MLP"
    assert all(len(s.expert_load) == 2 for s in llm.engine.trace)  # layers 0 and 2


def test_deepseek_grouped_routing_is_transformers_routing():
    """DeepSeek-V3's router: sigmoid scores, the correction bias steering the choice only, experts
    from the best topk_group of n_group groups, renormalized and scaled: the same experts and
    weights as transformers' DeepseekV3TopkRouter, and never more groups than allowed."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from minicb.model_executor.grouped_topk import GroupedTopkRouter

    config = transformers.DeepseekV3Config(
        hidden_size=16, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2
    )
    theirs = DeepseekV3TopkRouter(config)
    torch.nn.init.normal_(theirs.weight, std=1.0)
    theirs.e_score_correction_bias.normal_(0.0, 0.5)
    ours = GroupedTopkRouter(config)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(40, 16)
    _, hf_weights, hf_ids = theirs(x)
    weights, ids = ours(x)
    hf_order, order = hf_ids.sort(dim=1), ids.sort(dim=1)  # transformers leaves them unsorted
    assert torch.equal(order.values, hf_order.values)
    # float32, and the renormalizing sum adds the same four scores in another order: 1 ulp or so
    torch.testing.assert_close(
        weights.gather(1, order.indices), hf_weights.gather(1, hf_order.indices), rtol=1e-6, atol=0
    )
    groups_used = (ids // 4).sort(dim=1).values
    assert all(len(set(row)) <= 2 for row in groups_used.tolist())
    assert torch.allclose(weights.sum(dim=1), torch.full((40,), config.routed_scaling_factor))


def test_a_deepseek_moe_layer_has_its_router_and_shared_expert(tmp_path):
    loaded = load_model(save_tiny_model(tmp_path, arch="deepseek_v3", seed=1), torch.float64)
    llm = LLM.from_loaded(loaded, dtype="float64", block_size=4, num_blocks=64)
    layers = llm.engine.runner.model.layers
    assert type(layers[0].mlp).__name__ == "MLP"  # first_k_dense_replace = 1
    moe = layers[1].mlp
    assert type(moe.gate).__name__ == "GroupedTopkRouter" and moe.shared_experts is not None
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert all(len(s.expert_load) == 1 and len(s.expert_load[0]) == 8 for s in llm.engine.trace)


# --- gpt-oss: a router with a bias, experts with biases, interleaved gate/up, clamped SwiGLU ----


def gpt_oss_experts_and_router(seed=0):
    """transformers' gpt-oss router and experts on random weights (the gate and up columns large
    enough that the clamps at swiglu_limit bite), and the state dict a checkpoint holds."""
    config = transformers.GptOssConfig(
        hidden_size=16, intermediate_size=8, num_local_experts=6, num_experts_per_tok=2
    )
    config.swiglu_limit = 1.5
    modeling = transformers.models.gpt_oss.modeling_gpt_oss
    experts, router = modeling.GptOssExperts(config), modeling.GptOssTopKRouter(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in [*experts.parameters(), *router.parameters()]:
            p.copy_(torch.randn(p.shape, generator=g))
    prefix = "model.layers.0.mlp."
    hf = {prefix + "experts." + n: p.double() for n, p in experts.named_parameters()}
    hf |= {prefix + "router." + n: p.double() for n, p in router.named_parameters()}
    return config, experts.double(), router.double(), hf


def test_gpt_oss_router_is_transformers_router():
    config, _, hf_router, hf = gpt_oss_experts_and_router()
    router = GptOssRouter(16, 6, 2).double()
    weights = gpt_oss_weights(hf)
    router.load_state_dict({n: weights[f"model.layers.0.mlp.gate.{n}"] for n in ("weight", "bias")})
    x = torch.randn(13, 16, dtype=torch.float64)
    _, hf_weights, hf_ids = hf_router(x)
    weights, ids = router(x)
    assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights)


@pytest.mark.parametrize("method", ["loop", *F64_METHODS])
def test_gpt_oss_experts_are_transformers_experts(method):
    """The checkpoint's interleaved, transposed gate_up and its biases, split and stacked as
    FusedMoE keeps them, with the clamped SwiGLU: transformers' experts' outputs, on every path."""
    config, hf_experts, _, hf = gpt_oss_experts_and_router(seed=1)
    weights = gpt_oss_weights(hf)
    x = torch.randn(9, 16, dtype=torch.float64) * 3
    ids = torch.rand(9, 6).argsort(dim=1)[:, :2]
    topk_weights = torch.rand(9, 2, dtype=torch.float64)
    gate_up = F.linear(x, weights["model.layers.0.mlp.experts.w13_weight"][0])
    assert (gate_up.abs() > config.swiglu_limit).float().mean() > 0.2  # the clamps bite
    glu = partial(swigluoai, alpha=config.swiglu_alpha, limit=config.swiglu_limit)
    stacked = [weights[f"model.layers.0.mlp.experts.{n}"] for n in ("w13_weight", "w2_weight")]
    biases = {n: weights[f"model.layers.0.mlp.experts.{n}"] for n in ("w13_bias", "w2_bias")}
    args = (x, *stacked, topk_weights, ids, glu)
    if method == "loop":
        out = moe_loop(*args, **biases)
    else:
        out = fused_moe(*args, method=method, **biases)
    torch.testing.assert_close(out, hf_experts(x, ids, topk_weights), rtol=1e-13, atol=1e-13)


def test_the_gpu_bench_qwen3_8b_has_the_published_sizes():
    """The CPU tier's GPU bench runs random:qwen3-8b: 8.2B parameters, 6.95B without the embedding
    and the LM head (Qwen3-8B's model card), 144 KiB of bf16 K/V a token."""
    from minicb.bench.gpu import RANDOM_CONFIGS
    from minicb.model_executor.hf_config import kv_bytes_per_token
    from minicb.model_executor.model import CausalLM

    class_name, fields = RANDOM_CONFIGS["qwen3-8b"]
    config = getattr(transformers, class_name)(**fields)
    with torch.device("meta"):
        model = CausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    embeddings = 2 * config.vocab_size * config.hidden_size
    assert round(total / 1e9, 1) == 8.2 and round((total - embeddings) / 1e9, 2) == 6.95
    assert kv_bytes_per_token(config, torch.bfloat16) == 144 * 2**10
