"""A KV cache stored in fewer bits than the model computes in: fp8 (e4m3) with a scale per layer.

Decode reads the whole KV cache of every running request in every step, so the cache's bytes set
both how many requests fit (blocks per GiB) and how long a memory-bound decode step takes. Storing
K and V in one byte each instead of two (bfloat16) or four (float32) doubles or quadruples the
blocks for the same memory. vLLM calls this `kv_cache_dtype="fp8"`.

float8_e4m3fn keeps 1 sign, 4 exponent and 3 mantissa bits: about two significant decimal digits,
magnitudes up to 448 and down to 2**-9. Each layer's K (and V) is stored divided by a scale:

    stored = clamp(x / scale, -448, 448) in fp8        read = float(stored) * scale

so the scale decides which range of values the 256 codes cover. vLLM V1 reads calibrated k_scale and
v_scale from the checkpoint (llm-compressor or ModelOpt) and falls back, with a warning, to 1.0,
which is fine when K and V sit well inside [-448, 448], as they usually do; minicb has no calibrated
checkpoints and uses 1.0. With minicb's own `calculate_kv_scales=True` the scales are set once from
the first real step, as vLLM's removed option of that name did (PR #49389): the amax of that step's
K divided by K_SCALE_CONSTANT (200) and of V by V_SCALE_CONSTANT (100), which maps the largest value
seen to 200 (or 100), leaving head room for later tokens that are larger, since values past 448 x
scale are clipped.

Torch has no index_copy_ / index_select kernels for float8 on CPU, so the cache holds the fp8
bytes as uint8 (vLLM allocates its fp8 caches as uint8 too) and views them as fp8 to convert.
A 16- or 32-bit cache in another dtype than the model's (kv_cache_dtype="bfloat16" with a float32
model) converts without a scale. When the cache holds the model's own dtype nothing here runs.
"""

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448.0
# vLLM's defaults: amax maps to 200 (K) and 100 (V)
K_SCALE_CONSTANT, V_SCALE_CONSTANT = (200.0, 100.0)
# kv_cache_dtype -> the dtype of the cached values (None: the model's own dtype). vLLM's names.
CACHE_DTYPES = {
    "auto": None,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp8": FP8,
    "fp8_e4m3": FP8,
}


def cache_dtype_of(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype the cache stores for a `kv_cache_dtype` name ("auto": the model's)."""
    if kv_cache_dtype not in CACHE_DTYPES:
        raise ValueError(
            f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose one of {tuple(CACHE_DTYPES)}"
        )
    return CACHE_DTYPES[kv_cache_dtype] or model_dtype


class KVQuant:
    """How one layer's K and V go into the cache and come back out, when the cache's dtype is not
    the model's. For fp8, `k_scale` and `v_scale` are 0-d float32 tensors on the cache's device
    (updated in place by calibration, so a captured CUDA graph reads the new values)."""

    def __init__(self, cache_dtype: torch.dtype, device):
        self.cache_dtype = cache_dtype
        self.is_fp8 = cache_dtype == FP8
        self.k_scale = torch.ones((), dtype=torch.float32, device=device)
        self.v_scale = torch.ones((), dtype=torch.float32, device=device)
        self.calibrate = False  # True: set both scales from the next K/V stored, then clear

    def storage_dtype(self) -> torch.dtype:
        return torch.uint8 if self.is_fp8 else self.cache_dtype

    def quantize(self, k, v):
        """(num_tokens, kv_heads, head_dim) K and V in the model's dtype -> what the cache
        stores."""
        if not self.is_fp8:
            return k.to(self.cache_dtype), v.to(self.cache_dtype)
        if self.calibrate:  # vLLM's calc_kv_scales, on the first forward pass
            self.k_scale.copy_((k.abs().amax().float() / K_SCALE_CONSTANT).clamp_min(1e-12))
            self.v_scale.copy_((v.abs().amax().float() / V_SCALE_CONSTANT).clamp_min(1e-12))
            self.calibrate = False
        return to_fp8(k, self.k_scale), to_fp8(v, self.v_scale)

    def dequantize(self, k, v, dtype: torch.dtype):
        """Gathered cache pages (any shape) -> K and V in the model's dtype `dtype`."""
        if not self.is_fp8:
            return k.to(dtype), v.to(dtype)
        return from_fp8(k, self.k_scale, dtype), from_fp8(v, self.v_scale, dtype)

    def __repr__(self) -> str:
        name = str(self.cache_dtype).removeprefix("torch.")
        if not self.is_fp8:
            return f"KVQuant({name})"
        return (
            f"KVQuant({name}, k_scale={self.k_scale.item():.4g}, v_scale={self.v_scale.item():.4g})"
        )


def to_fp8(x, scale):
    """x / scale rounded to the nearest fp8 value (clipped to +-448), as raw bytes (uint8)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)


def from_fp8(stored, scale, dtype):
    """The bytes written by to_fp8 back to values in `dtype`: fp8 value x scale."""
    return (stored.view(FP8).float() * scale).to(dtype)


def round_trip(x, scale=1.0):
    """x as an fp8 cache would give it back (for notebooks measuring the rounding error)."""
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    return from_fp8(to_fp8(x, scale), scale, x.dtype)
