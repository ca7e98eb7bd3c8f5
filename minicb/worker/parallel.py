"""Tensor parallelism over torch.distributed: one model's layers split across N processes.

Idea (Megatron-LM, Shoeybi et al., 2019), as vLLM runs it with `tensor_parallel_size=N`. Each linear
layer of a decoder block is split so that a block needs only two collectives:

  attention  qkv_proj split by COLUMNS (its output features): rank r computes the q, k and v of its
             own H/N query heads and KV/N KV heads, attends with its own KV cache, and o_proj, split
             by ROWS (its input features), turns its heads into a partial sum of the output.
             One all-reduce adds the N partial sums.
  MLP        gate_up_proj by columns (rank r owns intermediate_size/N features), down_proj by rows,
             one all-reduce.

So a step costs 2 x num_layers all-reduces, each of (tokens in the step) x hidden_size values. A
ring all-reduce puts 2(N-1)/N of that payload on every link, which is why TP wants NVLink and stays
inside one node (pipeline parallelism and replicas scale further, passing far fewer bytes). Biases
of the row-split layers are added by rank 0 only, so the sum counts them once.

The embedding and the LM head are REPLICATED here: every rank holds the whole vocab x hidden table
and computes the same logits, with no collective. vLLM splits them by vocabulary instead (its
VocabParallelEmbedding): the embedding then costs one more all-reduce of tokens x hidden, and the
logits a gather of (sampled rows) x vocab, in exchange for 1/N of their memory per rank. For the
small models minicb runs, the memory is cheaper than the bytes.

Processes, as vLLM V0 laid them out (history; V1 keeps the scheduler in an engine-core process that
holds no shard and runs one worker per rank, rank 0 included, each sampling from all-gathered
logits, with the SchedulerOutput broadcast over a shared-memory queue: notebook 15): the Engine's
process is rank 0 (the driver: it runs the scheduler once and samples), and ranks 1..N-1 are worker
processes started with torch.multiprocessing. Each step the driver broadcasts what the step needs
(block copies, then the host inputs of its rows) with torch.distributed's broadcast_object_list;
every rank runs the same forward on its shard, and each keeps the KV cache of its own KV heads, so
the same memory per rank holds N times the blocks. Backend: "gloo" on CPU (tested in CI with two
processes), "nccl" with device="cuda" (rank r on cuda:r; not tested in CI). KV heads are never
replicated: N must divide num_key_value_heads (vLLM would replicate them when N is a multiple), and
CUDA graphs are refused with N > 1.
"""

import atexit
import copy
import dataclasses
import datetime
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from ..model_executor.fused_moe import SparseMoeBlock
from ..model_executor.gpt_oss import gpt_oss_shard, is_gpt_oss_shardable
from ..model_executor.hf_config import head_dim_of, mla_spec_of, moe_spec_of, num_kv_heads_of
from ..model_executor.weights import per_expert_names
from .expert_parallel import ExpertParallelMoE, expert_slice
from .kv_cache import block_transfers

TIMEOUT = datetime.timedelta(seconds=60)  # a collective that waits longer means a rank is gone


def check_tensor_parallel(hf_config, n: int, expert_parallel: bool = False) -> None:
    """Raise ValueError, naming the numbers, unless the model splits into n whole-head shards (and,
    with expert parallelism, n shares of whole experts)."""
    heads, kv_heads = hf_config.num_attention_heads, num_kv_heads_of(hf_config)
    if mla_spec_of(hf_config) is not None:
        raise ValueError(
            "tensor_parallel_size > 1 is not supported with multi-head latent attention "
            "(DeepSeek-V3) yet"
        )
    if heads % n:
        raise ValueError(
            f"tensor_parallel_size={n} must divide num_attention_heads={heads} (each rank owns "
            "whole heads)"
        )
    if kv_heads % n:
        raise ValueError(
            f"tensor_parallel_size={n} must divide num_key_value_heads={kv_heads}: minicb does not "
            f"replicate KV heads (vLLM does when tensor_parallel_size is a multiple of them)"
        )
    layers = range(hf_config.num_hidden_layers)
    moe = next((spec for i in layers if (spec := moe_spec_of(hf_config, i))), None)
    has_dense_mlp = any(moe_spec_of(hf_config, i) is None for i in layers)
    if expert_parallel and moe is None:
        raise ValueError(
            f"enable_expert_parallel needs a mixture-of-experts model; {hf_config.model_type} has "
            "dense MLPs only"
        )
    if has_dense_mlp and hf_config.intermediate_size % n:
        raise ValueError(
            f"tensor_parallel_size={n} must divide intermediate_size={hf_config.intermediate_size}"
        )
    if moe is not None and expert_parallel and moe.num_experts % n:
        raise ValueError(
            f"tensor_parallel_size={n} must divide num_experts={moe.num_experts} with "
            "enable_expert_parallel (each rank holds whole experts)"
        )
    if moe is not None and not expert_parallel and moe.intermediate_size % n:
        raise ValueError(
            f"tensor_parallel_size={n} must divide the experts' intermediate size "
            f"{moe.intermediate_size} (or set enable_expert_parallel=True)"
        )


