"""Bad input is refused where it is made: EngineConfig, SamplingParams, Scheduler.add_request.

Every error is a ValueError that names the field (and, for limits, the limit), so a learner can
act on it; and a refused request leaves the scheduler exactly as it was.
"""

import dataclasses

import pytest

from minicb.config import EngineConfig
from minicb.core.request import Request
from minicb.core.scheduler import Scheduler
from minicb.sampling_params import SamplingParams
from minicb.sim import SimRequest, simulate

# ---------------------------------------------------------------------------------- EngineConfig


def test_defaults_are_valid_and_frozen():
    c = EngineConfig()
    assert (c.block_size, c.max_num_seqs, c.batching, c.scheduling_policy) == (
        16,
        64,
        "continuous",
        "fcfs",
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.block_size = 8


@pytest.mark.parametrize("field", ["block_size", "max_num_seqs", "max_num_batched_tokens"])
@pytest.mark.parametrize("value", [0, -1, 2.0, "16", True])
def test_required_positive_ints(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_device_defaults():
    """None takes the device's default: a CPU's matmuls fill up at hundreds of tokens, a GPU's at
    thousands, and on CUDA decode reads each 256-token block in place (paged_flash.py)."""
    cpu, gpu = EngineConfig(), EngineConfig(device="cuda")
    assert (cpu.block_size, cpu.max_num_seqs, cpu.max_num_batched_tokens) == (16, 64, 256)
    assert (gpu.block_size, gpu.max_num_seqs, gpu.max_num_batched_tokens) == (256, 256, 8192)
    assert EngineConfig(device="cuda", block_size=16).block_size == 16  # a value given is kept
    assert (gpu.gpu_memory_utilization, gpu.attention_backend) == (0.9, "auto")
    for bad in (0, 1.5, -0.1, "0.9"):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineConfig(gpu_memory_utilization=bad)
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="flashinfer")


@pytest.mark.parametrize("field", ["num_blocks", "kv_cache_memory_bytes", "max_model_len"])
@pytest.mark.parametrize("value", [0, -5, 1.5, "8", False])
def test_optional_positive_ints(field, value):
    EngineConfig(**{field: None})  # None means "derive it"
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


@pytest.mark.parametrize("value", [-1, 1.5, "4"])
def test_num_cpu_blocks(value):
    EngineConfig(num_cpu_blocks=0)  # zero swap space is allowed: swap falls back to recompute
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        EngineConfig(num_cpu_blocks=value)


def test_num_cpu_blocks_refuses_bool():
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        EngineConfig(num_cpu_blocks=True)


@pytest.mark.parametrize(
    "field,good,bad",
    [
        ("batching", ["continuous", "static"], ["dynamic", "Static", ""]),
        ("scheduling_policy", ["fcfs", "sjf", "priority"], ["fifo", "FCFS", None]),
        ("preemption_mode", ["recompute", "swap"], ["drop", None]),
        ("dtype", ["float32", "float64", "float16", "bfloat16"], ["fp32", "int8", None]),
    ],
)
def test_choices(field, good, bad):
    for value in good:
        assert getattr(EngineConfig(**{field: value}), field) == value
    for value in bad:
        with pytest.raises(ValueError, match=field):
            EngineConfig(**{field: value})


@pytest.mark.parametrize("value", ["yes", "on", None, 2])
def test_use_cuda_graph(value):
    for ok in (True, False, "auto"):
        EngineConfig(use_cuda_graph=ok)
    with pytest.raises(ValueError, match="use_cuda_graph"):
        EngineConfig(use_cuda_graph=value)


@pytest.mark.parametrize("value", [1, 0.0])
def test_use_cuda_graph_refuses_numbers_equal_to_bools(value):
    with pytest.raises(ValueError, match="use_cuda_graph"):
        EngineConfig(use_cuda_graph=value)


def test_enforce_eager_is_vllms_name_for_no_cuda_graph():
    assert EngineConfig(enforce_eager=True).use_cuda_graph is False
    assert EngineConfig(enforce_eager=True, use_cuda_graph=False).use_cuda_graph is False
    for graphs in (True, False, "auto"):  # False, vLLM's default, leaves the switch alone
        assert EngineConfig(enforce_eager=False, use_cuda_graph=graphs).use_cuda_graph == graphs
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(enforce_eager=True, use_cuda_graph=True)  # contradicts itself
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig().replace(enforce_eager=True, use_cuda_graph=True)
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(enforce_eager="yes")


@pytest.mark.parametrize("value", ["gpu", "mps", "", None, 0])
def test_device(value):
    for ok in ("cpu", "cuda", "cuda:1"):
        EngineConfig(device=ok)
    with pytest.raises(ValueError, match="device"):
        EngineConfig(device=value)


def test_replace_validates_and_max_blocks_per_seq():
    c = EngineConfig(max_model_len=100, block_size=16)
    assert c.max_blocks_per_seq == 7  # ceil(100 / 16)
    assert EngineConfig().max_blocks_per_seq is None
    assert c.replace(block_size=10).max_blocks_per_seq == 10
    with pytest.raises(ValueError, match="block_size"):
        c.replace(block_size=0)


# ---------------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(max_tokens=2.5), "max_tokens"),
        (dict(max_tokens=True), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature="hot"), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(top_p=-0.5), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(top_k=-2), "top_k"),  # -1 and 0 both turn it off, as in vLLM
        (dict(top_k=2.0), "top_k"),
        (dict(top_k=2**31), "top_k"),
        (dict(seed=1.5), "seed"),
        (dict(seed=2**64), "seed"),  # beyond what torch.Generator accepts
        (dict(seed=-(2**63) - 1), "seed"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(stop_token_ids=[2**63]), "stop_token_ids"),
        (dict(stop_token_ids=[1, -2]), "stop_token_ids"),
        (dict(stop_token_ids=[1.0]), "stop_token_ids"),
        (dict(stop_token_ids=["a"]), "stop_token_ids"),
        (dict(stop_token_ids=[True]), "stop_token_ids"),
    ],
)
def test_sampling_params_invalid(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_valid_edges():
    p = SamplingParams(max_tokens=1, temperature=0, top_k=0, top_p=1.0, stop_token_ids=[0, 7])
    assert p.stop_token_ids == (0, 7)  # a list becomes a tuple (hashable, frozen)


def test_sampling_params_single_int_stop_id():
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=5)


