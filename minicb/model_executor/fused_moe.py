"""A mixture-of-experts MLP: each token picks top_k of num_experts expert MLPs, and the step's
tokens are regrouped by expert so that each expert runs one matmul over all of its tokens.

A dense MLP multiplies every token by the same weights. An MoE layer has E expert MLPs (each a
SwiGLU like the dense one, with a smaller intermediate size) and a router, one linear layer that
scores the E experts for each token. A token runs through its top_k experts only, and their outputs
are summed, weighted by the router's probabilities (Shazeer et al., 2017; Switch Transformer,
Fedus et al., 2021; Mixtral, Jiang et al., 2024):

  router_logits = x @ W_gate^T                            (num_tokens, E)
  probs         = softmax(router_logits) in float32, then the top_k of them (renormalized to sum
                  to 1 for Mixtral, and for Qwen3-MoE when config.norm_topk_prob is set)
  out[t]        = sum over the top_k experts e of t:  probs[t, e] * expert_e(x[t])

Two ways to compute it, both here:

- `moe_loop`, the reference (transformers' eager path): for each expert, find its tokens, run
  them, add the weighted results into place. Clear, but the expert loop is driven by the host.
- `fused_moe`, the fused form that vLLM's FusedMoE layer computes with one Triton kernel: sort the
  step's num_tokens x top_k (token, expert) pairs by expert, so each expert's tokens are one
  contiguous run of rows; one grouped matmul for gate_up over all runs, the activation, one grouped
  matmul for down, then unsort and combine. The grouped matmul is `torch._grouped_mm` where
  PyTorch has it for the dtype (float32, bfloat16, float16; CPUs and Hopper GPUs), which takes the
  run boundaries as a device tensor: no host read, no shape that depends on the routing, so it
  can sit inside a CUDA graph with no padding at all. Where it is missing (float64, older GPUs),
  eager steps loop over the runs, and a captured step pads every expert to a capacity of
  num_tokens rows (no expert can get more: a token picks an expert at most once) and runs one
  batched matmul; that costs E / top_k times the work, which only the float64 tests pay.

The weights are stored as vLLM's FusedMoE stores them: `w13_weight` (E, 2 * I, hidden), each
expert's gate and up projections stacked, and `w2_weight` (E, hidden, I), its down projection.
gpt-oss's experts add a bias to each (`w13_bias`, `w2_bias`) and a clamped SwiGLU (gpt_oss.py): the
expert's middle is a `glu` function of the (rows, 2 * I) gate_up rows, SwiGLU by default.
"""

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from transformers.activations import ACT2FN

from .gpt_oss import GptOssRouter, swigluoai
from .grouped_topk import GroupedTopkRouter
from .hf_config import moe_spec_of