def shard_config(hf_config, n: int, expert_parallel: bool = False):
    """The config of one rank's shard: its heads and MLP features (head_dim kept explicit); with
    expert parallelism, whole experts (`ep_size`: model.moe_block holds E / ep_size of them)."""
    local = copy.deepcopy(hf_config)
    local.head_dim = head_dim_of(hf_config)
    local.num_attention_heads = hf_config.num_attention_heads // n
    local.num_key_value_heads = num_kv_heads_of(hf_config) // n
    # Mixtral's and gpt-oss's intermediate_size is their experts': whole with expert parallelism
    if hf_config.model_type not in ("mixtral", "gpt_oss") or not expert_parallel:
        local.intermediate_size = hf_config.intermediate_size // n
    if hf_config.model_type == "qwen3_moe" and not expert_parallel:
        local.moe_intermediate_size = hf_config.moe_intermediate_size // n
    if expert_parallel:
        local.ep_size = n
    return local


# output features (rows of the weight)
COLUMN_SPLIT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_SPLIT = ("o_proj", "down_proj")  # input features (columns of the weight), then an all-reduce


def shard_state_dict(
    state_dict: dict[str, torch.Tensor], rank: int, n: int, expert_parallel_config=None
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slice of every weight (Hugging Face names). Rows of q/k/v are head after head,
    so a contiguous chunk of rows is a contiguous run of whole heads. Experts are split like dense
    MLPs, or, given the model's config for expert parallelism, kept whole: E / n of them. gpt-oss's
    sinks and stacked experts have rules of their own (gpt_oss.gpt_oss_shard)."""
    gpt_oss = any(name.endswith(".sinks") for name in state_dict)
    if not gpt_oss:
        state_dict = per_expert_names(state_dict)  # every expert's gate, up and down apart
    if expert_parallel_config is not None and not gpt_oss:

        def num_experts_of(name: str) -> int:
            layer = int(name.split("layers.")[1].split(".")[0])
            return moe_spec_of(expert_parallel_config, layer).num_experts

        state_dict = expert_slice(state_dict, rank, n, num_experts_of)
    out = {}
    for name, t in state_dict.items():
        kind = name.split(".")[-2] if name.count(".") >= 1 else ""
        if gpt_oss and is_gpt_oss_shardable(name):
            out[name] = gpt_oss_shard(name, t, rank, n, expert_parallel_config is not None)
        elif expert_parallel_config is not None and ".experts." in name:
            out[name] = t  # a whole expert of this rank's share
        elif kind in COLUMN_SPLIT:
            out[name] = t.chunk(n, dim=0)[rank].clone()
        elif kind in ROW_SPLIT and name.endswith("weight"):
            out[name] = t.chunk(n, dim=1)[rank].clone()
        elif kind in ROW_SPLIT:  # the bias of a row-split layer: added once, by rank 0
            out[name] = t.clone() if rank == 0 else torch.zeros_like(t)
        else:
            out[name] = t  # norms, embedding, LM head: replicated
    return out


@dataclasses.dataclass
class CollectiveLog:
    """What the model's collectives moved, step by step, as seen by one rank."""

    # per step: payload bytes of each all-reduce
    steps: list[list[int]] = dataclasses.field(default_factory=list)
    # expert parallelism, per step: bytes this rank sent to other ranks in each all-to-all
    # (dispatch, combine, dispatch, ... layer after layer), and its share in each all-gather
    all_to_all: list[list[int]] = dataclasses.field(default_factory=list)
    all_gather: list[list[int]] = dataclasses.field(default_factory=list)

    def new_step(self) -> None:
        for per_step in (self.steps, self.all_to_all, self.all_gather):
            per_step.append([])

    def record(self, tensor: torch.Tensor) -> None:
        if not self.steps:
            self.new_step()
        self.steps[-1].append(tensor.numel() * tensor.element_size())

    def record_all_to_all(self, num_bytes: int) -> None:
        if not self.steps:
            self.new_step()
        self.all_to_all[-1].append(num_bytes)

    def record_all_gather(self, num_bytes: int) -> None:
        if not self.steps:
            self.new_step()
        self.all_gather[-1].append(num_bytes)


class AllReduce(nn.Module):
    """A row-split linear: its output is this rank's partial sum; the all-reduce adds every
    rank's."""

    def __init__(self, linear: nn.Module, log: CollectiveLog):
        super().__init__()
        self.linear, self.log = linear, log

    def forward(self, x):
        y = self.linear(x)  # (tokens, hidden): this rank's heads' (or features') share
        self.log.record(y)
        dist.all_reduce(y)
        return y


def build_shard(loaded, config, rank: int, log: CollectiveLog):
    """(model, local hf_config) of one rank: the sharded weights, row-split layers wrapped in
    AllReduce."""
    from ..model_executor.model import CausalLM

    n, ep = config.tensor_parallel_size, config.enable_expert_parallel
    local = shard_config(loaded.hf_config, n, ep)
    weights = shard_state_dict(loaded.state_dict, rank, n, loaded.hf_config if ep else None)
    model = CausalLM.from_hf(local, weights, getattr(torch, config.dtype), device_of(config, rank))
    for layer in model.layers:
        layer.self_attn.o_proj = AllReduce(layer.self_attn.o_proj, log)
        if isinstance(layer.mlp, SparseMoeBlock) and ep:  # experts whole, tokens travel
            layer.mlp = ExpertParallelMoE(layer.mlp, rank, n, log)
        elif isinstance(layer.mlp, SparseMoeBlock):  # every expert split: partial sums, all-reduced
            layer.mlp = AllReduce(layer.mlp, log)
        else:
            layer.mlp.down_proj = AllReduce(layer.mlp.down_proj, log)
    return model, local


def device_of(config, rank: int) -> str:
    return f"cuda:{rank}" if config.device.startswith("cuda") else "cpu"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallel:
    """The driver's side (rank 0, in the Engine's process): starts the workers, holds rank 0's
    shard, and sends each step's inputs to every worker."""

    def __init__(self, loaded, config):
        check_tensor_parallel(
            loaded.hf_config, config.tensor_parallel_size, config.enable_expert_parallel
        )
        self.n, self.log = config.tensor_parallel_size, CollectiveLog()
        self.backend = "nccl" if config.device.startswith("cuda") else "gloo"
        if dist.is_initialized():
            raise RuntimeError(
                "a torch.distributed process group already exists in this process: "
                "shut the other tensor-parallel engine down first (Engine.shutdown())"
            )
        init = f"tcp://127.0.0.1:{_free_port()}"
        light = dataclasses.replace(loaded, tokenizer=None)  # workers never detokenize
        # a fresh interpreter per worker: no forked threads or CUDA state
        ctx = mp.get_context("spawn")
        self.workers = [
            ctx.Process(
                target=_worker_main,
                args=(r, self.n, init, self.backend, light, config),
                daemon=True,
                name=f"minicb-tp-worker-{r}",
            )
            for r in range(1, self.n)
        ]
        for w in self.workers:
            w.start()
        dist.init_process_group(
            self.backend, init_method=init, rank=0, world_size=self.n, timeout=TIMEOUT
        )
        self.model, self.hf_config = build_shard(loaded, config, 0, self.log)
        self.closed = False
        # a script that never calls Engine.shutdown() still stops its workers
        atexit.register(self.shutdown)

    def send(self, message) -> None:
        """Broadcast one message to every worker (rank 0 is the source)."""
        if self.closed:
            raise RuntimeError("tensor-parallel workers are shut down")
        try:
            dist.broadcast_object_list([message], src=0)
        except Exception as e:
            self.shutdown()
            raise RuntimeError(f"a tensor-parallel worker is gone ({type(e).__name__}: {e})") from e

    def step(self, out, host) -> None:
        """Before rank 0 runs a step: the block copies, and the rows' host inputs (None: no
        forward)."""
        self.log.new_step()
        self.send(("step", block_transfers(out), host))

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the workers and leave the process group; safe to call twice, and after a worker
        died."""
        if self.closed:
            return
        self.closed = True
        if all(w.is_alive() for w in self.workers):
            try:
                dist.broadcast_object_list([("stop",)], src=0)
            except Exception:
                pass  # a worker died meanwhile: it is joined or killed below
        for w in self.workers:
            w.join(timeout_s)
            if w.is_alive():
                w.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


def _worker_main(rank: int, n: int, init: str, backend: str, loaded, config) -> None:
    """Ranks 1..N-1: mirror every step of rank 0 on this shard until told to stop."""
    from ..model_executor.kv_quant import cache_dtype_of
    from .kv_cache import KVCache
    from .model_runner import ModelRunner

    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=n, timeout=TIMEOUT)
    try:
        log = CollectiveLog()
        model, local = build_shard(loaded, config, rank, log)
        dtype, device = getattr(torch, config.dtype), device_of(config, rank)
        kv_cache = KVCache(
            local,
            config.num_blocks,
            config.block_size,
            dtype,
            device,
            config.num_swap_blocks,
            cache_dtype_of(config.kv_cache_dtype, dtype),
            config.num_offload_blocks or 0,
            config.kv_cache_groups,
        )
        runner = ModelRunner(model, kv_cache, config, device)
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            kind, *rest = box[0]
            if kind == "stop":
                break
            if kind != "step":
                raise ValueError(f"tensor-parallel worker {rank}: unknown message {kind!r}")
            transfers, host = rest
            kv_cache.transfer(*transfers)
            if host is not None:
                with torch.inference_mode():
                    input_ids, positions, meta, _ = runner.inputs_from_host(host)
                    model(input_ids, positions, kv_cache, meta)  # its all-reduces meet rank 0's
    finally:
        dist.destroy_process_group()
