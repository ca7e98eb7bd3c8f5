"""The machine's floor for a workload (minicb/bench/floor.py): FLOPs counted right, both floors, the
table's 'of floor' column."""

import collections

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from minicb.bench import floor
from minicb.model_executor.attention import AttentionMetadata
from minicb.model_executor.cpu_kernels import (
    PackedLinear,
    linear_shapes,
    onednn_linear_available,
    use_kernels,
)
from minicb.model_executor.loader import load_model, save_tiny_model
from minicb.model_executor.model import CausalLM
from minicb.worker.kv_cache import KVCache


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model(
        save_tiny_model(tmp_path_factory.mktemp("m"), arch="llama", seed=3), dtype=torch.float32
    )


def test_layer_and_lm_head_flops_equal_what_the_model_multiplies(loaded):
    """One prefill of p tokens, logits of its last one: the matmuls PyTorch counts in minicb's own
    model are 2 x non-embedding params per token (less the norms, which are no matmul) and 2 x LM
    head params once."""
    model = CausalLM.from_hf(loaded.hf_config, loaded.state_dict, torch.float32, "cpu")
    cache = KVCache(loaded.hf_config, 8, 4, torch.float32, "cpu")
    p = 11
    meta = AttentionMetadata.build([list(range(3))], [p], [p], 0, 4, cache.sink_block_id)
    counter = FlopCounterMode(display=False)
    with counter, torch.inference_mode():
        hidden = model(torch.arange(p) + 3, torch.arange(p), cache, meta)
        model.compute_logits(hidden[-1:])
    counted = counter.get_total_flops()
    sizes = floor.model_sizes(loaded)
    norms = sum(t.numel() for n, t in loaded.state_dict.items() if "norm" in n)
    linear = 2 * (sizes["non_embedding"] - norms) * p + 2 * sizes["lm_head"]
    # what the counter saw of attention (p x p scores: no causal halving)
    attention = counted - linear
    assert attention == 4 * sizes["attention_width"] * sizes["layers"] * p * p
    # the workload count: prompt p, one output token -> only the prompt passes the layers, one LM
    # head row
    flops = floor.workload_flops(loaded, [p], [1])
    assert flops["layers"] == 2 * sizes["non_embedding"] * p
    assert flops["lm_head"] == 2 * sizes["lm_head"]
    # causal
    assert flops["attention"] == 4 * sizes["attention_width"] * sizes["layers"] * p * (p + 1) // 2


def test_attention_pairs_follow_each_tokens_real_context(loaded):
    sizes = floor.model_sizes(loaded)
    prompts, outs = [3, 5], [4, 1]
    # every fed position
    pairs = sum(j + 1 for p, o in zip(prompts, outs) for j in range(p + o - 1))
    flops = floor.workload_flops(loaded, prompts, outs)
    assert flops["attention"] == 4 * sizes["attention_width"] * sizes["layers"] * pairs
    # the last token is never fed
    assert flops["layers"] == 2 * sizes["non_embedding"] * (3 + 5 + 4 + 1 - 2)
    assert flops["total"] == flops["layers"] + flops["lm_head"] + flops["attention"]


def test_the_floor_is_the_larger_of_compute_and_the_sequential_chain(loaded):
    sizes = floor.model_sizes(loaded)
    total = floor.workload_flops(loaded, [10] * 4, [2, 2, 2, 50])["total"]
    slow_gemm = floor.workload_floor(
        loaded, [10] * 4, [2, 2, 2, 50], gemm_peak_flops=total / 7.0, bandwidth=1e12
    )
    assert slow_gemm["binding"] == "compute" and slow_gemm["floor_s"] == pytest.approx(7.0)
    slow_memory = floor.workload_floor(
        loaded,
        [10] * 4,
        [2, 2, 2, 50],
        gemm_peak_flops=1e15,
        bandwidth=sizes["weight_bytes"] * 50 / 3.0,
    )
    assert slow_memory["binding"] == "sequential" and slow_memory["floor_s"] == pytest.approx(3.0)


def test_memory_bandwidth_is_measured():
    bw = floor.memory_bandwidth(nbytes=16 * 2**20, repeats=2)
    assert 1e8 < bw < 1e13  # between 0.1 GB/s and 10 TB/s: a real measurement of a real machine


def test_workload_passes_batch_every_prompt_then_every_unfinished_request():
    # prompts of 3 and 5 tokens in passes of 4; outputs of 4 and 1 tokens: the first token of each
    # comes from the prefill (one LM head row per request), then decode steps 1..3 hold only the
    # 4-token request
    assert floor.workload_passes([3, 5], [4, 1], chunk=4) == [
        (4, 0),
        (4, 2),
        (1, 1),
        (1, 1),
        (1, 1),
    ]
    passes = floor.workload_passes([10] * 4, [2, 3, 3, 6], chunk=512)
    # step s holds every output longer than s
    assert passes == [(40, 4), (4, 4), (3, 3), (1, 1), (1, 1), (1, 1)]
    assert sum(n for _, n in passes) == 2 + 3 + 3 + 6  # one LM head row per output token


