"""EngineConfig: every knob of the engine in one frozen dataclass.

The names follow vLLM (`max_num_seqs`, `max_num_batched_tokens`, `block_size`, ...) so that what
a learner tunes here carries over. The config is pure data: it is validated when it is built and
never reads a file or touches a device (the engine resolves model-dependent values such as
`num_blocks` from a memory budget and passes a completed copy to the scheduler).
"""

import dataclasses
from dataclasses import asdict, dataclass

BATCHING_MODES = ("continuous", "static")
SCHEDULING_POLICIES = ("fcfs", "priority", "sjf", "vtc")  # vLLM has the first two
PREEMPTION_MODES = ("recompute", "swap")
DTYPES = ("float32", "float64", "float16", "bfloat16", "auto")
QUANTIZATIONS = (None, "int8")  # model_executor/cpu_precision.py
ATTENTION_BACKENDS = ("auto", "gather", "flash_pages")
# kv_quant.CACHE_DTYPES
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "fp8", "fp8_e4m3")


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the blocks of b tokens that hold a tokens (vLLM's name for it)."""
    return -(-a // b)


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct; else a local dir or hub id
    # float32 by default; float64 for exact-parity tests; "auto" (vLLM's name): bfloat16 on CUDA,
    # and on a CPU bfloat16 only where the CPU multiplies it natively and the model's linears,
    # timed once per machine, run faster in it (model_executor/cpu_precision.py), else float32
    dtype: str = "float32"
    # Weight quantization (vLLM's field): None, or "int8": weight-only, an int8 weight row and one
    # scale per output channel, activations in `dtype` (a quarter of float32's weight bytes; CPU
    # only, model_executor/cpu_precision.py)
    quantization: str | None = None
    device: str = "cpu"  # "cpu" or "cuda"

    # --- paged KV memory ---
    # Tokens per KV block; None: 16 on CPU (small blocks waste little), 256 on CUDA, where decode
    # reads each block in place as one flash-attention problem and small blocks make tiny ones
    # (paged_flash.py)
    block_size: int | None = None
    # KV blocks on the device; None: derived from kv_cache_memory_bytes
    num_blocks: int | None = None
    # Memory budget of the KV cache (vLLM's name). None: 512 MiB on CPU, which a laptop can spare;
    # on CUDA what gpu_memory_utilization leaves after the weights, activations and graphs, measured
    # (memory.py)
    kv_cache_memory_bytes: int | None = None
    # CUDA: the share of the GPU's memory this engine fills. vLLM used 0.9 until it moved to 0.92
    # (vllm/config/cache.py, `CacheConfig.gpu_memory_utilization`); minicb keeps 0.9
    gpu_memory_utilization: float = 0.9
    # What the cache stores (vLLM's names): "auto" the model's dtype (exact); "bfloat16"/"float16"
    # half of float32; "fp8" (= "fp8_e4m3") one byte a value, twice the blocks of bfloat16, some
    # rounding error
    kv_cache_dtype: str = "auto"
    # fp8: scales from the first step's amax (minicb's own; vLLM removed its option, PR #49389)
    calculate_kv_scales: bool = False
    num_cpu_blocks: int | None = None  # swap space in blocks; None: as many as num_blocks
    # A CPU tier for the prefix cache (vLLM's names): GiB of host memory that keep the full blocks
    # the device's prefix cache evicts, loaded back on a hit (core/kv_offload.py); backend "native"
    # (vLLM's own; LMCache is not built in). num_offload_blocks: the same in blocks (minicb's;
    # the engine derives it from kv_offloading_size)
    kv_offloading_size: float | None = None
    kv_offloading_backend: str | None = None
    num_offload_blocks: int | None = None
    enable_prefix_caching: bool = True  # reuse full blocks whose token prefix was computed before
    # KV cache groups (vLLM V1's hybrid KV cache manager, core/kv_cache_groups.py): a table per
    # group of layers that cache alike, a sliding window's out-of-window blocks freed. None: filled
    # from the model (one group for every layer when they all cache alike, or in the simulator).
    # disable_hybrid_kv_cache_manager (vLLM's flag): one group, every block kept, the window masked
    kv_cache_groups: tuple | None = None
    disable_hybrid_kv_cache_manager: bool = False
    # prompt + output limit; None: the model's (or unlimited in sim)
    max_model_len: int | None = None

    # --- scheduling ---
    # Batch slots, requests running at once (a decode step's batch size); None: 64 on CPU, 256 on
    # CUDA
    max_num_seqs: int | None = None
    # Token budget of one step (decodes + prefill chunks); None: 256 on CPU, 8192 on CUDA (whose
    # matmuls fill up later)
    max_num_batched_tokens: int | None = None
    # "static" (minicb only, to compare against): admit a batch, wait until all of it has finished
    batching: str = "continuous"
    # Admission order, vLLM's names: "fcfs" (first come, first served) or "priority" (the LOWEST
    # priority value first, ties by arrival, and it may preempt a running request with a higher
    # value). minicb adds "sjf", fewest max_tokens first, and "vtc", the Virtual Token Counter of
    # Sheng et al. (OSDI 2024): the tenant (`user`) served least first (core/fairness.py).
    scheduling_policy: str = "fcfs"
    enable_chunked_prefill: bool = True  # split long prompts so decodes keep running beside them
    preemption_mode: str = "recompute"  # when blocks run out: drop and re-prefill, or swap to CPU

    # --- execution ---
    use_cuda_graph: bool | str = "auto"  # decode through graphs: True, False, or "auto" (CUDA only)
    # vLLM's name for the same switch: enforce_eager=True means use_cuda_graph=False (and refuses
    # use_cuda_graph=True); False, vLLM's default, leaves use_cuda_graph as it is
    enforce_eager: bool = False
    # Decode attention: "gather" copies each row's blocks and masks (attention.py, the reference),
    # "flash_pages" reads them in place (paged_flash.py; CPU: a slow reference kernel), "auto":
    # flash_pages on CUDA where it runs
    attention_backend: str = "auto"
    # float32 on CPU: "auto" times oneDNN's packed weights against torch.matmul on each linear shape
    # once per machine and keeps the faster (which one wins differs: AVX-512 vs AVX2); True packs
    # all, False none; "other" takes the kernels "auto" rejected (so does "auto" under
    # MINICB_CPU_KERNELS=other)
    prepack_cpu_weights: bool | str = "auto"
    # Split every layer over N processes (vLLM's name): each holds 1/N of the heads and MLP features
    # and the KV cache of its own KV heads; N must divide the model's KV heads (parallel.py)
    tensor_parallel_size: int = 1
    # A mixture of experts over those N processes (vLLM's name): each rank holds E / N whole
    # experts instead of 1/N of every expert, and the step's tokens travel to their experts and
    # back with all-to-alls (worker/expert_parallel.py). Off: every expert split like a dense MLP
    enable_expert_parallel: bool = False
    # Size prefill chunks by time, not only tokens (minicb's; Sarathi-Serve's idea, see
    # core/step_cost.py): a step that carries prefill work may take at most this many times the
    # estimated time of its decodes alone, so one long or expensive prompt is spread over steps
    # instead of stalling every stream. None: off (vLLM's behaviour: a token budget only); `serve`
    # sets 2.0
    max_decode_slowdown: float | None = None
    # The time model it uses (config.StepCost, seconds); None with max_decode_slowdown set: the
    # engine measures it on this machine when it starts (engine/step_cost.py)
    step_cost: object = None
    # Speculative decoding, vLLM's dict: {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_max": n, "prompt_lookup_min": m}. None: off (it pays where outputs copy their
    # context; spec_decode.py)
    speculative_config: object = None
    # Async scheduling (vLLM V1's name and default-off switch): schedule step N+1 and launch it
    # before step N's sampled tokens reach the host; N+1 feeds them from N's sampled tokens, and
    # N's outputs are processed while N+1 runs (engine/batch_queue.py). Off: one step at a time
    async_scheduling: bool = False
    seed: int = 0  # generator for sampled requests that carry no seed of their own
    record_trace: bool = True  # keep one StepRecord per step (notebooks); servers may turn it off

    def __post_init__(self):
        if not isinstance(self.device, str) or self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        for name, cpu, cuda in (
            ("block_size", 16, 256),
            ("max_num_seqs", 64, 256),
            ("max_num_batched_tokens", 256, 8192),
        ):
            # the device's default (frozen: set it the dataclass way)
            if getattr(self, name) is None:
                object.__setattr__(self, name, cuda if self.device.startswith("cuda") else cpu)
        object.__setattr__(
            self, "speculative_config", SpeculativeConfig.of(self.speculative_config)
        )
        object.__setattr__(self, "step_cost", StepCost.of(self.step_cost))
        is_valid_slowdown = self.max_decode_slowdown is None or (
            isinstance(self.max_decode_slowdown, (int, float))
            and not isinstance(self.max_decode_slowdown, bool)
            and self.max_decode_slowdown > 1
        )
        if not is_valid_slowdown:
            raise ValueError(
                "max_decode_slowdown must be None (off) or a number > 1 (a step may take that many "
                f"times its decodes' time), got {self.max_decode_slowdown!r}"
            )

        def positive(name, allow_none=False):
            value = getattr(self, name)
            if value is None and allow_none:
                return
            is_positive_int = isinstance(value, int) and not isinstance(value, bool) and value > 0
            if not is_positive_int:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "tensor_parallel_size",
        ):
            positive(name)
        for name in ("num_blocks", "kv_cache_memory_bytes", "max_model_len"):
            positive(name, allow_none=True)
        is_valid_num_cpu_blocks = self.num_cpu_blocks is None or (
            isinstance(self.num_cpu_blocks, int)
            and not isinstance(self.num_cpu_blocks, bool)
            and self.num_cpu_blocks >= 0
        )
        if not is_valid_num_cpu_blocks:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {self.num_cpu_blocks!r}")
        self._check_offloading()
        for name, allowed in (
            ("batching", BATCHING_MODES),
            ("scheduling_policy", SCHEDULING_POLICIES),
            ("preemption_mode", PREEMPTION_MODES),
            ("dtype", DTYPES),
            ("quantization", QUANTIZATIONS),
            ("kv_cache_dtype", KV_CACHE_DTYPES),
            ("attention_backend", ATTENTION_BACKENDS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}; choose one of {allowed}")
        is_valid_use_cuda_graph = (
            self.use_cuda_graph is True
            or self.use_cuda_graph is False
            or self.use_cuda_graph == "auto"
        )
        if not is_valid_use_cuda_graph:
            raise ValueError(
                f"use_cuda_graph must be True, False or 'auto', got {self.use_cuda_graph!r}"
            )
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be True or False, got {self.enforce_eager!r}")
        if self.enforce_eager and self.use_cuda_graph is True:
            raise ValueError(
                "enforce_eager=True (vLLM's name for use_cuda_graph=False) "
                "contradicts use_cuda_graph=True: give one of them"
            )
        if self.enforce_eager:
            object.__setattr__(self, "use_cuda_graph", False)  # the alias, resolved once
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(
                f"async_scheduling must be True or False, got {self.async_scheduling!r}"
            )
        if self.async_scheduling and self.speculative_config is not None:
            raise ValueError(
                "async_scheduling=True does not work with speculative_config (method "
                f"{self.speculative_config.method!r}): prompt lookup proposes drafts on the host "
                "from a request's newest tokens, which async scheduling has not brought back when "
                "it schedules the next step. vLLM V1 refuses the same pair for its CPU ngram "
                "proposer (its EAGLE, MTP and ngram_gpu drafters propose on the GPU). Turn one off"
            )
        if self.calculate_kv_scales and not self.kv_cache_dtype.startswith("fp8"):
            raise ValueError(
                "calculate_kv_scales needs an fp8 KV cache, but kv_cache_dtype is "
                f"{self.kv_cache_dtype!r}"
            )
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(
                f"enable_expert_parallel must be True or False, got {self.enable_expert_parallel!r}"
            )
        if self.tensor_parallel_size > 1 and self.use_cuda_graph is True:
            raise ValueError(
                "CUDA graphs are not supported with tensor_parallel_size > 1: use "
                "use_cuda_graph=False"
            )
        if self.quantization == "int8" and (
            self.device.startswith("cuda") or self.tensor_parallel_size > 1
        ):
            raise ValueError(
                "quantization='int8' runs on a CPU in one process (PyTorch's CPU kernel "
                f"_weight_int8pack_mm); got device={self.device!r}, "
                f"tensor_parallel_size={self.tensor_parallel_size}"
            )
        if self.prepack_cpu_weights not in (True, False, "auto", "other"):
            raise ValueError(
                f"prepack_cpu_weights must be True, False, 'auto' or 'other', "
                f"got {self.prepack_cpu_weights!r}"
            )
        is_valid_gpu_memory_utilization = (
            isinstance(self.gpu_memory_utilization, (int, float))
            and 0 < self.gpu_memory_utilization <= 1
        )
        if not is_valid_gpu_memory_utilization:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )

    @property
    def max_blocks_per_seq(self) -> int | None:
        """Columns of a block table: enough blocks for the longest allowed sequence."""
        if self.max_model_len is None:
            return None
        return cdiv(self.max_model_len, self.block_size)

    @property
    def num_swap_blocks(self) -> int:
        """CPU blocks set aside for swapping: none unless preemption_mode is "swap"."""
        if self.preemption_mode != "swap":
            return 0
        return self.num_blocks if self.num_cpu_blocks is None else self.num_cpu_blocks

    def _check_offloading(self) -> None:
        size, backend = self.kv_offloading_size, self.kv_offloading_backend
        if size is not None and not (isinstance(size, (int, float)) and size > 0):
            raise ValueError(f"kv_offloading_size must be a positive number of GiB, got {size!r}")
        if backend not in (None, "native"):
            raise ValueError(
                f"kv_offloading_backend {backend!r} is not supported; minicb has 'native' (vLLM "
                "also offers 'lmcache')"
            )
        blocks = self.num_offload_blocks
        if blocks is not None and (not isinstance(blocks, int) or blocks < 0):
            raise ValueError(f"num_offload_blocks must be >= 0, got {blocks!r}")

    def replace(self, **changes) -> "EngineConfig":
        """A validated copy with some fields changed (the config itself is frozen)."""
        return dataclasses.replace(self, **changes)


# ---------------------------------------------------------------------- speculative decoding
# vLLM also has draft models, EAGLE, Medusa, MTP: minicb has the one that needs no weights
METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config`, with its defaults: LLM(..., speculative_config={"method":
    "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}). A bound that is not given equals
    the other (vLLM's rule: min = max = 3 here); neither given: both 5."""

    method: str = "ngram"
    # k: drafts per step, a step yields up to k + 1 tokens (required)
    num_speculative_tokens: int | None = None
    # the longest suffix looked up (tried first: a longer match guesses better)
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None  # the shortest; short suffixes match often and guess worse

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config method {self.method!r} is not supported; choose one of "
                f"{METHODS}"
            )
        if self.num_speculative_tokens is None:
            raise ValueError(
                "speculative_config needs num_speculative_tokens (the drafts verified per step)"
            )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        object.__setattr__(
            self, "prompt_lookup_min", lo if lo is not None else hi if hi is not None else 5
        )
        object.__setattr__(
            self, "prompt_lookup_max", hi if hi is not None else self.prompt_lookup_min
        )
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            is_positive_int = isinstance(value, int) and not isinstance(value, bool) and value > 0
            if not is_positive_int:
                raise ValueError(
                    f"speculative_config {name} must be a positive integer, got {value!r}"
                )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) must be at most "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )

    @classmethod
    def of(cls, value) -> "SpeculativeConfig | None":
        """From what a user passes: None (off), a dict with vLLM's keys, or a SpeculativeConfig."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(
                f"speculative_config must be a dict such as {{'method': 'ngram', "
                f"'num_speculative_tokens': 4}}, got {value!r}"
            )
        unknown = set(value) - {
            "method",
            "num_speculative_tokens",
            "prompt_lookup_max",
            "prompt_lookup_min",
        }
        if unknown:
            raise ValueError(
                f"unknown speculative_config keys {sorted(unknown)}; minicb knows method, "
                f"num_speculative_tokens, prompt_lookup_max and prompt_lookup_min"
            )
        return cls(**value)


# ---------------------------------------------------------------------- step time
@dataclass(frozen=True)
class StepCost:
    step_s: float  # a step that computes almost nothing: weights read once, kernels launched
    token_s: float  # each token through the linear layers
    context_token_s: float  # each (token, earlier position) pair its attention reads
    logits_row_s: float  # each extra LM-head row and log-softmax (prompt log-probabilities)
    # each position of context a row reads, once per row whatever its tokens: its prefix's cached
    # keys and values gathered from the block table and streamed through memory
    position_s: float = 0.0

    def __post_init__(self):
        for name, value in asdict(self).items():
            is_valid = (
                isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
            )
            if not is_valid:
                raise ValueError(f"StepCost.{name} must be a number >= 0 seconds, got {value!r}")

    @classmethod
    def of(cls, value) -> "StepCost | None":
        """None, a StepCost, or its fields as a dict (a JSON flag)."""
        if value is None or isinstance(value, StepCost):
            return value
        if isinstance(value, dict):
            return cls(**value)
        raise ValueError(f"step_cost must be a StepCost or a dict of its fields, got {value!r}")

    def row_s(self, num_tokens: int, context: int, logits_rows: int = 0) -> float:
        """Seconds a row adds to a step: `num_tokens` new tokens after `context` computed ones.
        Token i (0-based) attends to context + i + 1 positions, itself included; the row reads
        context + num_tokens positions of keys and values."""
        if num_tokens == 0:
            return 0.0
        attended = num_tokens * context + num_tokens * (num_tokens + 1) // 2
        return (
            self.token_s * num_tokens
            + self.context_token_s * attended
            + self.logits_row_s * logits_rows
            + self.position_s * (context + num_tokens)
        )

    def __repr__(self):
        return (
            f"StepCost(step={self.step_s * 1e3:.2f} ms, token={self.token_s * 1e3:.3f} ms, "
            f"context_token={self.context_token_s * 1e6:.4f} us, "
            f"logits_row={self.logits_row_s * 1e3:.3f} ms, position={self.position_s * 1e6:.2f} us)"
        )
