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
lengths, no boolean mask that changes a shape. Whatever the CPU saw during capture is frozen
into the graph forever. That is why decode attention gathers a fixed number of block-table
columns, ceil(max_model_len / block_size), and masks by `context_lens` instead of slicing to
the batch's longest context as the eager path may.

Why buckets and padding. One graph serves one batch size. We capture a few sizes (1, 2, 4,
8, then multiples of 16) and run a batch of B in the smallest bucket >= B. The extra rows
are padding: token 0 at position 0, context length 1, a block table full of the sink block,
so they write their K/V into the sink and read only from it; their logits are dropped.
Buckets are captured largest first into one shared memory pool: the largest graph sizes the
pool and the smaller ones, which never run at the same time, reuse its memory.

Emulation on CPU. Without CUDA, `capture` keeps the step's callable with its static buffers
and `replay` runs it eagerly on them, so every line but `torch.cuda.graph(...)` runs in the
CPU test suite. It shows that padding, bucket choice, buffer copies and sink routing are
right, and that the step depends on nothing but its buffers: the metadata's host lists hold
their capture-time values, as in a real graph, and the capture run refuses host reads and
data-dependent shapes (what a real capture would refuse or silently freeze). It does not
show that every kernel can be captured by CUDA, how the memory pool behaves, the speed-up,
or Python state that the step reads again at each replay (a real graph would not).
"""

import bisect
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .attention import AttentionMetadata, cache_locations, pad_tables
from .model_runner import host_inputs

MAX_GRAPH_BATCH = 512  # larger decode batches are compute-bound: a graph buys little there
BUCKET_STEP = 16  # bucket spacing after 8: padding wastes at most 15 rows


def batch_buckets(max_batch_size: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then multiples of 16, and max_batch_size last."""
    if not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise ValueError(f"max_batch_size must be a positive integer, got {max_batch_size!r}")
    small = [b for b in (1, 2, 4, 8) if b < max_batch_size]
    return small + list(range(16, max_batch_size, BUCKET_STEP)) + [max_batch_size]


class NoHostReads(TorchDispatchMode):
    """Inside this context, refuse the operations a CUDA graph cannot hold.

    Each one needs a tensor's value on the CPU, or gives a result whose shape depends on
    values: a capture fails on it, or freezes the value it saw. Used by the CPU emulation.
    """

    HOST_READ = "reads a tensor value on the host (.item(), int(), bool(), Python max())"
    FORBIDDEN = {  # by op name; inference mode shows `item`/`is_nonzero`, autograd mode the op below them
        "item": HOST_READ,
        "is_nonzero": HOST_READ,
        "_local_scalar_dense": HOST_READ,
        "nonzero": "has a data-dependent shape (nonzero)",
        "masked_select": "has a data-dependent shape (masked_select)",
        "_unique2": "has a data-dependent shape (unique)",
        "unique_dim": "has a data-dependent shape (unique)",
        "unique_consecutive": "has a data-dependent shape (unique_consecutive)",
        "repeat_interleave": "has a data-dependent shape (repeat_interleave)",
        "lift_fresh": "builds a tensor from Python data (torch.tensor), frozen at capture",
    }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        why = self.FORBIDDEN.get(name)
        if why is None and name.startswith("index") and len(args) > 1 and isinstance(args[1], (list, tuple)):
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
                why = "indexes with a boolean mask (data-dependent shape)"
        if why is not None:
            raise RuntimeError(f"the captured decode step {why}: {func}. A CUDA graph can hold only "
                               "device work with shapes fixed at capture.")
        return func(*args, **(kwargs or {}))


