"""CUDA graphs on a real GPU: capture, replay, parity with eager mode and transformers, and the
benchmarks.

Every test here is skipped, with a reason, where torch sees no CUDA device; the CPU emulation in
test_cuda_graph.py covers everything but the capture call itself. Run with `pytest -m gpu`.
The full W2 workload also needs Qwen3-0.6B (the local HF cache, or MINICB_W2_MODEL=/path) and `-m
"gpu and slow"`.
"""

import pytest
import torch
from test_cuda_graph import (
    MAX_TOKENS,
    PROMPTS,
    assert_replays_match_eager,
    check_graph_buckets,
    check_padded_rows_write_only_the_sink,
    generate,
    make_runner,
)
from test_ragged_attention import ragged_batch

from minicb.bench.gpu import random_model
from minicb.bench.w2 import decode_latency_by_bucket, run_w2
from minicb.engine.llm import LLM
from minicb.model_executor.attention import decode_attention
from minicb.model_executor.loader import load_model, make_tiny_model, save_tiny_model
from minicb.model_executor.paged_flash import (
    flash_pages_attention,
    page_pairs,
    pairs_attention_reference,
)
from minicb.sampling_params import SamplingParams

NO_CUDA = "needs a CUDA GPU (torch.cuda.is_available() is False)"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]