def test_interpolate_is_exact_at_the_points_linear_between_and_proportional_beyond():
    points = {1: 1.0, 4: 2.5, 8: 3.0}
    assert [floor.interpolate(points, x) for x in (1, 4, 8)] == [1.0, 2.5, 3.0]
    assert floor.interpolate(points, 2) == pytest.approx(1.5)
    assert floor.interpolate(points, 6) == pytest.approx(2.75)
    assert floor.interpolate(points, 16) == pytest.approx(6.0)


def test_kernel_floor_prices_each_pass_at_its_own_batch_size():
    times = {"layers": {1: 0.01, 64: 0.1, 512: 0.8}, "lm_head": {1: 0.002, 64: 0.02}}
    passes = [(512, 0), (100, 64), (64, 64), (1, 1)]
    got = floor.kernel_floor(passes, times, chain=2)
    assert got["layers_s"] == pytest.approx(0.8 + 0.1 + (0.1 + 0.7 * 36 / 448) + 0.01)
    assert got["lm_head_s"] == pytest.approx(0.02 + 0.02 + 0.002)
    assert (
        got["kernel_s"] == pytest.approx(got["layers_s"] + got["lm_head_s"]) and got["passes"] == 4
    )


def test_linear_passes_time_every_layer_linear_and_the_head_apart(loaded):
    model = CausalLM.from_hf(loaded.hf_config, loaded.state_dict, torch.float32, "cpu")
    calls = []
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(lambda mod, args, out: calls.append((mod, args[0].shape[0])))
    times = floor.time_linear_passes(model, rows=(1, 8), runs=1)
    assert set(times) == {"layers", "lm_head"} and set(times["layers"]) == {1, 8}
    assert all(t > 0 for part in times.values() for t in part.values())
    layer_calls = [(m, n) for m, n in calls if m is not model.lm_head]
    # qkv, o, gate_up, down
    assert len({id(m) for m, _ in layer_calls}) == 4 * loaded.hf_config.num_hidden_layers
    assert {n for _, n in layer_calls} == {1, 8} and {
        n for m, n in calls if m is model.lm_head
    } == {1, 8}


def test_other_arrangements_put_the_same_rows_over_the_longest_requests_chain():
    times = {"layers": {1: 0.01, 8: 0.02, 512: 0.5}, "lm_head": {1: 0.001, 8: 0.002, 512: 0.05}}
    passes = floor.workload_passes([100, 100], [4, 2])
    # 200 prompt + 4 + 2 - 2 output tokens fed
    rows, head_rows = (sum(n for n, _ in passes), sum(h for _, h in passes))
    assert (rows, head_rows) == (204, 6)
    got = floor.other_arrangements(passes, times, chain=4)
    # tail: 3 one-row passes, the other 201 layer rows and 3 head rows at the 512-row pass's cost
    # per row
    assert got["tail_s"] == pytest.approx(3 * 0.011 + 201 / 512 * 0.5 + 3 / 512 * 0.05)
    # even: 4 passes of 204 / 4 rows and 6 / 4 head rows each, priced by interpolation
    even_layers = 0.02 + (0.5 - 0.02) * (204 / 4 - 8) / 504
    assert got["even_s"] == pytest.approx(4 * (even_layers + 0.001 + 0.001 * 0.5 / 7))
    assert floor.kernel_floor(passes, times, chain=4)["other"] == got


@pytest.mark.skipif(not onednn_linear_available(), reason="this PyTorch has no oneDNN linear")
def test_linear_passes_time_packed_linears_and_a_tied_head_once(loaded):
    """With every shape on oneDNN (PackedLinear, a packed copy for a tied head) each linear is
    timed, once."""
    model = CausalLM.from_hf(loaded.hf_config, loaded.state_dict, torch.float32, "cpu")
    shapes = {f"{i}x{o}": {"kernel": "onednn"} for i, o in linear_shapes(model)}
    model = use_kernels(model, shapes)
    linears = [m for m in model.modules() if isinstance(m, (PackedLinear, torch.nn.Linear))]
    assert linears and all(isinstance(m, PackedLinear) for m in linears)
    calls = []
    for m in linears:
        m.register_forward_hook(lambda mod, args, out: calls.append(id(mod)))
    floor.time_linear_passes(model, rows=(2,), runs=1)
    timed = collections.Counter(calls)
    assert set(timed) == {id(m) for m in linears}  # every linear, the head included
    # each as many times as every other: none twice per pass
    assert len({n for n in timed.values()}) == 1
