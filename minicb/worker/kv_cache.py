"""The paged KV cache: fixed-size blocks of key/value entries, one pool per layer.

Idea (PagedAttention, Kwon et al., SOSP 2023, "Efficient Memory Management for Large
Language Model Serving with PagedAttention"): instead of one contiguous buffer per
request, the cache is a pool of equal blocks of `block_size` tokens. A request
owns a list of block ids (its block_table), handed out by the pure-Python
BlockManager, so memory is allocated one block at a time: any free block fits any request (no
external fragmentation), and at most the last, partly filled block of a request is wasted.

Layout, per layer: `k_caches[i]` and `v_caches[i]` have shape
(num_blocks + 1, block_size, num_kv_heads, head_dim). A token's cache location
is `block_id * block_size + offset`; viewed flat, the cache is (num_locations, kv_heads, head_dim).

The extra last block (id `num_blocks`) is the *sink*. It belongs to no request: padded
rows of a batch (CUDA-graph buckets) write their K/V into it and read only from it, so
padding can never touch a real request's cache.

CPU swap space (`num_cpu_blocks`) holds blocks of preempted requests
(preemption_mode="swap"); `swap_out` / `swap_in` copy whole blocks for all layers at once.
The cache may hold another dtype than the model computes in (kv_cache_dtype="fp8": kv_quant.py).

KV cache groups (core/kv_cache_groups.py): layer j of every group shares the j-th tensor, so there
are group_size tensors, not num_layers, and block id b is a page in each of them that belongs to
one group at a time (vLLM V1's KVCacheTensor shared_by). A block copy still copies every tensor.
"""

import torch

from ..core.kv_cache_groups import KVCacheGroupSpec, group_size_of, layer_slots
from ..model_executor.hf_config import cache_shape_of
from ..model_executor.kv_quant import KVQuant
from .kv_offload import CpuGpuOffloadingHandler