# ---------------------------------------------------------------------------------- add_request


def req(rid, n_prompt, max_tokens=4, first=0):
    return Request(
        rid,
        list(range(first, first + n_prompt)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


def snapshot(s: Scheduler):
    bm = s.block_manager
    return (
        [r.request_id for r in s.waiting],
        [r.request_id for r in s.running],
        sorted(s.requests),
        bm.num_free_blocks,
        dict(bm.block_tables),
    )


def drain(s: Scheduler, max_steps=200):
    finished = []
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return finished
        out = s.schedule()
        s.update(out, [1] * sum(1 for row in out.scheduled if row.do_sample))
        finished += s.take_finished()
    raise AssertionError("scheduler did not finish")


@pytest.mark.parametrize(
    "bad,config,message",
    [
        (lambda: req("x", 0), {}, "empty"),
        (lambda: req("x", 90, max_tokens=20), dict(max_model_len=100), "max_model_len 100"),
        # 60 prompt tokens + 40 outputs - 1 (the last token is never fed back) = 99 tokens -> 7
        # blocks of 16
        (lambda: req("x", 60, max_tokens=40), dict(num_blocks=6), "num_blocks=6"),
        (
            lambda: req("x", 65),
            dict(enable_chunked_prefill=False, max_num_batched_tokens=64),
            "max_num_batched_tokens is 64",
        ),
        (lambda: req("a", 3), {}, "'a' is already in use"),
    ],
)
def test_add_request_refuses_and_leaves_queue_untouched(bad, config, message):
    c = EngineConfig(**{"num_blocks": 64, "max_num_seqs": 2, **config})
    s = Scheduler(c)
    s.add_request(req("a", 5, first=1000))
    s.add_request(req("b", 7, first=2000))
    out = s.schedule()  # a and b running, c waiting: the refusal must not disturb any of them
    s.update(out, [1, 1])
    s.add_request(req("c", 4, first=3000))
    before = snapshot(s)
    with pytest.raises(ValueError, match=message):
        s.add_request(bad())
    assert snapshot(s) == before
    finished = drain(s)
    assert sorted(r.request_id for r in finished) == ["a", "b", "c"]
    assert all(r.num_output_tokens == 4 and r.finish_reason == "length" for r in finished)
    s.block_manager.check_invariants()
    assert s.block_manager.num_free_blocks == c.num_blocks


def test_limits_are_inclusive():
    """The largest request each limit allows is accepted (and runs)."""
    s = Scheduler(
        EngineConfig(
            num_blocks=7, max_model_len=100, enable_chunked_prefill=False, max_num_batched_tokens=64
        )
    )
    # 100 = max_model_len; 99 tokens = 7 blocks
    s.add_request(req("fits-len", 60, max_tokens=40, first=0))
    # prompt = max_num_batched_tokens
    s.add_request(req("fits-budget", 64, max_tokens=1, first=500))
    finished = drain(s)
    assert sorted((r.request_id, r.num_output_tokens) for r in finished) == [
        ("fits-budget", 1),
        ("fits-len", 40),
    ]


def test_duplicate_id_is_allowed_after_the_first_finished():
    s = Scheduler(EngineConfig(num_blocks=16))
    s.add_request(req("a", 3))
    drain(s)
    s.add_request(req("a", 3))  # ids name unfinished requests only
    assert [r.request_id for r in drain(s)] == ["a"]


def test_scheduler_needs_num_blocks():
    with pytest.raises(ValueError, match="num_blocks"):
        Scheduler(EngineConfig())


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(prompt_len=0, output_len=3), "prompt_len"),
        (dict(prompt_len=3, output_len=0), "output_len"),
        (dict(prompt_len=3, output_len=2, prompt_token_ids=[1, 2]), "prompt_token_ids"),
    ],
)
def test_simulate_refuses_bad_requests(kwargs, field):
    with pytest.raises(ValueError, match=field):
        simulate([SimRequest(**kwargs)], EngineConfig(num_blocks=8))
