"""Worker: what runs the model on one device, set up once (vLLM's name:
vllm/v1/worker/gpu_worker.py).

The engine core decides what runs; the worker computes it. Setting one up is vLLM's sequence too:
  1. load the weights onto the device: this rank's shard with tensor parallelism (parallel.py); on a
     CPU in float32, each linear on the faster of two kernels (cpu_kernels.py);
  2. size the KV cache: on CUDA from what the GPU has left after the weights, a warm-up forward pass
     at the largest batch and the largest graph (memory.py); on a CPU from a byte budget
     (EngineConfig);
  3. allocate the cache (kv_cache.py) and build the ModelRunner on it (model_runner.py);
  4. capture the CUDA graphs (cuda_graph.py; emulated on a CPU when asked) and measure their pool.
After that, every step is ModelRunner.execute.
"""

import torch

from ..config import EngineConfig
from ..model_executor.cpu_kernels import PACKED_DTYPES, kernel_cache_file, prepare_cpu_linears
from ..model_executor.cpu_precision import quantize_linears
from ..model_executor.kv_quant import cache_dtype_of
from ..model_executor.loader import LoadedModel
from ..model_executor.model import CausalLM
from ..model_executor.paged_flash import choose_attention_backend
from .kv_cache import KVCache
from .memory import gpu_baseline, largest_graph, profile_kv_cache
from .model_runner import ModelRunner


class Worker:
    """Builds `model`, `kv_cache` and `runner` for a resolved config; `config` gains num_blocks when
    the cache is sized from the GPU (`memory` then holds the measurements). `tp`: the TensorParallel
    group, if any."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel):
        dtype = getattr(torch, config.dtype)
        # with tensor_parallel_size N > 1: rank 0's shard here, N - 1 worker processes (parallel.py)
        self.tp = None
        cuda, on_device = torch.device(config.device).type == "cuda", config.num_blocks is None
        # the KV cache gets what the GPU has left (memory.py)
        before = gpu_baseline(config) if on_device else 0
        if config.tensor_parallel_size > 1:
            from .parallel import TensorParallel

            self.tp = TensorParallel(loaded, config)
        model = (
            self.tp.model
            if self.tp
            else CausalLM.from_hf(loaded.hf_config, loaded.state_dict, dtype, config.device)
        )
        # linear shape -> the kernel it runs on (float32 on CPU), see cpu_kernels.py
        self.cpu_kernels = {}
        if config.quantization == "int8":  # weight-only int8 (cpu_precision.py)
            model = quantize_linears(model)
        if config.prepack_cpu_weights and dtype in PACKED_DTYPES and not cuda:
            model, self.cpu_kernels = prepare_cpu_linears(
                model, config.prepack_cpu_weights, kernel_cache_file()
            )
        hf_config = self.tp.hf_config if self.tp else loaded.hf_config
        cache_dtype = cache_dtype_of(config.kv_cache_dtype, dtype)
        backend = choose_attention_backend(config, hf_config, cache_dtype != dtype)
        use_graph = config.use_cuda_graph is True or (
            config.use_cuda_graph == "auto" and cuda and not self.tp
        )
        self.memory = None  # a MemoryProfile when the cache is sized from the GPU
        if on_device:
            self.memory = profile_kv_cache(
                config,
                hf_config,
                model,
                torch.cuda.memory_allocated(config.device) - before,
                largest_graph(config) if use_graph else None,
                backend == "flash_pages",
            )
            config = config.replace(num_blocks=self.memory.num_blocks)
        self.config, self.model = config, model
        self.kv_cache = KVCache(
            hf_config,
            config.num_blocks,
            config.block_size,
            dtype,
            config.device,
            config.num_swap_blocks,
            cache_dtype,
            config.num_offload_blocks or 0,
            config.kv_cache_groups,
        )
        self.runner = ModelRunner(model, self.kv_cache, config, config.device)
        self.runner.tp, self.runner.attention_backend = self.tp, backend
        if use_graph:
            from .cuda_graph import DecodeGraphRunner

            reserved = torch.cuda.memory_reserved(config.device) if cuda else 0
            self.runner.graph_runner = DecodeGraphRunner(self.runner)
            if (
                self.memory is not None
            ):  # the graphs' pool as captured, beside the estimate it was sized with
                self.memory.graphs_captured = torch.cuda.memory_reserved(config.device) - reserved
        for quant in (
            self.kv_cache.quant if config.calculate_kv_scales else []
        ):  # after capture: not in a graph
            # fp8: the first forward pass sets each layer's scales (kv_quant.py)
            quant.calibrate = True
