"""The prefix cache's CPU tier, the worker's side: the host pool and the copies in and out of it.

core/kv_offload.py keeps the tier's books (which hash sits in which slot); this file moves the
bytes, as vLLM V1's worker-side offloading handler does (vllm/v1/kv_offload/worker/cpu_gpu.py). The
host pool has the device pool's layout, (layers of a group, slots, block_size, kv_heads, head_dim),
in pinned memory on CUDA.

On a CPU both pools are host memory, and a copy is a plain gather and scatter.

On CUDA the copies run on a stream of their own, so that neither direction makes the host wait for
the device and an offload's transfer to the host overlaps the step's forward pass:

* offload: the copy stream waits for the step's stream (every write to the evicted blocks is queued
  there), gathers the blocks into a buffer on the device, and the step's stream waits for that
  gather only. The transfer to a pinned buffer follows on the copy stream while the forward pass
  runs, and the host puts the buffer into its slots later (finish_offloads), once it has landed.
* load: the host gathers the slots into a pinned buffer (after any offload still in flight has
  landed, since a slot may have been filled a step ago), the copy stream waits for the step's
  stream (a fresh block's last owner may be in the step still running, with async scheduling) and
  copies it in, and the step's stream waits for the copy stream. A load is needed by the very step
  that asks for it, so it overlaps only what the host does before the forward pass; vLLM loads
  asynchronously and lets the request wait a step or more instead.
"""

import torch

from ..model_executor.attention import to_device


class CpuGpuOffloadingHandler:
    """The tier's host pool for one KVCache, and its copies (see the module's docstring)."""

    def __init__(self, kv_cache, num_blocks: int):
        self.kv = kv_cache
        self.num_blocks = num_blocks
        pin = kv_cache.device.type == "cuda"
        k, v = kv_cache.k, kv_cache.v
        self.k, self.v = (
            torch.zeros((t.shape[0], num_blocks, *t.shape[2:]), dtype=t.dtype, pin_memory=pin)
            for t in (k, v)
        )
        self.stream = torch.cuda.Stream(kv_cache.device) if pin and num_blocks else None
        self.in_flight: list[tuple] = []  # offloads: (done event, slots, K, V in pinned memory)

    def offload(self, pairs: list[tuple[int, int]]) -> None:
        """Copy evicted device blocks into tier slots. pairs: (device block, tier slot)."""
        if not pairs:
            return
        if self.stream is None:
            self.kv._to_host(self.k, self.v, pairs)
            return
        step_stream = torch.cuda.current_stream(self.kv.device)
        self.stream.wait_stream(step_stream)
        with torch.cuda.stream(self.stream):
            src = to_device([d for d, _ in pairs], self.kv.device)
            gathered = self.kv.k.index_select(1, src), self.kv.v.index_select(1, src)
            step_stream.wait_stream(self.stream)  # the gather, queued so far, and no more
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in gathered]
            for h, t in zip(host, gathered):
                h.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        slots = torch.tensor([s for _, s in pairs], dtype=torch.long)
        self.in_flight.append((done, slots, *host))

    def finish_offloads(self, wait: bool = True) -> int:
        """Put offloads that have landed into their slots, oldest first (a slot filled twice keeps
        the later copy); wait=True waits for every one. Returns how many are still in flight."""
        while self.in_flight:
            done, slots, k, v = self.in_flight[0]
            if not wait and not done.query():
                break
            done.synchronize()
            self.k.index_copy_(1, slots, k)
            self.v.index_copy_(1, slots, v)
            self.in_flight.pop(0)
        return len(self.in_flight)

    def load(self, pairs: list[tuple[int, int]]) -> None:
        """Copy tier slots into fresh device blocks. pairs: (tier slot, device block)."""
        if not pairs:
            return
        if self.stream is None:
            self.kv._to_device(self.k, self.v, pairs)
            return
        self.finish_offloads()
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long)
        host = []
        for tier in (self.k, self.v):
            shape = (tier.shape[0], len(pairs), *tier.shape[2:])
            host.append(
                torch.index_select(
                    tier, 1, src, out=torch.empty(shape, dtype=tier.dtype, pin_memory=True)
                )
            )
        step_stream = torch.cuda.current_stream(self.kv.device)
        self.stream.wait_stream(step_stream)
        with torch.cuda.stream(self.stream):
            dst = to_device([d for _, d in pairs], self.kv.device)
            for pool, h in zip((self.kv.k, self.kv.v), host):
                pool.index_copy_(1, dst, h.to(self.kv.device, non_blocking=True))
        step_stream.wait_stream(self.stream)
