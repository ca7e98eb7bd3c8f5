"""How many KV blocks the engine gets: a byte budget on CPU, what the GPU has left on CUDA.

On CPU the cache gets `kv_cache_memory_bytes` (512 MiB by default, which a laptop can spare). On
CUDA, as in vLLM, the engine may fill `gpu_memory_utilization` of the GPU's memory (0.9 by default)
and the KV cache gets whatever its other tenants leave, each measured on the device, not guessed:

    KV bytes = utilization x total memory - weights - activations - graphs

  weights      what loading the model added to the memory torch holds (a difference: memory that
  another
               engine of the same process already holds is in both readings and cancels out)
  activations  the peak of a warm-up forward pass at the largest step the scheduler can make
               (max_num_batched_tokens tokens, logits and a float32 copy of them for max_num_seqs
               rows)
  graphs       the peak of one decode forward at the largest CUDA-graph shape: the graphs' shared
  memory
               pool must hold that step's intermediate tensors for as long as the engine lives

The engine measures the graphs' pool again after capture (MemoryProfile.graphs_captured) so that the
estimate can be checked. The CUDA context and cuBLAS workspaces live in the 1 - utilization margin.
Memory held by other processes is not subtracted; instead, as vLLM does, the engine refuses to start
when less than utilization x total is free, naming what is missing.
"""

from dataclasses import dataclass

import torch

from ..config import EngineConfig, cdiv
from ..core.kv_cache_groups import group_size_of, kv_cache_groups
from ..model_executor.attention import AttentionMetadata
from ..model_executor.hf_config import kv_bytes_per_token, sliding_window_of
from ..model_executor.kv_quant import cache_dtype_of
from ..model_executor.paged_flash import page_pairs
from .kv_cache import KVCache

DEFAULT_KV_CACHE_BYTES = 512 * 2**20  # 512 MiB: ~11k tokens of SmolLM2-135M in float32
GiB = 2**30


def sized_on_device(config: EngineConfig) -> bool:
    """True when the KV cache is sized from free GPU memory (CUDA, and neither blocks nor bytes
    given)."""
    return (
        config.device.startswith("cuda")
        and config.num_blocks is None
        and config.kv_cache_memory_bytes is None
    )


def block_bytes(config: EngineConfig, hf_config) -> int:
    """Bytes of one KV block on one rank (tensor parallelism: each rank caches 1/N of the KV
    heads). With KV cache groups a block is a page in each of group_size layers' tensors."""
    # fp8: 1 byte a value
    cache_dtype = cache_dtype_of(config.kv_cache_dtype, getattr(torch, config.dtype))
    per_layer = kv_bytes_per_token(hf_config, cache_dtype) // hf_config.num_hidden_layers
    layers = group_size_of(groups_of(config, hf_config))
    return per_layer * layers * config.block_size // config.tensor_parallel_size


def groups_of(config: EngineConfig, hf_config) -> tuple:
    """The model's KV cache groups (core/kv_cache_groups.py). One group when the hybrid manager is
    disabled, or with the CPU tier, which keeps one table's blocks (vLLM too turns its hybrid
    manager off for a KV connector that does not support it)."""
    if config.kv_cache_groups is not None:
        return config.kv_cache_groups
    windows = [sliding_window_of(hf_config, i) for i in range(hf_config.num_hidden_layers)]
    tiered = config.kv_offloading_size is not None or bool(config.num_offload_blocks)
    return kv_cache_groups(windows, config.disable_hybrid_kv_cache_manager or tiered)


def resolve_config(config: EngineConfig, loaded) -> EngineConfig:
    """Fill in what depends on the model: max_model_len and num_blocks (from a byte budget). On CUDA
    with no budget given, num_blocks stays None: the engine measures the device first
    (profile_kv_cache)."""
    max_len = min(config.max_model_len or loaded.max_model_len, loaded.max_model_len)
    config = config.replace(kv_cache_groups=groups_of(config, loaded.hf_config))
    num_blocks = config.num_blocks
    if num_blocks is None and not sized_on_device(config):
        per_block = block_bytes(config, loaded.hf_config)
        num_blocks = (config.kv_cache_memory_bytes or DEFAULT_KV_CACHE_BYTES) // per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} is smaller than one KV "
                f"block ({per_block} bytes for block_size={config.block_size})"
            )
    offload_blocks = config.num_offload_blocks
    if offload_blocks is None and config.kv_offloading_size is not None:  # GiB of host memory
        offload_blocks = int(config.kv_offloading_size * GiB) // block_bytes(
            config, loaded.hf_config
        )
    return config.replace(
        max_model_len=max_len, num_blocks=num_blocks, num_offload_blocks=offload_blocks
    )


@dataclass
class MemoryProfile:
    """What the engine measured on the GPU, in bytes, and the KV cache it gave itself."""

    total: int  # the device's memory
    utilization: float  # gpu_memory_utilization
    weights: int
    activations: int  # peak of the warm-up forward
    graphs: (
        int  # peak of the largest graph's step (0 without graphs): reserved for the graphs' pool
    )
    kv_cache: int = 0  # what is left: utilization x total - the three above
    num_blocks: int = 0
    graphs_captured: int | None = None  # the pool's real size, measured after capture

    def __str__(self) -> str:
        def g(x):
            return f"{x / GiB:.2f} GiB"

        captured = "" if self.graphs_captured is None else f" (captured: {g(self.graphs_captured)})"
        return (
            f"{self.utilization:.0%} of {g(self.total)} = {g(self.total * self.utilization)}: "
            f"weights {g(self.weights)}, activations {g(self.activations)}, graphs "
            f"{g(self.graphs)}{captured}, KV cache {g(self.kv_cache)} = {self.num_blocks} blocks"
        )


