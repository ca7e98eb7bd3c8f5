"""The prefix cache's CPU tier, the worker's side: the host pool and the copies in and out of it.

core/kv_offload.py keeps the tier's books (which hash sits in which slot); this file moves the
bytes, as vLLM V1's worker-side offloading handler does (vllm/v1/kv_offload/worker/cpu_gpu.py). The
host pool is slot-major, (slots, layers of a group, block_size, kv_heads, head_dim), so that one
slot, a block over every layer, is one run of bytes; on CUDA it is pinned memory, allocated once.

On a CPU both pools are host memory, and a copy is a gather and a scatter.

On CUDA the copies run on a stream of their own. Neither direction makes the host wait for the
device, the host copies no bytes itself, and an offload's transfer overlaps the step's forward pass:

* offload: the copy stream waits for the step's stream (every write to the evicted blocks is queued
  there) and gathers the blocks into one buffer on the device, slot-major; the step's stream waits
  for that gather only. The transfer into the slots follows on the copy stream, one copy per run of
  consecutive slots, while the forward pass runs.
* load: the copy stream waits for the step's stream (a fresh block's last owner may be in the step
  still running, with async scheduling), copies the slots into a buffer on the device and scatters
  it into the blocks; the step's stream waits for the copy stream. Since both directions use one
  stream, a load of a slot that an offload filled a step ago runs after that offload.

A load is needed by the very step that asks for it, so it overlaps only the host's work before the
forward pass; vLLM loads asynchronously and lets the request wait a step or more instead.
"""

import torch

from ..model_executor.attention import to_device


def runs(indices: list[int]) -> list[tuple[int, int, int]]:
    """(position in `indices`, first index, length) for each run of consecutive indices."""
    found = []
    for i, x in enumerate(indices):
        if found and x == found[-1][1] + found[-1][2] and i == found[-1][0] + found[-1][2]:
            found[-1] = (found[-1][0], found[-1][1], found[-1][2] + 1)
        else:
            found.append((i, x, 1))
    return found


class CpuGpuOffloadingHandler:
    """The tier's host pool for one KVCache's device pools `pool_k`, `pool_v` (layers of a group,
    blocks, ...), and its copies (see the module's docstring). It holds the pools, not the KVCache:
    an engine must be freed by reference counting, with no cycle (its heap is frozen)."""

    def __init__(self, pool_k: torch.Tensor, pool_v: torch.Tensor, num_blocks: int):
        self.pool_k, self.pool_v, self.device = pool_k, pool_v, pool_k.device
        self.num_blocks = num_blocks
        pin = self.device.type == "cuda"
        self.k, self.v = (
            torch.zeros((num_blocks, t.shape[0], *t.shape[2:]), dtype=t.dtype, pin_memory=pin)
            for t in (pool_k, pool_v)
        )
        self.stream = torch.cuda.Stream(self.device) if pin and num_blocks else None

    def offload(self, pairs: list[tuple[int, int]]) -> None:
        """Copy evicted device blocks into tier slots. pairs: (device block, tier slot)."""
        if not pairs:
            return
        blocks, slots = [b for b, _ in pairs], [s for _, s in pairs]
        if self.stream is None:  # on the step's stream, the host waiting (on CUDA)
            index = torch.tensor(blocks, device=self.device)
            for tier, pool in ((self.k, self.pool_k), (self.v, self.pool_v)):
                gathered = pool.index_select(1, index).transpose(0, 1).cpu()
                tier.index_copy_(0, torch.tensor(slots), gathered)
            return
        step_stream = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(step_stream)
        with torch.cuda.stream(self.stream):
            index = to_device(blocks, self.device)
            gathered = [
                pool.index_select(1, index).transpose(0, 1).contiguous()
                for pool in (self.pool_k, self.pool_v)
            ]
            step_stream.wait_stream(self.stream)  # the gather, queued so far, and no more
            for tier, g in zip((self.k, self.v), gathered):
                for i, slot, n in runs(slots):
                    tier[slot : slot + n].copy_(g[i : i + n], non_blocking=True)

    def load(self, pairs: list[tuple[int, int]]) -> None:
        """Copy tier slots into fresh device blocks. pairs: (tier slot, device block)."""
        if not pairs:
            return
        slots, blocks = [s for s, _ in pairs], [b for _, b in pairs]
        if self.stream is None:
            index = torch.tensor(blocks, device=self.device)
            for tier, pool in ((self.k, self.pool_k), (self.v, self.pool_v)):
                staged = tier.index_select(0, torch.tensor(slots)).to(self.device)
                pool.index_copy_(1, index, staged.transpose(0, 1))
            return
        step_stream = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(step_stream)
        with torch.cuda.stream(self.stream):
            index = to_device(blocks, self.device)
            for tier, pool in ((self.k, self.pool_k), (self.v, self.pool_v)):
                staged = torch.empty(
                    (len(pairs), *tier.shape[1:]), dtype=tier.dtype, device=self.device
                )
                for i, slot, n in runs(slots):
                    staged[i : i + n].copy_(tier[slot : slot + n], non_blocking=True)
                pool.index_copy_(1, index, staged.transpose(0, 1))
        step_stream.wait_stream(self.stream)

    def synchronize(self) -> None:
        """Wait until every copy queued so far has run (for a reader of the host pool)."""
        if self.stream is not None:
            self.stream.synchronize()
