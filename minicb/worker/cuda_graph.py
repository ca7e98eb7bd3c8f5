"""CUDA-graph decode: replay a recorded decode step instead of launching it kernel by kernel.

Why graphs. A decode step feeds one token per sequence, so each of its kernels (a small
matmul, a norm, a gather) finishes in microseconds. A 28-layer model launches hundreds of
them per step, and each launch costs the CPU a few microseconds of Python, PyTorch and the
CUDA driver: at small batch sizes the GPU spends most of the step waiting for the CPU. A
CUDA graph (torch.cuda.CUDAGraph) records the whole sequence of kernels once; replaying it
is one launch. Prefill steps are long matmuls and gain little, so they stay eager.

Why static shapes and buffers. A graph replays exactly the kernels it recorded, with the
memory addresses and sizes they had. So its inputs live in tensors allocated once (the
static buffers below), which we overwrite before every replay, and nothing inside the step
may depend on a value the CPU reads: no `.item()`, no Python `max()` over this step's
lengths, no boolean mask that changes a shape. Whatever the CPU saw during capture is frozen.

Why buckets, of rows and of columns. One graph serves one batch size and one block-table width
(the columns its attention reads). We capture batch sizes 1, 2, 4, 8, then multiples of 16, and
widths 1, 2, 4, ... blocks up to ceil(max_model_len / block_size) (graph_shapes), and run a step in
the smallest (rows, width) graph that holds it. Extra rows are padding: token 0 at position 0,
context length 1, a table of sink blocks, so they write and read only the sink and their logits
are dropped; extra columns are sink blocks, masked (or empty pages: 0 tokens). One width of
max_model_len made every step read the whole context width (40,960 tokens for Qwen3: on an H100
graphs ran 1.7x SLOWER than eager); a width bucket never reads twice what the step needs. Shapes
over MAX_GRAPH_TOKENS are not captured: there K/V reads outweigh launches, and the step runs
eagerly. All graphs share one memory pool, captured largest first.

Speculative decoding (vLLM V1's uniform decode batches). A row verifying k drafts is one decode
row of 1 + k query tokens (model_runner.host_inputs). With a speculative_config, graphs are captured
twice per (rows, width): for decode batches of one token a row, and for uniform verify batches, in
which every row has 1 + k tokens (vLLM's uniform_decode_query_len), each row's cache read once. A
batch of mixed query lengths (some rows with fewer drafts) runs eagerly, as in vLLM.

Emulation on CPU. Without CUDA, `capture` keeps the step's callable with its static buffers
and `replay` runs it eagerly on them, so every line but `torch.cuda.graph(...)` runs in the CPU
test suite: padding, graph choice, buffer copies and sink routing, and that the step depends on
nothing but its buffers (host lists keep their capture-time values; the capture run refuses host
reads and data-dependent shapes, graph_safety.py). It cannot show that CUDA captures every
kernel, the memory pool, the speed-up, or Python state read again at each replay.
"""

import bisect
import time
from dataclasses import replace

import torch

from ..config import cdiv
from ..model_executor.attention import AttentionMetadata, cache_locations, pad_tables
from ..model_executor.fused_moe import expert_load
from ..model_executor.paged_flash import decode_pages
from .graph_safety import NoHostReads
from .model_runner import host_inputs

MAX_GRAPH_BATCH = 512  # larger decode batches are compute-bound: a graph buys little there
BUCKET_STEP = 16  # bucket spacing after 8: padding wastes at most 15 rows
# Context a graph may attend, rows x columns x block_size tokens: batch 256 at 2,048 tokens. Past it
# a step's K/V reads (about 1 ms per layer of Qwen3-0.6B on an H100) outweigh eager launches (~1 ms
# per layer).
MAX_GRAPH_TOKENS = 256 * 2048


