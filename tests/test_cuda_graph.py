"""CUDA-graph decode, tested on CPU through the emulation (capture keeps the callable, replay runs
it).

What a real graph would get wrong, and these tests catch: a step that depends on anything but its
static buffers (replayed with new contents, it must still match eager mode), a host read or a
data-dependent shape inside the step (refused at capture), padded rows that write outside the sink
block, and any token that differs from eager mode or from transformers' generate.
"""

import dataclasses
import random

import pytest
import torch
from reference import greedy_reference

import minicb.model_executor.model
from minicb import LLM, SamplingParams
from minicb.core.kv_cache_groups import kv_cache_groups
from minicb.core.request import Request
from minicb.core.scheduler import ScheduledRequest, SchedulerOutput
from minicb.model_executor.hf_config import sliding_window_of
from minicb.model_executor.loader import load_model, make_tiny_model, save_tiny_model
from minicb.worker.cuda_graph import DecodeGraphRunner, NoHostReads, batch_buckets, width_buckets

rng = random.Random(0)
# 16 prompts of 1..12 tokens, all prefilled in the first step with the default token budget;
# distinct output lengths 2..17 make the decode batch shrink 16, 15, ..., 1: every bucket, padded.
PROMPTS = [[rng.randrange(2, 128) for _ in range(rng.randint(1, 12))] for _ in range(16)]
MAX_TOKENS = rng.sample(range(2, 18), 16)


# ---------------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model(
        save_tiny_model(tmp_path_factory.mktemp("qwen3"), arch="qwen3", seed=2), dtype=torch.float64
    )


def make_runner(loaded, **config):
    """A ModelRunner without graphs and a DecodeGraphRunner over it, KV cache filled with noise
    so that attention results depend on every block table and context length."""
    llm = LLM.from_loaded(loaded, **{"dtype": "float64", **config, "use_cuda_graph": False})
    runner = llm.engine.runner
    generator = torch.Generator(runner.device).manual_seed(0)
    runner.kv_cache.k.normal_(generator=generator)
    runner.kv_cache.v.normal_(generator=generator)
    return runner, DecodeGraphRunner(runner)


