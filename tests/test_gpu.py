"""CUDA graphs on a real GPU: capture, replay, parity with eager mode and transformers, and the benchmarks.

Every test here is skipped, with a reason, where torch sees no CUDA device; the CPU emulation in
test_cuda_graph.py covers everything but the capture call itself. Run with `pytest -m gpu`.
The full W2 workload also needs Qwen3-0.6B (the local HF cache, or MINICB_W2_MODEL=/path) and `-m "gpu and slow"`.
"""

import os

import pytest
import torch

from minicb.bench.w2 import W2_MODEL, decode_latency_by_bucket, run_w2
from minicb.loader import load_model, make_tiny_model, save_tiny_model
from test_cuda_graph import (MAX_TOKENS, PROMPTS, assert_replays_match_eager, check_graph_buckets,
                             check_padded_rows_write_only_the_sink, generate, make_runner)

NO_CUDA = "needs a CUDA GPU (torch.cuda.is_available() is False)"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(path, float64 LoadedModel, transformers' greedy tokens computed on the GPU)."""
    path = save_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama", seed=1)
    hf = make_tiny_model("llama", seed=1, dtype=torch.float64).cuda()
    refs = []
    with torch.no_grad():
        for p, n in zip(PROMPTS, MAX_TOKENS):
            out = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              pad_token_id=0, eos_token_id=None)
            refs.append(out[0, len(p):].tolist())
    return path, load_model(path, dtype=torch.float64), refs


def test_real_graphs_match_eager_and_transformers(tiny):
    _, loaded, refs = tiny
    for config in (dict(block_size=16, num_blocks=64), dict(block_size=4, num_blocks=200, max_model_len=40)):
        eager, _ = generate(loaded, device="cuda", use_cuda_graph=False, **config)
        tokens, engine = generate(loaded, device="cuda", use_cuda_graph=True, **config)
        assert not engine.runner.graph_runner.emulated, "on CUDA the graphs must be real"
        assert tokens == eager == refs
        check_graph_buckets(engine)


def test_real_replay_with_new_contents_and_sink(tiny):
    _, loaded, _ = tiny
    runner, graphs = make_runner(loaded, device="cuda", block_size=4, num_blocks=256, max_num_seqs=16,
                                 max_model_len=60)
    assert_replays_match_eager(runner, graphs, 60)
    check_padded_rows_write_only_the_sink(runner, graphs)


def test_decode_latency_by_bucket(tiny):
    path, _, _ = tiny
    rows = decode_latency_by_bucket(str(path), dtype="float32", context_len=64, max_batch_size=16,
                                    buckets=[1, 3, 16], iters=10)
    assert [(r["batch_size"], r["bucket"]) for r in rows] == [(1, 1), (3, 4), (16, 16)]
    assert all(r["eager_ms"] > 0 and r["graph_ms"] > 0 for r in rows)
    # A 2-layer model at batch 1 is all launch overhead: one replay must beat ~50 launches.
    assert rows[0]["speedup"] > 1.0, rows


def test_w2_runner_on_a_tiny_model(tiny):
    path, _, _ = tiny
    for use_graph in (False, True):
        r = run_w2(str(path), use_cuda_graph=use_graph, num_requests=12, min_len=10, max_len=100,
                   dtype="float32", max_num_seqs=8, kv_cache_memory_bytes=64 * 2**20)
        assert r["output_tokens_per_s"] > 0 and r["num_requests"] == 12
        assert (r["graph_steps"] > 0) == use_graph, r


def w2_model() -> str | None:
    if os.environ.get("MINICB_W2_MODEL"):
        return os.environ["MINICB_W2_MODEL"]
    from huggingface_hub import try_to_load_from_cache

    return W2_MODEL if isinstance(try_to_load_from_cache(W2_MODEL, "config.json"), str) else None


@pytest.mark.slow
def test_w2_qwen3_with_and_without_graphs():
    model = w2_model()
    if model is None:
        pytest.skip(f"{W2_MODEL} is not in the local HF cache; set MINICB_W2_MODEL=/path/to/Qwen3-0.6B")
    loaded = load_model(model, torch.bfloat16)
    eager = run_w2(use_cuda_graph=False, loaded=loaded)
    graph = run_w2(use_cuda_graph=True, loaded=loaded)
    e, g = eager["output_tokens_per_s"], graph["output_tokens_per_s"]
    print(f"\nW2 on {graph['device']}: eager {e:.0f} tok/s, CUDA graphs {g:.0f} tok/s (x{g / e:.2f})")
    assert eager["output_tokens"] == graph["output_tokens"]  # EOS ignored: the workload's exact lengths
    assert graph["graph_steps"] > graph["steps"] // 2, "most W2 steps should be decode-only graph replays"