def cuda_references(hf):
    """Transformers' greedy tokens for every prompt, each run alone, on the GPU."""
    refs = []
    with torch.no_grad():
        for p, n in zip(PROMPTS, MAX_TOKENS):
            out = hf.generate(
                torch.tensor([p], device="cuda"),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
            refs.append(out[0, len(p) :].tolist())
    return refs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(path, float64 LoadedModel, transformers' greedy tokens computed on the GPU)."""
    path = save_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama", seed=1)
    hf = make_tiny_model("llama", seed=1, dtype=torch.float64).cuda()
    refs = cuda_references(hf)
    return path, load_model(path, dtype=torch.float64), refs


def test_real_graphs_match_eager_and_transformers(tiny):
    _, loaded, refs = tiny
    for config in (
        dict(block_size=16, num_blocks=64),
        dict(block_size=4, num_blocks=200, max_model_len=40),
    ):
        eager, _ = generate(loaded, device="cuda", use_cuda_graph=False, **config)
        tokens, engine = generate(loaded, device="cuda", use_cuda_graph=True, **config)
        assert not engine.runner.graph_runner.emulated, "on CUDA the graphs must be real"
        assert tokens == eager == refs
        check_graph_buckets(engine)


def test_real_replay_with_new_contents_and_sink(tiny):
    _, loaded, _ = tiny
    runner, graphs = make_runner(
        loaded, device="cuda", block_size=4, num_blocks=256, max_num_seqs=16, max_model_len=60
    )
    assert_replays_match_eager(runner, graphs, 60)
    check_padded_rows_write_only_the_sink(runner, graphs)


def test_decode_latency_by_bucket(tiny):
    path, _, _ = tiny
    rows = decode_latency_by_bucket(
        str(path), dtype="float32", context_len=64, max_batch_size=16, buckets=[1, 3, 16], iters=10
    )
    assert [(r["batch_size"], r["bucket"]) for r in rows] == [(1, 1), (3, 4), (16, 16)]
    assert all(r["eager_ms"] > 0 and r["graph_ms"] > 0 for r in rows)
    # A 2-layer model at batch 1 is all launch overhead: one replay must beat ~50 launches.
    assert rows[0]["speedup"] > 1.0, rows


def test_w2_runner_on_a_tiny_model(tiny):
    path, _, _ = tiny
    for use_graph in (False, True):
        r = run_w2(
            str(path),
            use_cuda_graph=use_graph,
            num_requests=12,
            min_len=10,
            max_len=100,
            dtype="float32",
            max_num_seqs=8,
            kv_cache_memory_bytes=64 * 2**20,
        )
        assert r["output_tokens_per_s"] > 0 and r["num_requests"] == 12
        assert (r["graph_steps"] > 0) == use_graph, r


@pytest.mark.parametrize("block_size, kv_heads, group", [(16, 2, 4), (256, 8, 2), (64, 4, 1)])
def test_flash_pages_kernel_matches_the_reference(block_size, kv_heads, group):
    """The CUDA flash kernel over (row, block) pairs against the plain-PyTorch reference and the
    padded gather."""
    q, k, v, tables, lens, sink = ragged_batch(0, 37, block_size, kv_heads, group, max_blocks=6)
    k[sink], v[sink] = 0.0, 0.0
    bf = dict(device="cuda", dtype=torch.bfloat16)
    q, k, v = q.to(**bf), k.to(**bf), v.to(**bf)
    padded = torch.tensor([t + [sink] * (7 - len(t)) for t in tables], device="cuda")
    ctx = torch.tensor(lens, device="cuda")
    pairs = page_pairs(padded, ctx, block_size, k.shape[0] * block_size)
    assert pairs.kernel.__name__ == "pairs_attention_flash"
    got = flash_pages_attention(q, k, v, pairs, 0.125)
    expected = decode_attention(q, k, v, padded, ctx, 0.125)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
    pairs.kernel = pairs_attention_reference
    torch.testing.assert_close(
        got.float(), flash_pages_attention(q, k, v, pairs, 0.125).float(), rtol=2e-2, atol=2e-2
    )


@pytest.mark.parametrize("window", [5, 40])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
def test_flash_pages_kernel_with_a_window_and_sinks_matches_the_reference(window, with_sinks):
    """Issue 39 on a GPU: pairs cut to a sliding window (their keys start inside the block) and the
    sinks' share in the combine, through the CUDA kernel, against the padded gather."""
    q, k, v, tables, lens, sink = ragged_batch(1, 37, 16, 2, 4, max_blocks=6)
    k[sink], v[sink] = 0.0, 0.0
    bf = dict(device="cuda", dtype=torch.bfloat16)
    q, k, v = q.to(**bf), k.to(**bf), v.to(**bf)
    tables = [  # a windowed group's table: blocks wholly before the window are the null block
        [sink if (j + 1) * 16 <= n - window else b for j, b in enumerate(t)]
        for t, n in zip(tables, lens)
    ]
    padded = torch.tensor([t + [sink] * (7 - len(t)) for t in tables], device="cuda")
    ctx = torch.tensor(lens, device="cuda")
    sinks = torch.randn(8, device="cuda") if with_sinks else None
    pairs = page_pairs(padded, ctx, 16, k.shape[0] * 16, sliding_window=window)
    got = flash_pages_attention(q, k, v, pairs, 0.125, sinks=sinks)
    expected = decode_attention(q, k, v, padded, ctx, 0.125, window, None, sinks)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)


def assert_flash_pages_graphs_match_eager(loaded):
    """Real graphs reading the pages in place against eager steps, in bfloat16."""
    runner, graphs = make_runner(
        loaded,
        device="cuda",
        dtype="bfloat16",
        block_size=16,
        num_blocks=256,
        max_num_seqs=16,
        max_model_len=200,
        attention_backend="flash_pages",
    )
    assert graphs.pages and not graphs.emulated
    assert_replays_match_eager(runner, graphs, 200, atol=3e-2)


def test_real_graphs_of_a_windowed_model_with_flash_pages_match_eager(tmp_path):
    """Pages cut to Mistral's window (one KV cache group: make_runner's synthetic rows carry one
    table), replayed from real graphs against eager steps, in bfloat16 (float64 parity with
    transformers, every windowed model, is test_paged_flash.py's)."""
    loaded = load_model(save_tiny_model(tmp_path, arch="mistral_window", seed=1), torch.bfloat16)
    assert_flash_pages_graphs_match_eager(loaded)


def test_real_graphs_with_flash_pages_match_eager(tiny):
    path, _, _ = tiny
    assert_flash_pages_graphs_match_eager(load_model(path, dtype=torch.bfloat16))


def test_defaults_on_cuda_size_the_cache_from_the_gpu(tiny):
    path, _, _ = tiny
    loaded = load_model(path, dtype=torch.bfloat16)
    a = LLM.from_loaded(loaded, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3)
    ea = a.engine
    assert ea.runner.attention_backend == "flash_pages" and ea.config.block_size == 256
    assert ea.memory is not None and ea.memory.num_blocks == ea.config.num_blocks > 0
    total = torch.cuda.mem_get_info()[1]
    assert 0.25 * total < ea.kv_cache.num_bytes <= 0.3 * total, ea.memory
    print("\n", ea.memory, ea.runner.graph_runner)
    # A second engine beside the first gets the same cache: its budget counts only its own memory.
    b = LLM.from_loaded(loaded, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3)
    assert abs(b.engine.config.num_blocks - ea.config.num_blocks) <= 0.01 * ea.config.num_blocks
    with pytest.raises(ValueError, match="free"):  # 0.6 of the GPU is taken: 0.9 cannot be had
        LLM.from_loaded(loaded, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.9)
    with pytest.raises(ValueError, match="weights"):
        LLM.from_loaded(loaded, device="cuda", dtype="bfloat16", gpu_memory_utilization=1e-9)
    # Flash pages and the padded gather agree on greedy tokens (bfloat16: nearly always)
    prompts = [p for p in PROMPTS[:8]]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * len(prompts)
    pages = [o.outputs[0].token_ids for o in a.generate(prompts, params, use_tqdm=False)]
    del a, b, ea
    gather = LLM.from_loaded(
        loaded,
        device="cuda",
        dtype="bfloat16",
        gpu_memory_utilization=0.3,
        attention_backend="gather",
    )
    ref = [o.outputs[0].token_ids for o in gather.generate(prompts, params, use_tqdm=False)]
    same = sum(x == y for p, r in zip(pages, ref) for x, y in zip(p, r))
    assert same >= 0.9 * sum(map(len, ref)), (pages, ref)


@pytest.mark.slow
def test_w2_random_qwen3_graphs_beat_eager():
    loaded = random_model("random:qwen3-0.6b", torch.bfloat16)
    graph = run_w2(loaded=loaded)
    eager = run_w2(loaded=loaded, use_cuda_graph=False, num_blocks=graph["num_blocks"])
    e, g = eager["output_tokens_per_s"], graph["output_tokens_per_s"]
    print(
        f"\nW2 on {graph['device']}: eager {e:.0f} tok/s, CUDA graphs {g:.0f} tok/s (x{g / e:.2f})"
    )
    # EOS ignored: the workload's exact lengths
    assert eager["output_tokens"] == graph["output_tokens"]
    assert graph["graph_steps"] > graph["steps"] // 2, (
        "most W2 steps should be decode-only graph replays"
    )
    assert g > e