def decode_batch(context_lens, block_size, num_blocks, seed=0) -> SchedulerOutput:
    """A decode-only step: row i feeds its token at position context_lens[i] - 1; random distinct
    blocks."""
    r = random.Random(seed)
    free = r.sample(range(num_blocks), sum(-(-c // block_size) for c in context_lens))
    rows = []
    for i, ctx in enumerate(context_lens):
        table = [free.pop() for _ in range(-(-ctx // block_size))]
        req = Request(f"r{i}", [r.randrange(128) for _ in range(ctx)], SamplingParams(max_tokens=1))
        rows.append(
            ScheduledRequest(
                req,
                start=ctx - 1,
                num_tokens=1,
                is_prefill=False,
                do_sample=True,
                block_table=table,
                slot=i,
            )
        )
    return SchedulerOutput(step=1, scheduled=rows, num_batched_tokens=len(rows))


@torch.inference_mode()
def graph_and_eager_logits(runner, graphs, out):
    """Logits of one decode step run eagerly and through the graph, from the same cache contents."""
    kv = runner.kv_cache
    k0, v0 = kv.k.clone(), kv.v.clone()
    input_ids, positions, meta, _ = runner.prepare_inputs(out)
    eager = runner.model.compute_logits(runner.model(input_ids, positions, kv, meta))
    kv.k.copy_(k0)
    kv.v.copy_(v0)
    return graphs.run(out).clone(), eager


def assert_replays_match_eager(runner, graphs, max_len, atol=1e-10):
    """Replay every batch bucket with new contents (sizes, contexts, tables) and compare with eager
    mode. The cache needs 16 * ceil(max_len / block_size) blocks."""
    bs, r = runner.config.block_size, random.Random(1)
    for size in [1, 2, 3, 4, 5, 8, 11, 16, 9]:  # 3 and 4 share a bucket, so do 11, 16 and 9
        out = decode_batch(
            [r.randint(1, max_len) for _ in range(size)], bs, runner.config.num_blocks, seed=size
        )
        graph, eager = graph_and_eager_logits(runner, graphs, out)
        assert graphs.last_bucket == graphs.bucket_for(size)
        assert graph.shape == eager.shape == (size, 128)
        torch.testing.assert_close(graph, eager, rtol=0, atol=atol)


# ---------------------------------------------------------------------------------- buckets
def test_buckets():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(1) == [1]
    with pytest.raises(ValueError, match="max_batch_size"):
        batch_buckets(0)


def test_width_buckets():
    assert width_buckets(1) == [1]
    assert width_buckets(8) == [1, 2, 4, 8]
    # Qwen3's 40,960 tokens in blocks of 256
    assert width_buckets(160) == [1, 2, 4, 8, 16, 32, 64, 128, 160]
    for n in range(
        1, 300
    ):  # a step needing w columns gets a graph of fewer than 2w: never 2x the reads
        ws = width_buckets(n)
        assert ws[-1] == n and all(min(x for x in ws if x >= w) < 2 * w for w in range(1, n + 1)), (
            n,
            ws,
        )


def test_capture_order_buffers_and_routing(loaded):
    runner, graphs = make_runner(
        loaded, block_size=4, num_blocks=100, max_num_seqs=20, max_model_len=30
    )
    assert graphs.buckets == [1, 2, 4, 8, 16, 20]
    assert list(graphs.graphs)[:5] == [(20, 8), (20, 4), (20, 2), (20, 1), (16, 8)], (
        "largest graphs first"
    )
    assert sorted(graphs.graphs) == [(b, w) for b in graphs.buckets for w in (1, 2, 4, 8)]
    assert graphs.block_tables.shape == (20, 8)  # ceil(max_model_len 30 / block_size 4) columns
    assert graphs.input_ids.shape == graphs.context_lens.shape == graphs.cache_locs.shape == (20,)
    assert graphs.model is runner.model and graphs.kv_cache is runner.kv_cache  # shared, not copied
    assert [graphs.bucket_for(n) for n in (1, 3, 5, 9, 17, 20, 21)] == [1, 4, 8, 16, 20, 20, None]
    assert "emulated" in repr(graphs)

    assert graphs.can_run(decode_batch([5] * 20, 4, 100))
    assert not graphs.can_run(decode_batch([5] * 21, 4, 100)), "above the largest bucket: eager"
    mixed = decode_batch([5, 7], 4, 100)
    mixed.scheduled[1] = dataclasses.replace(
        mixed.scheduled[1], start=3, num_tokens=4, is_prefill=True
    )
    assert not graphs.can_run(mixed), "a step with a prefill chunk runs eagerly"
    with pytest.raises(ValueError, match="eagerly"):
        graphs.run(mixed)


def test_every_bucket_is_captured_once(loaded):
    _, graphs = make_runner(loaded, block_size=16, num_blocks=64, max_num_seqs=64)
    assert graphs.buckets == [1, 2, 4, 8, 16, 32, 48, 64]
    assert sorted({b for b, _ in graphs.graphs}) == graphs.buckets and graphs.capture_seconds > 0


def test_gather_width_follows_the_context_not_max_model_len(loaded):
    """The regression of the first H100 run: graphs as wide as max_model_len made every step read
    the whole context width. Short contexts under a long max_model_len must replay a narrow
    graph."""
    runner, graphs = make_runner(
        loaded, block_size=4, num_blocks=256, max_num_seqs=8, max_model_len=256
    )
    assert graphs.max_blocks == 64 and graphs.widths[8] == [1, 2, 4, 8, 16, 32, 64]
    for lens in ([3], [5, 9, 2], [17, 1, 30, 4], [33] * 8, [200, 3]):
        out = decode_batch(lens, 4, 256, seed=len(lens))
        graph, eager = graph_and_eager_logits(runner, graphs, out)
        needed = max(-(-n // 4) for n in lens)
        assert needed <= graphs.last_width < 2 * needed, (lens, graphs.last_width)
        assert graphs.last_bucket == graphs.bucket_for(len(lens))
        torch.testing.assert_close(graph, eager, rtol=0, atol=1e-10)


def test_graph_shapes_obey_the_token_budget(loaded):
    """No graph attends more than max_graph_tokens (rows x columns x block_size); a step that needs
    more columns than its bucket's widest graph runs eagerly, never through a narrower graph that
    would cut it."""
    runner = make_runner(loaded, block_size=4, num_blocks=256, max_num_seqs=16, max_model_len=256)[
        0
    ]
    graphs = DecodeGraphRunner(runner, max_graph_tokens=16 * 4 * 4)
    assert all(b * w * 4 <= 256 or w == 1 for b, w in graphs.graphs)
    assert graphs.widths[16] == [1, 2, 4] and graphs.widths[1] == [1, 2, 4, 8, 16, 32, 64]
    assert graphs.graph_for(16, 4) == (16, 4) and graphs.graph_for(16, 5) is None
    assert graphs.graph_for(3, 9) == (4, 16) and graphs.graph_for(1, 64) == (1, 64)
    # 16 rows, one of 8 blocks: past the 16-row bucket's widest
    wide = decode_batch([30] + [3] * 15, 4, 256)
    assert not graphs.can_run(wide)
    with pytest.raises(ValueError, match="eagerly"):
        graphs.run(wide)


# ---------------------------------------------------------------------------------- graph safety
@pytest.mark.parametrize("block_size,max_len", [(4, 60), (1, 40), (16, 200)])
def test_replay_with_new_contents_matches_eager(loaded, block_size, max_len):
    runner, graphs = make_runner(
        loaded,
        block_size=block_size,
        num_blocks=16 * (max_len // block_size + 1),
        max_num_seqs=16,
        max_model_len=max_len,
    )
    assert_replays_match_eager(runner, graphs, max_len)


def narrow_to_host_max(real):
    """A regression: gather only as many blocks as the longest context, taken from a host list."""

    def paged_attention(
        q, k, v, k_cache, v_cache, meta, scale, sliding_window=None, quant=None, sinks=None
    ):
        # Python max(): frozen at capture
        width = -(-max(meta.context_lens_host) // k_cache.shape[1])
        meta = dataclasses.replace(meta, block_tables=meta.block_tables[:, :width])
        return real(q, k, v, k_cache, v_cache, meta, scale, sliding_window, quant, sinks)

    return paged_attention


def test_a_width_from_python_max_is_caught(loaded, monkeypatch):
    # Eager mode cannot see this bug (its host lists are live); the replay-with-new-contents check
    # must.
    monkeypatch.setattr(
        minicb.model_executor.model,
        "paged_attention",
        narrow_to_host_max(minicb.model_executor.model.paged_attention),
    )
    runner, graphs = make_runner(
        loaded, block_size=4, num_blocks=256, max_num_seqs=16, max_model_len=60
    )
    with pytest.raises(AssertionError, match="not close"):
        assert_replays_match_eager(runner, graphs, 60)


def width_from_item(real):
    def paged_attention(
        q, k, v, k_cache, v_cache, meta, scale, sliding_window=None, quant=None, sinks=None
    ):
        # a device value read on the host
        width = -(-int(meta.context_lens.max()) // k_cache.shape[1])
        meta = dataclasses.replace(meta, block_tables=meta.block_tables[:, :width])
        return real(q, k, v, k_cache, v_cache, meta, scale, sliding_window, quant, sinks)

    return paged_attention


def keep_live_rows(real):
    def paged_attention(
        q, k, v, k_cache, v_cache, meta, scale, sliding_window=None, quant=None, sinks=None
    ):
        out = real(q, k, v, k_cache, v_cache, meta, scale, sliding_window, quant, sinks)
        live = meta.context_lens > 1
        out[live] = out[live] * 1.0  # boolean-mask indexing: its shape depends on the data
        return out

    return paged_attention


@pytest.mark.parametrize(
    "bug,message",
    [(width_from_item, "reads a tensor value on the host"), (keep_live_rows, "boolean mask")],
)
def test_host_reads_and_dynamic_shapes_are_refused_at_capture(loaded, monkeypatch, bug, message):
    monkeypatch.setattr(
        minicb.model_executor.model,
        "paged_attention",
        bug(minicb.model_executor.model.paged_attention),
    )
    with pytest.raises(RuntimeError, match=message):
        make_runner(loaded, block_size=4, num_blocks=100, max_num_seqs=4, max_model_len=60)


@pytest.mark.parametrize("inference_mode", [True, False])  # the two modes show different op names
def test_no_host_reads_guard(inference_mode):
    x, index = torch.arange(6.0), torch.tensor([1, 2])
    with torch.inference_mode(inference_mode), NoHostReads():
        (x * 2 + x[index].sum()).softmax(0)  # device work with fixed shapes: allowed
        for forbidden in (
            lambda: x.max().item(),
            lambda: max(x),
            lambda: x.nonzero(),
            lambda: torch.tensor([1]),
        ):
            with pytest.raises(RuntimeError, match="captured decode step"):
                forbidden()


@torch.inference_mode()
def check_padded_rows_write_only_the_sink(runner, graphs):
    kv, bs = runner.kv_cache, runner.config.block_size
    for context_lens in (
        [9, 2, 17],
        [30, 1, 5, 8, 13, 21, 4, 6, 11],
    ):  # buckets 4 and 16: 1 and 7 padded rows
        out = decode_batch(context_lens, bs, runner.config.num_blocks, seed=len(context_lens))
        kv.k.normal_()  # fresh noise everywhere, the sink included, so that every write shows
        kv.v.normal_()
        k0, v0 = kv.k.clone(), kv.v.clone()
        graphs.run(out)
        assert graphs.last_bucket > len(context_lens)
        # (num_layers, num_slots, ...) -> the slots that changed in any layer, in K or V
        # (num_layers, num_slots, kv_heads * head_dim)
        diff = ((kv.k != k0) | (kv.v != v0)).flatten(1, 2).flatten(2)
        changed = diff.any(-1).any(0).nonzero().flatten().tolist()
        live = [row.block_table[row.start // bs] * bs + row.start % bs for row in out.scheduled]
        assert changed == sorted(live + [kv.sink_loc]), (
            "padding wrote outside the sink (or a live row did not write)"
        )


def test_padded_rows_write_only_the_sink(loaded):
    runner, graphs = make_runner(
        loaded, block_size=4, num_blocks=100, max_num_seqs=16, max_model_len=60
    )
    check_padded_rows_write_only_the_sink(runner, graphs)


# ---------------------------------------------------------------------------------- verify rows
SPEC = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}


def verify_batch(context_lens, num_drafts, block_size, num_blocks, seed=0) -> SchedulerOutput:
    """A decode-only step whose row i verifies num_drafts[i] drafts: one row of 1 + drafts tokens
    ending at position context_lens[i] - 1."""
    r = random.Random(seed)
    free = r.sample(range(num_blocks), sum(-(-c // block_size) for c in context_lens))
    rows = []
    for i, (ctx, d) in enumerate(zip(context_lens, num_drafts)):
        table = [free.pop() for _ in range(-(-ctx // block_size))]
        prompt = [r.randrange(128) for _ in range(ctx - d)]  # its newest token at ctx - d - 1
        req = Request(f"r{i}", prompt, SamplingParams(max_tokens=8))
        drafts = [r.randrange(128) for _ in range(d)]
        rows.append(ScheduledRequest(req, ctx - d - 1, 1 + d, False, True, table, i, drafts))
    return SchedulerOutput(step=1, scheduled=rows, num_batched_tokens=sum(num_drafts) + len(rows))


@pytest.mark.parametrize("backend", ["gather", "flash_pages"])
def test_uniform_verify_batches_replay_their_own_graphs(loaded, backend):
    """With drafts, a graph per (rows, width) also for uniform verify batches (every row 1 + k
    tokens, vLLM's uniform_decode_query_len); they match eager mode, pad with rows that write only
    the sink, and a batch of mixed draft counts runs eagerly."""
    runner, graphs = make_runner(
        loaded,
        block_size=4,
        num_blocks=300,
        max_num_seqs=16,
        max_model_len=60,
        speculative_config=SPEC,
        attention_backend=backend,
    )
    assert graphs.verify_query_len == 3 and sorted(graphs.verify_graphs) == sorted(graphs.graphs)
    assert graphs.input_ids.shape == (16 * 3,) and graphs.context_lens.shape == (16,)
    assert "of 3-token rows" in repr(graphs)
    r, kv = random.Random(2), runner.kv_cache
    for size in [1, 3, 5, 16]:
        lens = [r.randint(3, 60) for _ in range(size)]
        out = verify_batch(lens, [2] * size, 4, 300, seed=size)
        graph, eager = graph_and_eager_logits(runner, graphs, out)
        assert (graphs.last_bucket, graphs.last_query_len) == (graphs.bucket_for(size), 3)
        assert graph.shape == eager.shape == (3 * size, 128)
        torch.testing.assert_close(graph, eager, rtol=0, atol=1e-10)
    one_token = decode_batch([9, 30], 4, 300)
    graph, eager = graph_and_eager_logits(runner, graphs, one_token)
    assert graphs.last_query_len == 1
    torch.testing.assert_close(graph, eager, rtol=0, atol=1e-10)
    mixed = verify_batch([9, 30, 12], [2, 0, 1], 4, 300)
    assert not graphs.can_run(mixed), "mixed query lengths: eager, as vLLM runs them"
    with pytest.raises(ValueError, match="eagerly"):
        graphs.run(mixed)
    # padding of a verify graph: 3 live rows in the 4-row bucket
    out = verify_batch([9, 2 + 3, 17], [2, 2, 2], 4, 300, seed=5)
    with torch.inference_mode():
        kv.k.normal_()
        kv.v.normal_()
        k0, v0 = kv.k.clone(), kv.v.clone()
        graphs.run(out)
    changed = ((kv.k != k0) | (kv.v != v0)).flatten(1, 2).flatten(2).any(-1).any(0)
    live = [
        row.block_table[p // 4] * 4 + p % 4
        for row in out.scheduled
        for p in range(row.start, row.start + row.num_tokens)
    ]
    assert changed.nonzero().flatten().tolist() == sorted(live + [kv.sink_loc])


# ---------------------------------------------------------------------------------- parity
# llama: plain GQA; qwen3: q/k norms and head_dim != hidden_size / num_heads (qwen2 adds nothing
# here); the two mixtures of experts run their fused MoE's static ("padded") path inside a graph;
# mistral_window masks all but the last 8 positions inside a graph's decode attention, and
# qwen2_hybrid in its second layer only; gemma3 windows five layers of six, each layer type with
# its own RoPE table
@pytest.fixture(
    scope="module",
    params=[
        "llama",
        "qwen3",
        "mistral_window",
        "qwen2_hybrid",
        "qwen3_moe",
        "mixtral",
        "deepseek_v3",
        "gemma3",
        "gpt_oss",
    ],
)
def arch_model(request, tmp_path_factory):
    """(LoadedModel, transformers' greedy tokens for every prompt, each run alone)."""
    path = save_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param, seed=1)
    hf = make_tiny_model(request.param, seed=1, dtype=torch.float64)
    refs = greedy_reference(hf, PROMPTS, MAX_TOKENS)
    return load_model(path, dtype=torch.float64), refs


def generate(loaded, graph_batch_cap=None, **config):
    # A windowed model's KV cache groups draw their tables from one pool: each group gets the
    # blocks a config sized for one table, so all 16 requests still fit (gemma3 has 6 groups, and
    # with 100 blocks of 4 it would decode no batch of 2)
    hf = loaded.hf_config
    windows = [sliding_window_of(hf, i) for i in range(hf.num_hidden_layers)]
    config["num_blocks"] *= len(kv_cache_groups(windows))
    llm = LLM.from_loaded(loaded, dtype="float64", max_num_seqs=16, **config)
    if (
        graph_batch_cap is not None and config["use_cuda_graph"]
    ):  # fewer buckets than slots: bigger batches eager
        llm.engine.runner.graph_runner = DecodeGraphRunner(
            llm.engine.runner, max_batch_size=graph_batch_cap
        )
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert llm.engine.scheduler.block_manager.num_used_blocks == 0, "blocks leaked after the run"
    return tokens, llm.engine


def check_graph_buckets(engine, every_bucket=True):
    """Graphs ran exactly for the decode-only steps that fit a bucket; every bucket, padded rows
    too."""
    graphs = engine.runner.graph_runner
    for s in engine.trace:
        decode_only = s.rows and not any(r.is_prefill for r in s.rows)
        expected = graphs.bucket_for(len(s.rows)) if decode_only else None
        assert s.graph_bucket == expected, s
    used = {s.graph_bucket for s in engine.trace}
    if every_bucket:
        assert used - {None} == set(graphs.buckets), f"buckets {graphs.buckets} not all hit: {used}"
    else:  # e.g. prompts trickling in 8 tokens a step: the batch never gets big
        assert {1, 2, 4} <= used
    assert any(s.graph_bucket is not None and s.graph_bucket > len(s.rows) for s in engine.trace), (
        "no padded row"
    )
    assert None in used  # prefill steps ran eagerly


GRAPH_CONFIGS = {  # different block-table widths, with and without mixed prefill + decode steps
    "bs16_cols16": dict(block_size=16, num_blocks=64),
    "bs4_cols8_chunked": dict(
        block_size=4, num_blocks=100, max_model_len=32, max_num_batched_tokens=8
    ),
    "bs1_cols40": dict(block_size=1, num_blocks=600, max_model_len=40),
    "bs4_cap4": dict(block_size=4, num_blocks=100, graph_batch_cap=4),
}


@pytest.mark.parametrize("name", list(GRAPH_CONFIGS))
def test_graphs_match_eager_and_transformers(arch_model, name):
    loaded, refs = arch_model
    eager, eager_engine = generate(loaded, use_cuda_graph=False, **GRAPH_CONFIGS[name])
    assert all(s.graph_bucket is None for s in eager_engine.trace)
    tokens, engine = generate(loaded, use_cuda_graph=True, **GRAPH_CONFIGS[name])
    assert tokens == eager == refs
    check_graph_buckets(engine, every_bucket=name != "bs4_cols8_chunked")
    if name == "bs4_cap4":
        assert any(
            s.graph_bucket is None and s.num_prefill_rows == 0 and len(s.rows) > 4
            for s in engine.trace
        )
    if name == "bs4_cols8_chunked":
        assert any(s.num_prefill_rows and s.num_decode_rows for s in engine.trace), (
            "no mixed prefill + decode step"
        )


def test_use_cuda_graph_modes_on_cpu(loaded):
    def graph_runner(mode):
        llm = LLM.from_loaded(
            loaded,
            dtype="float64",
            block_size=4,
            num_blocks=20,
            max_num_seqs=2,
            use_cuda_graph=mode,
        )
        return llm.engine.runner.graph_runner

    assert graph_runner(False) is None
    assert graph_runner("auto") is None  # "auto": graphs on CUDA only, eager on CPU
    assert graph_runner(True).emulated  # True on CPU: the emulation