GROUPED_MM_SUPPORT: dict[tuple[str, torch.dtype], bool] = {}  # probed once per device and dtype
METHODS = ("auto", "grouped_mm", "segments", "padded")


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights, topk_ids), each (num_tokens, top_k): the router's top_k experts per token and
    their probabilities, in float32 whatever the model's dtype (as transformers and vLLM's
    fused_topk compute them), largest first."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # (num_tokens, E)
    topk_weights, topk_ids = probs.topk(top_k, dim=-1)
    if renormalize:  # the top_k weights sum to 1 (Mixtral; Qwen3-MoE with norm_topk_prob)
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def tokens_per_expert(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(E,) int64: how many of the step's tokens picked each expert. Static shape, no host read
    (torch.bincount's length would depend on the values)."""
    flat = topk_ids.flatten()
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )


def swiglu(gate_up: torch.Tensor, act=F.silu) -> torch.Tensor:
    """(rows, 2 * I) -> (rows, I): act(gate) * up, the expert MLP's middle."""
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up


def combine(y: torch.Tensor, topk_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(num_tokens * top_k, hidden) expert outputs in (token, choice) order -> (num_tokens, hidden):
    each token's top_k outputs weighted by the router and summed, in float32 or better."""
    num_tokens, top_k = topk_weights.shape
    wide = torch.promote_types(y.dtype, torch.float32)  # bf16 outputs are weighted in float32
    y = y.view(num_tokens, top_k, y.shape[-1]).to(wide)
    return (y * topk_weights.to(wide).unsqueeze(-1)).sum(dim=1).to(dtype)


# --- the reference: one expert at a time -------------------------------------------------------


def moe_loop(
    x, w13, w2, topk_weights, topk_ids, glu=swiglu, w13_bias=None, w2_bias=None
) -> torch.Tensor:
    """The unfused MoE (transformers' eager experts): for each expert, gather the tokens that picked
    it, run its MLP, add the weighted result into those tokens' rows. x: (num_tokens, hidden)."""
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        token_idx, choice = torch.where(topk_ids == e)  # a data-dependent shape: eager only
        if token_idx.numel() == 0:
            continue
        gate_up = F.linear(x[token_idx], w13[e])  # (tokens of e, 2 * I)
        if w13_bias is not None:
            gate_up = gate_up + w13_bias[e]
        y = F.linear(glu(gate_up), w2[e])  # (tokens of e, hidden)
        if w2_bias is not None:
            y = y + w2_bias[e]
        y = y * topk_weights[token_idx, choice, None].to(x.dtype)
        out.index_add_(0, token_idx, y)
    return out


# --- the fused form: sort by expert, grouped matmuls, unsort, combine --------------------------


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int):
    """The (token, choice) pairs regrouped so each expert's are contiguous (vLLM's
    moe_align_block_size, without its padding). Returns (order, expert_of_row, counts): row i of
    the sorted batch is pair order[i] of topk_ids.flatten(), it goes to expert expert_of_row[i],
    and counts (E,) says how long each expert's run is."""
    flat = topk_ids.flatten()  # (num_tokens * top_k,): pair p is token p // top_k
    order = flat.argsort(stable=True)  # stable: within an expert, tokens keep their order
    return order, flat[order], tokens_per_expert(topk_ids, num_experts)


def grouped_linear(
    x_sorted, w, expert_of_row, counts, method: str = "auto", capacity: int | None = None
) -> torch.Tensor:
    """y[i] = x_sorted[i] @ w[expert_of_row[i]]^T for rows already sorted by expert. x_sorted:
    (rows, in); w: (E, out, in); counts: (E,) rows per expert. -> (rows, out). `capacity`: the
    most rows one expert can have ("padded" sizes every expert to it; default: all the rows)."""
    if method == "auto":
        method = auto_method(x_sorted)
    if method == "grouped_mm":
        ends = counts.cumsum(0).to(torch.int32)  # where each expert's run ends, on the device
        return torch._grouped_mm(x_sorted, w.transpose(1, 2), offs=ends)
    if method == "segments":  # one host read of the counts, then one matmul per non-empty run
        out = x_sorted.new_empty(x_sorted.shape[0], w.shape[1])
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                out[start : start + n] = F.linear(x_sorted[start : start + n], w[e])
                start += n
        return out
    if method == "padded":  # static shapes: every expert gets `capacity` rows, most of them zero
        rows, num_experts = x_sorted.shape[0], w.shape[0]
        capacity = rows if capacity is None else capacity
        starts = counts.cumsum(0) - counts  # (E,): the first row of each expert's run
        rank = torch.arange(rows, device=x_sorted.device) - starts[expert_of_row]
        padded = x_sorted.new_zeros(num_experts, capacity, x_sorted.shape[1])
        padded[expert_of_row, rank] = x_sorted  # (E, capacity, in)
        return torch.bmm(padded, w.transpose(1, 2))[expert_of_row, rank]
    raise ValueError(f"unknown fused MoE method {method!r}; choose one of {', '.join(METHODS)}")


def fused_moe(
    x, w13, w2, topk_weights, topk_ids, glu=swiglu, method="auto", w13_bias=None, w2_bias=None
):
    """The fused MoE (vLLM's fused_experts): route-sorted rows, two grouped matmuls, combine.
    x: (num_tokens, hidden) -> (num_tokens, hidden). `method`: "auto" picks grouped_mm where
    PyTorch has it, else "segments" in eager steps and "padded" inside a captured graph."""
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    order, expert_of_row, counts = sort_by_expert(topk_ids, num_experts)
    x_sorted = x[order // top_k]  # (num_tokens * top_k, hidden): each token once per choice
    # a token picks an expert at most once: no expert gets more than num_tokens rows
    runs = (expert_of_row, counts, method, x.shape[0])
    gate_up = add_expert_bias(grouped_linear(x_sorted, w13, *runs), w13_bias, expert_of_row)
    y_sorted = add_expert_bias(grouped_linear(glu(gate_up), w2, *runs), w2_bias, expert_of_row)
    y = torch.empty_like(y_sorted)
    y[order] = y_sorted  # back to (token, choice) order
    return combine(y, topk_weights, x.dtype)


def add_expert_bias(y, bias, expert_of_row) -> torch.Tensor:
    """Each sorted row's expert's bias added (gpt-oss), y as it is where the experts have none.
    A gather by row, static in shape: safe inside a CUDA graph."""
    return y if bias is None else y + bias[expert_of_row]


def auto_method(x: torch.Tensor) -> str:
    if grouped_mm_supported(x.device, x.dtype):
        return "grouped_mm"
    return "padded" if capturing() else "segments"


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs here for this dtype (tried once on a tiny problem, never
    inside a capture, where the probe itself could not run: the static path is taken then)."""
    key = (str(device), dtype)
    if key not in GROUPED_MM_SUPPORT and capturing():
        return False
    if key not in GROUPED_MM_SUPPORT:
        try:
            a = torch.ones(2, 8, device=device, dtype=dtype)
            b = torch.ones(2, 8, 8, device=device, dtype=dtype)
            ends = torch.tensor([1, 2], device=device, dtype=torch.int32)
            torch._grouped_mm(a, b, offs=ends)
            GROUPED_MM_SUPPORT[key] = True
        except (AttributeError, RuntimeError, NotImplementedError):
            GROUPED_MM_SUPPORT[key] = False
    return GROUPED_MM_SUPPORT[key]


def capturing() -> bool:
    """True while a CUDA graph is being captured, or its CPU emulation runs (a dispatch mode that
    refuses host reads: worker/graph_safety.py): no host read and no value-dependent shape then."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return True
    return any(getattr(m, "refuses_host_reads", False) for m in _get_current_dispatch_mode_stack())


class FusedMoE(nn.Module):
    """The experts of one MoE layer, stacked (vLLM's FusedMoE): w13_weight (E, 2 * I, hidden),
    w2_weight (E, hidden, I), and with `bias` (gpt-oss) w13_bias (E, 2 * I), w2_bias (E, hidden).
    `glu`: (rows, 2 * I) gate_up -> (rows, I). With expert parallelism a rank holds a contiguous
    slice of them."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, glu, bias: bool = False
    ):
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.w13_bias = self.w2_bias = None
        if bias:
            self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size))
            self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.glu = glu
        self.method = "auto"  # or "loop": the reference, for a notebook or a test to compare

    def forward(self, x, topk_weights, topk_ids):
        args = (x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.glu)
        biases = dict(w13_bias=self.w13_bias, w2_bias=self.w2_bias)
        if self.method == "loop":
            return moe_loop(*args, **biases)
        return fused_moe(*args, method=self.method, **biases)

    def extra_repr(self):
        return (
            f"experts={self.num_experts}, hidden={self.w2_weight.shape[1]}, "
            f"intermediate={self.intermediate_size}, method={self.method}"
        )


class SparseMoeBlock(nn.Module):
    """An MoE MLP: the router (`gate`, a linear layer hidden -> E with no bias) and the experts.
    Keeps the step's tokens per expert (`last_load`, (E,) on the device) for the trace."""

    def __init__(
        self,
        hidden_size,
        num_experts,
        top_k,
        intermediate_size,
        renormalize,
        glu,
        num_local_experts=None,
        router=None,
        shared_experts=None,
        expert_bias=False,
    ):
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        # a linear layer scored by softmax, or a router module giving (weights, ids) itself
        # (DeepSeek-V3's: grouped_topk.py)
        self.gate = nn.Linear(hidden_size, num_experts, bias=False) if router is None else router
        local = num_experts if num_local_experts is None else num_local_experts
        self.experts = FusedMoE(local, hidden_size, intermediate_size, glu, expert_bias)
        self.shared_experts = shared_experts  # an MLP every token runs through too (DeepSeek)
        self.last_load = None

    def route(self, x) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(self.gate, nn.Linear):
            topk_weights, topk_ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        else:
            topk_weights, topk_ids = self.gate(x)
        self.last_load = tokens_per_expert(topk_ids, self.num_experts)
        return topk_weights, topk_ids

    def forward(self, x):
        topk_weights, topk_ids = self.route(x)
        out = self.experts(x, topk_weights, topk_ids)
        return out if self.shared_experts is None else out + self.shared_experts(x)


def moe_block(cfg, layer_idx: int, mlp_class) -> SparseMoeBlock | None:
    """This layer's mixture of experts, or None where its MLP is dense (`mlp_class(cfg,
    intermediate_size)` builds DeepSeek's shared experts). With expert parallelism
    (worker/expert_parallel.py) the config names this rank's share of the experts: `ep_size` ranks,
    each holding num_experts / ep_size of them, while the router still scores all of them."""
    spec = moe_spec_of(cfg, layer_idx)
    if spec is None:
        return None
    router = shared = None
    glu = partial(swiglu, act=ACT2FN[cfg.hidden_act])
    if cfg.model_type == "deepseek_v3":  # grouped sigmoid routing, and shared experts
        router = GroupedTopkRouter(cfg)
        shared = mlp_class(cfg, cfg.moe_intermediate_size * cfg.n_shared_experts)
    is_gpt_oss = cfg.model_type == "gpt_oss"
    if is_gpt_oss:  # top_k logits then softmax, experts with biases and a clamped SwiGLU
        router = GptOssRouter(cfg.hidden_size, spec.num_experts, spec.top_k)
        glu = partial(swigluoai, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
    return SparseMoeBlock(
        cfg.hidden_size,
        spec.num_experts,
        spec.top_k,
        spec.intermediate_size,
        spec.renormalize,
        glu,
        num_local_experts=spec.num_experts // getattr(cfg, "ep_size", 1),
        router=router,
        shared_experts=shared,
        expert_bias=is_gpt_oss,
    )


def expert_load(model) -> torch.Tensor | None:
    """(moe_layers, num_experts) int64 on the device: how many of the model's last step's tokens
    each MoE layer routed to each expert (a token counts once for each expert it picked); None for
    a dense model."""
    if not hasattr(model, "moe_blocks"):  # found once (after tensor parallelism wrapped them)
        model.moe_blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    if not model.moe_blocks or model.moe_blocks[0].last_load is None:
        return None
    return torch.stack([m.last_load for m in model.moe_blocks])
