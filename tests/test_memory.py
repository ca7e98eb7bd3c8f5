"""Sizing the KV cache (memory.py): the byte budget on CPU, the GPU's arithmetic and its refusals.
The measurements themselves run on a GPU (tests/test_gpu.py: two engines side by side get the same
cache)."""

import pytest

from minicb.config import EngineConfig
from minicb.model_executor.tiny_models import tiny_config
from minicb.worker.memory import (
    DEFAULT_KV_CACHE_BYTES,
    GiB,
    MemoryProfile,
    block_bytes,
    check_free_memory,
    kv_cache_bytes,
    largest_graph,
    resolve_config,
    sized_on_device,
)


class Tiny:  # what resolve_config reads of a LoadedModel
    hf_config = tiny_config("llama")
    max_model_len = 256


def test_cpu_keeps_the_byte_budget_and_cuda_measures():
    cpu = resolve_config(EngineConfig(), Tiny)
    assert cpu.num_blocks == DEFAULT_KV_CACHE_BYTES // block_bytes(cpu, Tiny.hf_config)
    assert not sized_on_device(EngineConfig())
    gpu = EngineConfig(device="cuda")
    # measured by the engine
    assert sized_on_device(gpu) and resolve_config(gpu, Tiny).num_blocks is None
    # a budget given is a budget kept
    given = resolve_config(gpu.replace(kv_cache_memory_bytes=2**20), Tiny)
    assert given.num_blocks == 2**20 // block_bytes(given, Tiny.hf_config)
    assert not sized_on_device(gpu.replace(num_blocks=10))


def test_what_is_left_is_the_kv_cache():
    p = MemoryProfile(
        total=80 * GiB, utilization=0.9, weights=2 * GiB, activations=3 * GiB, graphs=GiB
    )
    assert kv_cache_bytes(p) == int(72 * GiB) - 6 * GiB
    p.kv_cache, p.num_blocks = kv_cache_bytes(p), 1234
    assert "72.00 GiB" in str(p) and "1234 blocks" in str(p)


def test_refusals_name_the_problem_and_the_limit():
    with pytest.raises(
        ValueError, match=r"weights take 90.00 GiB.*gpu_memory_utilization=0.9 of 80.00 GiB"
    ):
        kv_cache_bytes(MemoryProfile(80 * GiB, 0.9, 90 * GiB, 0, 0))
    with pytest.raises(ValueError, match="nothing is left for the KV cache"):
        kv_cache_bytes(MemoryProfile(80 * GiB, 0.9, 60 * GiB, 12 * GiB, 0))
    check_free_memory(free=75 * GiB, total=80 * GiB, utilization=0.9)
    with pytest.raises(
        ValueError, match=r"asks for 72.00 GiB of 80.00 GiB, but only 40.00 GiB are free"
    ):
        check_free_memory(free=40 * GiB, total=80 * GiB, utilization=0.9)


def test_largest_graph_is_the_one_captured_first():
    # Qwen3's context in 256-token blocks: 160 columns
    config = EngineConfig(device="cuda", max_model_len=40960)
    # 256 rows x 8 columns x 256 tokens = the 524,288-token budget
    assert largest_graph(config) == (256, 8)
    assert largest_graph(config.replace(max_num_seqs=4)) == (4, 160)


class FakeCuda:
    """torch.cuda's memory readings for a GPU shared with another engine of the same process:
    `other` bytes held before ours, `own` ours. What a profile measures must be differences, never
    totals."""

    def __init__(self, total, other):
        self.total, self.other, self.own, self.peak = total, other, 0, 0

    def mem_get_info(self, device=None):
        return self.total - self.other - self.own, self.total

    def memory_allocated(self, device=None):
        return self.other + self.own

    def max_memory_allocated(self, device=None):
        return self.other + self.peak

    def reset_peak_memory_stats(self, device=None):
        self.peak = self.own

    def synchronize(self, device=None):
        # every measured step peaks 3 GiB above where it began
        self.peak = max(self.peak, self.own + 3 * GiB)

    def empty_cache(self):
        pass


def test_another_engine_does_not_shrink_the_cache(monkeypatch):
    import torch

    import minicb.worker.memory as memory
    from minicb.model_executor.loader import load_model, save_tiny_model
    from minicb.model_executor.model import CausalLM

    loaded = load_model(
        save_tiny_model(__import__("tempfile").mkdtemp(), arch="llama"), dtype=torch.float32
    )
    # as on a GPU
    config = resolve_config(
        EngineConfig(
            device="cuda",
            dtype="float32",
            max_num_batched_tokens=64,
            max_num_seqs=8,
            gpu_memory_utilization=0.5,
        ),
        loaded,
    ).replace(device="cpu")
    model = CausalLM.from_hf(loaded.hf_config, loaded.state_dict, torch.float32, "cpu")
    blocks = {}
    for other in (0, 30 * GiB):  # alone, then beside an engine that holds 30 GiB
        fake = FakeCuda(total=80 * GiB, other=other)
        monkeypatch.setattr(memory.torch, "cuda", fake)
        before = memory.gpu_baseline(config)
        fake.own += 2 * GiB  # our weights arrive
        profile = memory.profile_kv_cache(
            config,
            loaded.hf_config,
            model,
            fake.memory_allocated() - before,
            largest_graph(config),
            pages=False,
        )
        assert (profile.weights, profile.activations, profile.graphs) == (
            2 * GiB,
            3 * GiB,
            3 * GiB,
        ), profile
        blocks[other] = profile.num_blocks
    assert (
        blocks[0]
        == blocks[30 * GiB]
        == (40 * GiB - 8 * GiB) // block_bytes(config, loaded.hf_config)
    )
    monkeypatch.setattr(memory.torch, "cuda", FakeCuda(total=80 * GiB, other=50 * GiB))
    with pytest.raises(
        ValueError, match="only 30.00 GiB are free"
    ):  # 40 GiB asked for, 30 free: refused
        memory.gpu_baseline(config)