class KVCache:
    """Paged K/V tensors for every layer, plus the sink block and CPU swap space."""

    def __init__(
        self,
        hf_config,
        num_blocks: int,
        block_size: int,
        dtype,
        device,
        num_cpu_blocks: int = 0,
        cache_dtype=None,
        num_offload_blocks: int = 0,
        kv_cache_groups=None,
    ):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {num_cpu_blocks}")
        self.num_layers = hf_config.num_hidden_layers
        # KV cache groups: each layer's group (for its attention metadata) and tensor
        groups = kv_cache_groups or (KVCacheGroupSpec(tuple(range(self.num_layers))),)
        self.num_groups, self.num_slots = len(groups), group_size_of(groups)
        self.layer_group, slot_of = layer_slots(groups, self.num_layers)
        self.group_windows = [g.sliding_window for g in groups]  # decode pages are cut to them
        self.num_blocks = num_blocks  # blocks the BlockManager may hand out: ids 0..num_blocks-1
        self.block_size = block_size
        # (kv heads, K width, V width); multi-head latent attention: (1, latent width, 0)
        self.num_kv_heads, self.head_dim, self.v_head_dim = cache_shape_of(hf_config)
        self.dtype = dtype  # what attention computes in
        self.cache_dtype = cache_dtype or dtype  # what the cache holds: fewer bytes, more blocks
        if self.v_head_dim == 0 and self.cache_dtype != dtype:
            raise ValueError(
                "an fp8 KV cache is not supported with multi-head latent attention (DeepSeek-V3) "
                "yet: use kv_cache_dtype='auto'"
            )
        self.device = torch.device(device)
        # Per layer, None when the cache holds the model's dtype; else how K/V go in and out (with
        # fp8 scales)
        self.quant = [
            KVQuant(self.cache_dtype, self.device) if self.cache_dtype != dtype else None
            for _ in range(self.num_layers)
        ]
        # fp8 bytes are kept as uint8
        storage = self.quant[0].storage_dtype() if self.quant[0] else dtype
        self.num_cpu_blocks = num_cpu_blocks
        self.sink_block_id = num_blocks  # the extra block at the end
        self.sink_loc = self.sink_block_id * block_size  # the sink's first cache location
        # rows of the flat (locations, kv_heads, head_dim) view
        self.num_locations = (num_blocks + 1) * block_size

        # One tensor for all layers, so that swapping a set of blocks is one
        # index_select over dim 1 instead of a loop over layers.
        # (num_slots, num_blocks + 1, block_size, kv_heads, head_dim): one slot per layer of a group
        block_shape = (block_size, self.num_kv_heads, self.head_dim)
        v_block_shape = (block_size, self.num_kv_heads, self.v_head_dim)
        # zeros, not empty: padded rows read the sink, and although their attention weights on it
        # are masked to 0, 0 * NaN from uninitialised memory would still be NaN.
        self.k = torch.zeros(
            (self.num_slots, num_blocks + 1, *block_shape), dtype=storage, device=self.device
        )
        pools = (self.num_slots, num_blocks + 1)
        self.v = torch.zeros((*pools, *v_block_shape), dtype=storage, device=self.device)
        self.k_caches = [self.k[slot] for slot in slot_of]  # views, one per layer
        self.v_caches = [self.v[slot] for slot in slot_of]

        # Pinned host memory makes device <-> host copies fast (and possible to overlap).
        pin = self.device.type == "cuda"
        cpu_shape = (self.num_slots, num_cpu_blocks, *block_shape)
        cpu_v_shape = (self.num_slots, num_cpu_blocks, *v_block_shape)
        self.cpu_k = torch.zeros(cpu_shape, dtype=storage, device="cpu", pin_memory=pin)
        self.cpu_v = torch.zeros(cpu_v_shape, dtype=storage, device="cpu", pin_memory=pin)
        # the prefix cache's CPU tier (core/kv_offload.py): copies of evicted prefix blocks, in a
        # host pool of their own, moved on a stream of their own on CUDA (kv_offload.py)
        self.num_offload_blocks = num_offload_blocks
        self.tier = CpuGpuOffloadingHandler(self.k, self.v, num_offload_blocks)

    @property
    def num_bytes(self) -> int:
        """Bytes of device memory held by the K and V pools (sink block included)."""
        return (self.k.numel() + self.v.numel()) * self.k.element_size()

    def _check_ids(self, ids: list[int], limit: int, what: str) -> None:
        for i in ids:
            if not 0 <= i < limit:
                raise ValueError(f"{what} block id {i} is out of range: expected 0 <= id < {limit}")

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to CPU blocks, all layers at once. pairs: (gpu_block, cpu_block)."""
        self._check_ids([g for g, _ in pairs], self.num_blocks, "gpu")  # the sink never swaps
        self._check_ids([c for _, c in pairs], self.num_cpu_blocks, "cpu")
        self._to_host(self.cpu_k, self.cpu_v, pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy CPU blocks back to device blocks, all layers at once. pairs: (cpu_block,
        gpu_block)."""
        self._check_ids([c for c, _ in pairs], self.num_cpu_blocks, "cpu")
        self._check_ids([g for _, g in pairs], self.num_blocks, "gpu")
        self._to_device(self.cpu_k, self.cpu_v, pairs)

    def _to_host(self, host_k, host_v, pairs: list[tuple[int, int]]) -> None:
        """(device block, host block) pairs: gathered on the device, then one transfer per pool."""
        if not pairs:
            return
        src = torch.tensor([d for d, _ in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([h for _, h in pairs], dtype=torch.long)
        # (num_slots, len(pairs), block_size, kv_heads, head_dim)
        host_k.index_copy_(1, dst, self.k.index_select(1, src).cpu())
        host_v.index_copy_(1, dst, self.v.index_select(1, src).cpu())

    def _to_device(self, host_k, host_v, pairs: list[tuple[int, int]]) -> None:
        """(host block, device block) pairs."""
        if not pairs:
            return
        src = torch.tensor([h for h, _ in pairs], dtype=torch.long)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.device)
        self.k.index_copy_(1, dst, host_k.index_select(1, src).to(self.device))
        self.v.index_copy_(1, dst, host_v.index_select(1, src).to(self.device))

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over every layer: what one tier copy moves."""
        return (self.k[:, 0].numel() + self.v[:, 0].numel()) * self.k.element_size()

    def transfer(self, offload, swap_out, copy, swap_in, load) -> None:
        """A step's block copies, before its forward pass, in the one order that is safe: evicted
        blocks leave for the tier and swapped-out blocks for swap space before anything overwrites
        them; a copy-on-write source freed this step may be the target of a swap-in; loads fill
        fresh blocks last."""
        self.tier.offload(offload)
        self.swap_out(swap_out)
        self.copy_blocks(copy)
        self.swap_in(swap_in)
        self.tier.load(load)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: device block src to device block dst, all layers at once. pairs: (src,
        dst)."""
        if not pairs:
            return
        src_ids, dst_ids = [s for s, _ in pairs], [d for _, d in pairs]
        self._check_ids(src_ids + dst_ids, self.num_blocks, "gpu")
        src = torch.tensor(src_ids, dtype=torch.long, device=self.device)
        dst = torch.tensor(dst_ids, dtype=torch.long, device=self.device)
        self.k.index_copy_(1, dst, self.k.index_select(1, src))
        self.v.index_copy_(1, dst, self.v.index_select(1, src))

    def __repr__(self) -> str:
        mib = self.num_bytes / 2**20
        # multi-head latent attention: the latent is its own value
        v_width = "" if self.v_head_dim == self.head_dim else f" (values {self.v_head_dim})"
        return (
            f"KVCache(layers={self.num_layers}, groups={self.num_groups} x {self.num_slots} "
            f"layers, blocks={self.num_blocks} + 1 sink, "
            f"block_size={self.block_size}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}{v_width}, "
            f"dtype={str(self.cache_dtype).removeprefix('torch.')}, "
            f"device={self.device}, {mib:.1f} MiB, cpu_blocks={self.num_cpu_blocks}, "
            f"offload_blocks={self.num_offload_blocks})"
        )


def block_transfers(out) -> tuple[list, list, list, list, list]:
    """KVCache.transfer's arguments from a SchedulerOutput (what tensor-parallel workers get)."""
    return (
        out.blocks_to_offload,
        out.blocks_to_swap_out,
        out.blocks_to_copy,
        out.blocks_to_swap_in,
        out.blocks_to_load,
    )