def test_real_graphs_with_verify_rows_and_async_scheduling_match_transformers(tiny):
    """Issue 32 on a GPU: drafts verified as one multi-query row each, through real graphs of
    uniform verify batches; and async scheduling (the step in flight feeds the next) with graphs."""
    _, loaded, refs = tiny
    config = dict(block_size=16, num_blocks=64, device="cuda", use_cuda_graph=True)
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    tokens, engine = generate(loaded, speculative_config=spec, **config)
    assert tokens == refs and engine.runner.graph_runner.verify_graphs
    tokens, engine = generate(loaded, async_scheduling=True, **config)
    assert tokens == refs and engine.batch_queue.executor.num_placeholders > 0
    engine.shutdown()


def test_async_decode_steps_never_wait_for_the_device(tiny):
    """Issue 32: with async scheduling, step N+1's inputs are built, copied and launched while step
    N runs. torch's sync debug mode raises on anything on that path that makes the host wait for
    the device (a copy from pageable memory, .item(), .tolist() of a device tensor), which would
    fail the step; every request must still match transformers."""
    _, loaded, refs = tiny
    llm = LLM.from_loaded(
        loaded, device="cuda", max_num_seqs=16, block_size=16, num_blocks=64, async_scheduling=True
    )
    eng, finished = llm.engine, {}
    for p, n in zip(PROMPTS, MAX_TOKENS):
        eng.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))

    def step():
        finished.update((o.request_id, o.outputs[0].token_ids) for o in eng.step() if o.finished)

    while eng.scheduler.waiting or any(r.num_output_tokens == 0 for r in eng.scheduler.running):
        step()  # the prefills (eager), until every request decodes
    torch.cuda.set_sync_debug_mode("error")
    try:
        while eng.has_unfinished_requests():
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    eng.shutdown()
    assert [finished[str(i)] for i in range(len(PROMPTS))] == refs
    assert eng.runner.graph_runner.num_replays > 0


def test_the_profiler_groups_a_graph_replays_kernels_by_its_launch():
    """bench --workload idle tells a graph's own gaps from the gaps between steps by the
    correlation id a replay's kernels share (idle_split): three replays of a 24-kernel graph, with
    a kernel launched eagerly between them, must come out as three replays."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from minicb.bench.gpu_step import idle_split

    x = torch.ones(1024, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x
        for _ in range(24):
            y = y * 1.0001
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            graph.replay()
            x.add_(1)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    by = lambda key: idle_split([(e.time_range.start, e.time_range.end, key(e)) for e in events])
    found = {
        "id": by(lambda e: e.id)["graph_replays"],
        "linked": by(lambda e: getattr(e, "linked_correlation_id", 0))["graph_replays"],
    }
    assert 3 in found.values(), found


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_real_graphs_match_eager_and_transformers(tmp_path, arch):
    """A mixture of experts in float64 on CUDA: no grouped kernel for float64, so the captured steps
    run the padded path and eager steps the segment loop; both give transformers' tokens."""
    path = save_tiny_model(tmp_path, arch=arch, seed=1)
    hf = make_tiny_model(arch, seed=1, dtype=torch.float64).cuda()
    refs = cuda_references(hf)
    loaded = load_model(path, dtype=torch.float64)
    eager, _ = generate(loaded, device="cuda", use_cuda_graph=False, block_size=16, num_blocks=64)
    tokens, engine = generate(
        loaded, device="cuda", use_cuda_graph=True, block_size=16, num_blocks=64
    )
    assert not engine.runner.graph_runner.emulated
    assert tokens == eager == refs
    assert all(s.expert_load is not None for s in engine.trace)