def kv_cache_bytes(profile: MemoryProfile) -> int:
    """utilization x total - weights - activations - graphs; a clear error when nothing is left."""
    allowed = int(profile.total * profile.utilization)
    if profile.weights > allowed:
        raise ValueError(
            f"the model's weights take {profile.weights / GiB:.2f} GiB, more than "
            f"gpu_memory_utilization={profile.utilization} of {profile.total / GiB:.2f} GiB allows "
            f"({allowed / GiB:.2f} GiB): raise gpu_memory_utilization or use a smaller "
            "dtype or model"
        )
    left = allowed - profile.weights - profile.activations - profile.graphs
    if left <= 0:
        raise ValueError(
            f"nothing is left for the KV cache: {profile}. Lower max_num_batched_tokens or "
            "max_num_seqs, or raise gpu_memory_utilization"
        )
    return left


def check_free_memory(free: int, total: int, utilization: float) -> None:
    """vLLM's start-up check: the share this engine may fill must be free now."""
    if free < total * utilization:
        raise ValueError(
            f"gpu_memory_utilization={utilization} asks for {total * utilization / GiB:.2f} GiB of "
            f"{total / GiB:.2f} GiB, but only {free / GiB:.2f} GiB are free (another process or "
            "engine holds the rest): lower gpu_memory_utilization, or free that memory first"
        )


def largest_graph(config: EngineConfig) -> tuple[int, int]:
    """(rows, columns) of the CUDA graph with the most rows, at its widest (cuda_graph.py's
    shapes). With drafts, a verify graph's rows hold 1 + k tokens each: measured as that many
    one-token rows, which gather and attend at least as much."""
    from .cuda_graph import graph_shapes

    buckets, widths = graph_shapes(
        config.max_num_seqs, config.max_blocks_per_seq, config.block_size
    )
    spec = config.speculative_config
    tokens_per_row = 1 + spec.num_speculative_tokens if spec is not None else 1
    return buckets[-1] * tokens_per_row, widths[buckets[-1]][-1]


def gpu_baseline(config: EngineConfig) -> int:
    """Before the engine loads anything: refuse if its share is not free, return the memory torch
    holds now."""
    torch.cuda.empty_cache()
    check_free_memory(*torch.cuda.mem_get_info(config.device), config.gpu_memory_utilization)
    return torch.cuda.memory_allocated(config.device)


def peak_bytes(fn, device) -> int:
    """How far fn() raised the memory torch holds on `device` above where it started (a
    difference)."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


@torch.inference_mode()
def profile_kv_cache(
    config: EngineConfig, hf_config, model, weights: int, graph_shape, pages: bool
) -> MemoryProfile:
    """Measure activations (and a graph step's peak) on a small scratch cache; size the KV cache.
    graph_shape: (rows, columns) of the largest CUDA graph, or None without graphs; pages:
    flash_pages decode."""
    device, dtype = torch.device(config.device), getattr(torch, config.dtype)
    tokens, bs = config.max_num_batched_tokens, config.block_size
    seqs = [min(config.max_model_len, tokens - i) for i in range(0, tokens, config.max_model_len)]
    rows, cols = graph_shape or (0, 0)
    scratch = KVCache(
        hf_config,
        sum(cdiv(n, bs) for n in seqs),
        bs,
        dtype,
        device,
        0,
        cache_dtype_of(config.kv_cache_dtype, dtype),
    )
    next_block, tables = 0, []
    # the largest prefill step: max_num_batched_tokens tokens, as few sequences as max_model_len
    # allows
    for n in seqs:
        tables.append(list(range(next_block, next_block + cdiv(n, bs))))
        next_block += cdiv(n, bs)

    def prefill():
        meta = AttentionMetadata.build(tables, seqs, seqs, 0, bs, scratch.sink_block_id, device)
        ids = torch.zeros(tokens, dtype=torch.long, device=device)
        positions = torch.cat([torch.arange(n, device=device) for n in seqs])
        hidden = model(ids, positions, scratch, meta)
        # the sampler's float32 copy
        model.compute_logits(hidden[: config.max_num_seqs]).float().softmax(-1)

    def graph_step():  # the largest graph's decode step, every row reading `cols` sink blocks
        long = dict(dtype=torch.long, device=device)
        table = torch.full((rows, cols), scratch.sink_block_id, **long)
        lens = torch.full((rows,), cols * bs, **long)
        meta = AttentionMetadata(
            torch.full((rows,), scratch.sink_loc, **long),
            table,
            lens,
            torch.arange(rows + 1, **long),
            rows,
            list(range(rows + 1)),
            [cols * bs] * rows,
        )
        if pages:
            meta.pages = page_pairs(table, lens, bs, scratch.num_locations)
        # logits run outside graphs
        model(torch.zeros(rows, **long), torch.zeros(rows, **long), scratch, meta)

    profile = MemoryProfile(
        torch.cuda.mem_get_info(device)[1],
        config.gpu_memory_utilization,
        weights,
        peak_bytes(prefill, device),
        peak_bytes(graph_step, device) if rows else 0,
    )
    scratch = None  # the closures above hold it: drop it before the real cache is sized
    torch.cuda.empty_cache()
    profile.kv_cache = kv_cache_bytes(profile)
    profile.num_blocks = profile.kv_cache // block_bytes(config, hf_config)
    return profile