class CapturedStep:
    """One captured decode step: a torch.cuda.CUDAGraph on CUDA, the kept callable elsewhere.

    `output` is the same tensor after every replay, overwritten each time (on CUDA it is
    memory inside the graph's pool), so read it before the next replay.
    """

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
    """Runs decode-only steps through one captured graph per batch-size bucket.

    Built from a ModelRunner: shares its model weights and KV-cache tensors (no copies).
    All buckets are captured eagerly, when the runner is built (at engine start).
    """

    def __init__(self, runner, max_batch_size: int | None = None):
        config, kv_cache = runner.config, runner.kv_cache
        if config.max_blocks_per_seq is None:
            raise ValueError("CUDA-graph decode needs config.max_model_len: it fixes the block-table width")
        self.model, self.kv_cache, self.device = runner.model, kv_cache, runner.device
        self.emulated = self.device.type != "cuda"
        self.block_size = config.block_size
        self.max_blocks = config.max_blocks_per_seq  # block-table columns: ceil(max_model_len / block_size)
        self.sink_block_id, self.sink_loc = kv_cache.sink_block_id, kv_cache.sink_loc
        self.buckets = batch_buckets(min(config.max_num_seqs, max_batch_size or MAX_GRAPH_BATCH))

        # Static inputs sized for the largest bucket; a bucket's graph reads their first rows.
        n, long = self.buckets[-1], dict(dtype=torch.long, device=self.device)
        self.input_ids = torch.zeros(n, **long)  # (n,)
        self.positions = torch.zeros(n, **long)  # (n,)
        self.cache_locs = torch.zeros(n, **long)  # (n,)
        self.context_lens = torch.zeros(n, **long)  # (n,)
        self.block_tables = torch.zeros(n, self.max_blocks, **long)  # (n, max_blocks)
        self.query_start_loc = torch.arange(n + 1, **long)  # (n + 1,): one query per row, never changes

        self.pool = None if self.emulated else torch.cuda.graph_pool_handle()
        self.graphs: dict[int, CapturedStep] = {}
        self.last_bucket: int | None = None  # the bucket the last run() replayed
        self.num_replays = 0  # decode steps served by graphs so far
        self.capture_seconds = self.capture_all()

    # ------------------------------------------------------------------ capture
    def _step_fn(self, b: int):
        """The decode step of bucket b as a callable over the static buffers only."""
        meta = AttentionMetadata(
            cache_locs=self.cache_locs[:b],
            block_tables=self.block_tables[:b],
            context_lens=self.context_lens[:b],
            query_start_loc=self.query_start_loc[:b + 1],
            num_decodes=b,  # a shape, the same at every replay
            # Host lists hold capture-time (padding) values, as a graph would freeze them.
            # The decode path must never read them; tests/test_cuda_graph.py shows it would tell.
            query_start_loc_host=list(range(b + 1)),
            context_lens_host=[1] * b,
        )
        input_ids, positions = self.input_ids[:b], self.positions[:b]

        def step():
            hidden = self.model(input_ids, positions, self.kv_cache, meta)  # (b, hidden)
            return self.model.compute_logits(hidden)  # (b, vocab)

        return step

    @torch.inference_mode()
    def capture_all(self) -> float:
        """Warm up and capture every bucket, largest first. Returns the seconds it took."""
        t0 = time.perf_counter()
        self._pad(0, self.buckets[-1])  # all rows are padding: warm-ups write only the sink
        for b in reversed(self.buckets):  # largest first: it sizes the shared pool
            step = self._step_fn(b)
            step()  # warm-up outside the capture: lazy init (cuBLAS handles, workspaces) happens here
            if not self.emulated:
                torch.cuda.synchronize(self.device)
            self.graphs[b] = CapturedStep(step, self.device, self.pool)
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ replay
    def bucket_for(self, batch_size: int) -> int | None:
        """The smallest bucket that holds batch_size rows, or None (run eagerly)."""
        i = bisect.bisect_left(self.buckets, batch_size)
        return self.buckets[i] if i < len(self.buckets) and batch_size > 0 else None

    def can_run(self, out) -> bool:
        """True for a decode-only step (one sampled token per row) that fits a bucket."""
        rows = out.scheduled
        return (self.bucket_for(len(rows)) is not None
                and all(not r.is_prefill and r.num_tokens == 1 and r.do_sample for r in rows))

    def _pad(self, start: int, stop: int) -> None:
        """Make rows start..stop-1 padding: token 0 at position 0, writing and reading only the sink."""
        self.input_ids[start:stop] = 0
        self.positions[start:stop] = 0
        self.cache_locs[start:stop] = self.sink_loc
        self.context_lens[start:stop] = 1
        self.block_tables[start:stop] = self.sink_block_id

    @torch.inference_mode()
    def run(self, out) -> torch.Tensor:
        """Copy the live batch in, pad to its bucket, replay. Returns (B, vocab) logits, in row order."""
        rows, bs = out.scheduled, self.block_size
        num_rows = len(rows)
        bucket = self.bucket_for(num_rows)
        if bucket is None or not self.can_run(out):
            raise ValueError(f"not a decode-only step of 1..{self.buckets[-1]} rows: run it eagerly")
        # Host-side bookkeeping, outside the graph (Python values are fine here): the same lists the
        # eager path builds.
        h = host_inputs(out, bs)
        locs = cache_locations(h.block_tables, h.context_lens, h.query_lens, bs)
        width = max(len(t) for t in h.block_tables)  # how many columns to copy (the graph reads all of them)
        if width > self.max_blocks:
            raise ValueError(f"a block table needs {width} blocks but the graphs hold {self.max_blocks} "
                             "(ceil(max_model_len / block_size))")
        padded = pad_tables(h.block_tables, width, self.sink_block_id)

        def host(x):
            return torch.tensor(x, dtype=torch.long)  # built on the CPU; copy_ moves it to the device

        self.input_ids[:num_rows].copy_(host(h.input_ids))
        self.positions[:num_rows].copy_(host(h.positions))
        self.cache_locs[:num_rows].copy_(host(locs))
        self.context_lens[:num_rows].copy_(host(h.context_lens))
        self.block_tables[:num_rows, :width].copy_(host(padded))
        self.block_tables[:num_rows, width:] = self.sink_block_id  # masked anyway; keep them harmless
        self._pad(num_rows, bucket)
        graph = self.graphs[bucket]
        graph.replay()
        self.last_bucket = bucket
        self.num_replays += 1
        return graph.output[:num_rows]  # (B, vocab), valid until the next replay

    def __repr__(self) -> str:
        mode = "emulated on CPU" if self.emulated else f"CUDA graphs on {self.device}"
        return (f"DecodeGraphRunner({mode}, buckets={self.buckets}, table_columns={self.max_blocks}, "
                f"captured in {self.capture_seconds:.2f} s)")