def test_fused_moe_grouped_mm_on_cuda_matches_the_loop():
    """bf16 on the GPU: torch._grouped_mm where this GPU has it, else the segment loop; against
    the loop over experts with bf16's tolerance (2e-2: outputs of order 1, 8 bits of mantissa)."""
    from minicb.model_executor.fused_moe import fused_moe, grouped_mm_supported, moe_loop

    g = torch.Generator(device="cuda").manual_seed(0)
    kw = dict(device="cuda", dtype=torch.bfloat16, generator=g)
    x = torch.randn(64, 256, **kw)
    w13 = torch.randn(16, 2 * 128, 256, **kw) * 0.05
    w2 = torch.randn(16, 256, 128, **kw) * 0.05
    ids = torch.rand(64, 16, device="cuda", generator=g).argsort(dim=1)[:, :4]
    weights = torch.rand(64, 4, device="cuda", generator=g)
    print("grouped_mm on this GPU in bf16:", grouped_mm_supported(x.device, x.dtype))
    ref = moe_loop(x, w13, w2, weights, ids).float()
    torch.testing.assert_close(
        fused_moe(x, w13, w2, weights, ids).float(), ref, atol=2e-2, rtol=2e-2
    )


def test_tier_copies_run_on_their_own_stream_and_keep_what_the_step_wrote():
    """Issue 39: the CPU tier's copies on CUDA. An offload must copy what the step's stream wrote
    before it, not what the step writes after it; a load must land before the step reads it; and
    neither may make the host wait: the step's stream is still busy when transfer() returns."""
    from test_attention import small_config

    from minicb.worker.kv_cache import KVCache

    cache = KVCache(small_config(), 8, 4, torch.float32, "cuda", num_offload_blocks=4)
    assert cache.tier.stream is not None and cache.tier.k.is_pinned()
    cache.k.normal_(), cache.v.normal_()
    five_k, five_v = cache.k[:, 5].cpu(), cache.v[:, 5].cpu()
    torch.cuda._sleep(200_000_000)  # the step's stream busy for a while
    cache.k[:, 1].fill_(7.0)  # the step writes block 1, then the engine evicts it
    cache.transfer(offload=[(1, 0), (5, 3)], swap_out=[], copy=[], swap_in=[], load=[])
    assert not torch.cuda.current_stream().query()  # the host did not wait
    cache.k[:, 1].fill_(-1.0), cache.v[:, 5].fill_(-1.0)  # the next owner overwrites them
    cache.tier.synchronize()
    assert (cache.tier.k[0] == 7).all()
    assert torch.equal(cache.tier.k[3], five_k) and torch.equal(cache.tier.v[3], five_v)

    torch.cuda._sleep(200_000_000)
    cache.transfer(offload=[], swap_out=[], copy=[], swap_in=[], load=[(0, 2), (3, 6)])
    assert not torch.cuda.current_stream().query()
    cache.k[:, 2].mul_(2.0)  # the step reads the loaded block
    assert (cache.k[:, 2] == 14).all()
    assert torch.equal(cache.k[:, 6].cpu(), five_k) and torch.equal(cache.v[:, 6].cpu(), five_v)

    # a slot filled by one step's offload and read by the next step's load, the host waiting for
    # neither: the two copies are ordered on the tier's stream
    cache.k[:, 4].fill_(3.0)
    torch.cuda._sleep(200_000_000)
    cache.transfer(offload=[(4, 1)], swap_out=[], copy=[], swap_in=[], load=[])
    cache.transfer(offload=[], swap_out=[], copy=[], swap_in=[], load=[(1, 7)])
    assert not torch.cuda.current_stream().query()
    assert (cache.k[:, 7] == 3).all()


@pytest.mark.parametrize("extra", [{}, {"async_scheduling": True}], ids=["sync", "async"])
def test_the_cpu_tier_on_cuda_gives_the_same_tokens_and_serves_more_from_cache(tiny, extra):
    """Issue 39 on a GPU: test_kv_offload's multi-turn chat, its copies on the tier's stream."""
    from test_kv_offload import chat

    from minicb.serve.metrics import engine_stats

    _, loaded, _ = tiny
    _, expected, share_without = chat(loaded, device="cuda")  # without the tier
    tiered, answers, share = chat(loaded, device="cuda", num_offload_blocks=64, **extra)
    kv = tiered.engine.kv_cache
    assert answers == expected and share >= 2 * share_without and share > 0.3
    assert kv.tier.stream is not None
    stats = engine_stats(tiered.engine)
    assert stats["kv_offload_bytes_to_cpu"] > 0 and stats["kv_offload_bytes_to_device"] > 0
    tiered.engine.shutdown()