def batch_buckets(max_batch_size: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then multiples of 16, and max_batch_size last."""
    if not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise ValueError(f"max_batch_size must be a positive integer, got {max_batch_size!r}")
    small = [b for b in (1, 2, 4, 8) if b < max_batch_size]
    return small + list(range(16, max_batch_size, BUCKET_STEP)) + [max_batch_size]


def width_buckets(max_blocks: int) -> list[int]:
    """Block-table widths to capture: 1, 2, 4, ... and max_blocks last (a step of w columns gets <
    2w)."""
    return [1 << i for i in range(max_blocks.bit_length()) if 1 << i < max_blocks] + [max_blocks]


def graph_shapes(
    max_batch: int, max_blocks: int, block_size: int, max_tokens: int = MAX_GRAPH_TOKENS
):
    """Batch buckets, and for each the widths captured: those attending at most max_tokens, and 1
    always."""
    buckets = batch_buckets(min(max_batch, MAX_GRAPH_BATCH))
    return buckets, {
        b: [w for w in width_buckets(max_blocks) if w == 1 or b * w * block_size <= max_tokens]
        for b in buckets
    }


class CapturedStep:
    """One captured step: a torch.cuda.CUDAGraph on CUDA, the kept callable elsewhere. `output` is
    the same tensor after every replay, overwritten each time (on CUDA, in the graphs' pool): read
    it first."""

    def __init__(self, fn, device: torch.device, pool=None):
        self.emulated = device.type != "cuda"
        if self.emulated:
            self.fn = fn
            with NoHostReads():  # what a real capture would refuse, refused here too
                self.output = fn()
        else:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                self.output = fn()  # recorded, not run: the kernels write here on each replay

    def replay(self) -> None:
        if self.emulated:
            self.output.copy_(self.fn())  # same buffers in, same output tensor out
        else:
            self.graph.replay()


class DecodeGraphRunner:
    """Runs decode-only steps through one captured graph per (batch bucket, width bucket), and with
    speculative decoding per (batch bucket, width bucket) of uniform verify batches.

    Built from a ModelRunner: shares its model weights and KV-cache tensors (no copies).
    All graphs are captured eagerly, when the runner is built (at engine start).
    """

    def __init__(
        self, runner, max_batch_size: int | None = None, max_graph_tokens: int = MAX_GRAPH_TOKENS
    ):
        config = runner.config
        kv_cache = runner.kv_cache
        if config.max_blocks_per_seq is None:
            raise ValueError(
                "CUDA-graph decode needs config.max_model_len: it bounds the block-table width"
            )
        self.model = runner.model
        self.kv_cache = kv_cache
        self.device = runner.device
        self.emulated = self.device.type != "cuda"
        self.block_size = config.block_size
        # block-table columns: ceil(max_model_len / block_size)
        self.max_blocks = config.max_blocks_per_seq
        # decode reads pages in place (paged_flash.py)
        self.pages = runner.attention_backend == "flash_pages"
        self.sink_block_id = kv_cache.sink_block_id
        self.sink_loc = kv_cache.sink_loc
        self.buckets, self.widths = graph_shapes(
            min(config.max_num_seqs, max_batch_size or MAX_GRAPH_BATCH),
            self.max_blocks,
            self.block_size,
            max_graph_tokens,
        )
        spec = config.speculative_config
        # vLLM's uniform_decode_query_len: tokens per row of a verify graph (None: no drafts)
        self.verify_query_len = None if spec is None else 1 + spec.num_speculative_tokens

        # Static inputs sized for the largest bucket; a graph reads their first rows (and columns).
        n = self.buckets[-1]
        tokens = n * (self.verify_query_len or 1)
        long = dict(dtype=torch.long, device=self.device)
        self.input_ids = torch.zeros(tokens, **long)  # (tokens,)
        self.positions = torch.zeros(tokens, **long)  # (tokens,)
        self.cache_locs = torch.zeros(tokens, **long)  # (tokens,)
        self.context_lens = torch.zeros(n, **long)  # (n,)
        self.block_tables = torch.zeros(n, self.max_blocks, **long)  # (n, max_blocks)
        # KV cache groups 1, 2, ...: their own cache locations and tables (vLLM V1's
        # MultiGroupBlockTable), the same shapes
        others = range(self.kv_cache.num_groups - 1)
        self.group_cache_locs = [torch.zeros(tokens, **long) for _ in others]
        self.group_tables = [torch.zeros(n, self.max_blocks, **long) for _ in others]
        # (n + 1,): q queries per row in a graph of q-token rows, never changes
        self.query_start_loc = torch.arange(n + 1, **long)
        self.verify_start_loc = self.query_start_loc * (self.verify_query_len or 1)
        # a mixture of experts: every replay writes its tokens per expert here, the graph's
        # padding rows included (None: a dense model)
        self.expert_load = None

        self.pool = None if self.emulated else torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], CapturedStep] = {}  # (rows, columns) -> its graph
        # the same for uniform verify batches (rows of verify_query_len tokens)
        self.verify_graphs: dict[tuple[int, int], CapturedStep] = {}
        self.last_bucket: int | None = None  # the batch bucket the last run() replayed
        self.last_width: int | None = None  # and its width in block-table columns
        self.last_query_len: int | None = None  # and its tokens per row
        self.num_replays = 0  # decode steps served by graphs so far
        self.capture_seconds = self.capture_all()

    # ------------------------------------------------------------------ capture
    def _step_fn(self, b: int, w: int, q: int = 1):
        """The decode step of b rows of q tokens and w table columns as a callable over the static
        buffers only."""
        meta = AttentionMetadata(
            cache_locs=self.cache_locs[: b * q],
            block_tables=self.block_tables[:b, :w],
            context_lens=self.context_lens[:b],
            query_start_loc=(self.query_start_loc if q == 1 else self.verify_start_loc)[: b + 1],
            num_decodes=b,  # a shape, the same at every replay
            # Host lists hold capture-time (padding) values, as a graph would freeze them.
            # The decode path must never read them; tests/test_cuda_graph.py shows it would tell.
            query_start_loc_host=list(range(0, b * q + 1, q)),
            context_lens_host=[q] * b,
            num_decode_tokens=b * q,
            decode_query_len=q,  # every row has q tokens: no decode_slots
        )
        input_ids = self.input_ids[: b * q]
        positions = self.positions[: b * q]
        metas = [meta] + [
            replace(meta, cache_locs=locs[: b * q], block_tables=tables[:b, :w])
            for locs, tables in zip(self.group_cache_locs, self.group_tables)
        ]

        def step():
            if self.pages:  # each group's (row, block) pairs, computed on the device in the graph
                for m, window in zip(metas, self.kv_cache.group_windows):
                    m.pages = decode_pages(m, self.block_size, self.kv_cache.num_locations, window)
            # (b * q, hidden): the logits run after
            hidden = self.model(input_ids, positions, self.kv_cache, metas if metas[1:] else meta)
            load = expert_load(self.model)
            if load is not None:  # one static buffer that every graph overwrites
                if self.expert_load is None:
                    self.expert_load = torch.zeros_like(load)
                self.expert_load.copy_(load)
            return hidden

        return step

    def query_lens(self) -> list[int]:
        """The tokens per row that graphs are captured for: 1, and 1 + k with drafts."""
        return [1] if self.verify_query_len is None else [1, self.verify_query_len]

    @torch.inference_mode()
    def capture_all(self) -> float:
        """Warm up and capture every graph, largest first. Returns the seconds it took."""
        t0 = time.perf_counter()
        for q in reversed(self.query_lens()):  # largest first: it sizes the shared pool
            graphs = self.graphs if q == 1 else self.verify_graphs
            self._pad(0, self.buckets[-1], q)  # all rows are padding: warm-ups write only the sink
            for b in reversed(self.buckets):
                for i, w in enumerate(reversed(self.widths[b])):
                    step = self._step_fn(b, w, q)
                    # warm-up outside the capture: lazy init (cuBLAS handles, workspaces) here
                    if i == 0:
                        step()
                        if not self.emulated:
                            torch.cuda.synchronize(self.device)
                    graphs[b, w] = CapturedStep(step, self.device, self.pool)
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ replay
    def bucket_for(self, batch_size: int) -> int | None:
        """The smallest batch bucket that holds batch_size rows, or None (run eagerly)."""
        i = bisect.bisect_left(self.buckets, batch_size)
        return self.buckets[i] if i < len(self.buckets) and batch_size > 0 else None

    def graph_for(self, batch_size: int, width: int) -> tuple[int, int] | None:
        """(rows, columns) of the smallest graph holding batch_size rows of `width` table columns,
        or None."""
        b = self.bucket_for(batch_size)
        w = next((w for w in self.widths[b] if w >= width), None) if b is not None else None
        return None if w is None else (b, w)

    def uniform_query_len(self, out) -> int | None:
        """The tokens of every row if a graph was captured for it (1, or 1 + k: vLLM's uniform
        decode batch), else None: a step of mixed query lengths runs eagerly."""
        lens = {r.num_tokens for r in out.scheduled}
        q = next(iter(lens)) if len(lens) == 1 else None
        return q if q in self.query_lens() else None

    def can_run(self, out) -> bool:
        """True for a step of decode rows only, every row with the same query length (1, or 1 + k
        verifying k drafts), that fits a graph."""
        rows = out.scheduled
        bs = self.block_size
        # table columns it reads
        width = max((cdiv(r.start + r.num_tokens, bs) for r in rows), default=0)
        is_decode_only = all(not r.is_prefill and r.do_sample for r in rows)
        is_uniform = self.uniform_query_len(out) is not None
        fits = self.graph_for(len(rows), width) is not None
        return is_decode_only and is_uniform and fits

    def _pad(self, start: int, stop: int, q: int = 1) -> None:
        """Make rows start..stop-1 padding: q tokens 0 at positions 0..q-1 and context length q,
        writing and reading only the sink."""
        tokens = slice(start * q, stop * q)
        self.input_ids[tokens] = 0
        self.positions[tokens] = torch.arange(q, device=self.device).repeat(stop - start)
        self.cache_locs[tokens] = self.sink_loc
        self.context_lens[start:stop] = q
        self.block_tables[start:stop] = self.sink_block_id
        for locs, tables in zip(self.group_cache_locs, self.group_tables):
            locs[tokens], tables[start:stop] = self.sink_loc, self.sink_block_id

    @torch.inference_mode()
    def run(self, out, h=None, fill=None) -> torch.Tensor:
        """Copy the live batch in, pad to its graph, replay. Returns (num_tokens, vocab) logits, in
        row order (a verifying row of k drafts gives k + 1). `h`: the step's HostInputs, if
        made; `fill`: (positions, tokens) to write over its input ids (async scheduling)."""
        bs = self.block_size
        # Host-side bookkeeping, outside the graph (Python values are fine here): the eager path's
        # lists.
        h = h or host_inputs(out, bs)
        num_rows = len(h.context_lens)
        num_tokens = len(h.input_ids)
        width = max((len(t) for t in h.block_tables), default=0)  # the columns this step needs
        key = self.graph_for(num_rows, width) if self.can_run(out) else None
        if key is None:
            raise ValueError(
                f"not a decode-only step of 1..{self.buckets[-1]} rows, all of "
                f"{' or '.join(map(str, self.query_lens()))} tokens, of at most "
                f"{self.widths[self.buckets[0]][-1]} table columns: run it eagerly"
            )
        q = self.uniform_query_len(out)
        locs = cache_locations(h.block_tables, h.context_lens, h.query_lens, bs)

        def copy(buffer, x):  # into a static buffer, queued behind the steps before (to_device)
            host = torch.tensor(x, dtype=torch.long, pin_memory=not self.emulated)
            buffer.copy_(host, non_blocking=True)

        copy(self.input_ids[:num_tokens], h.input_ids)
        if fill is not None:  # async scheduling: tokens the step before sampled, on the device
            self.input_ids[fill[0]] = fill[1]
        copy(self.positions[:num_tokens], h.positions)
        copy(self.cache_locs[:num_tokens], locs)
        copy(self.context_lens[:num_rows], h.context_lens)
        copy(
            self.block_tables[:num_rows, :width],
            pad_tables(h.block_tables, width, self.sink_block_id),
        )
        self.block_tables[:num_rows, width:] = self.sink_block_id  # masked (or empty pages) anyway
        for group, locs, tables in zip(h.group_tables, self.group_cache_locs, self.group_tables):
            copy(locs[:num_tokens], cache_locations(group, h.context_lens, h.query_lens, bs))
            copy(tables[:num_rows, :width], pad_tables(group, width, self.sink_block_id))
            tables[:num_rows, width:] = self.sink_block_id
        if num_rows < key[0]:
            self._pad(num_rows, key[0], q)
        graph = (self.graphs if q == 1 else self.verify_graphs)[key]
        graph.replay()
        self.last_bucket, self.last_width = key
        self.last_query_len = q
        self.num_replays += 1
        # Logits outside the graph, for the live rows only: a graph's output stays allocated as long
        # as the graph, and 115 graphs' (rows, vocab) logits held 2.8 GiB on the H200; their hidden
        # states hold 20 MB.
        return self.model.compute_logits(graph.output[:num_tokens])  # (num_tokens, vocab)

    def __repr__(self) -> str:
        mode = "emulated on CPU" if self.emulated else f"CUDA graphs on {self.device}"
        verify = f" + {len(self.verify_graphs)} of {self.verify_query_len}-token rows"
        return (
            f"DecodeGraphRunner({mode}, {len(self.graphs)} graphs"
            f"{verify if self.verify_graphs else ''}: buckets={self.buckets}, "
            f"widths={self.widths[self.buckets[0]]}, captured in {self.capture_seconds:.2f} s)"
        )
