"""Expert parallelism: a mixture of experts' experts spread over the N tensor-parallel processes,
each token sent to the rank that holds its expert and its result sent back (all-to-all).

With `tensor_parallel_size=N` alone, every expert is split like a dense MLP: each rank holds 1/N
of every expert's intermediate features, runs every token through its slices, and one all-reduce
adds the partial sums. With `enable_expert_parallel=True` (vLLM's name) rank r instead holds E / N
whole experts, r * E / N up to (r + 1) * E / N, and an MoE layer goes (GShard, Lepikhin et al.,
2020; DeepSeek-V3's EP, as vLLM runs it with its all-to-all backends):

  route     the router is replicated: every rank scores all of the step's tokens and gets the
            same top_k experts for each (which also gives every rank the whole step's load)
  split     rank r keeps its own contiguous share of the step's tokens (vLLM's
            sequence_parallel_chunk: attention ran tensor-parallel, so every rank holds them all)
  dispatch  all-to-all: each of its (token, expert) pairs goes to the rank that holds the expert
  experts   each rank runs the rows it received through its own experts (fused_moe.py)
  combine   all-to-all back: each row returns to the rank that sent it; weighted sum per token
  gather    all-gather of the N shares, so every rank holds every token for the next attention

So a layer moves, per rank, the hidden rows of its pairs whose expert lives elsewhere, there and
back: with uniform routing T * top_k * (N - 1) / N rows in all over the N ranks each way, against
the all-reduce of T rows that the split experts cost. The all-to-all is worth it when experts are
many and large (each rank reads E / N experts' weights, not a slice of all E), which is why
DeepSeek-V3 and Qwen3-235B are served this way. Which ranks' experts are hot varies step to step:
the trace keeps each step's routing and `traffic` (pairs from each rank's share to each rank's
experts), from which notebook 20 computes load imbalance and what EPLB's redundant experts buy.

A row travels once per (token, expert) pair. DeepEP's dispatch sends a token once per rank that
holds any of its experts and adds up that rank's experts' outputs before the combine, which saves up
to top_k - 1 copies when experts of one token share a rank; minicb keeps the simpler count.

Every rank routes the whole step here, so the split sizes of both all-to-alls are known to all
ranks without a first exchange of counts; an engine whose ranks hold different tokens (vLLM's
data-parallel attention) exchanges those counts first. Host reads of the routing size the
all-to-alls, so, like tensor parallelism, this runs without CUDA graphs.
"""

import torch
import torch.distributed as dist
from torch import nn

from ..model_executor.fused_moe import combine


def token_shares(num_tokens: int, n: int) -> list[int]:
    """Where each rank's share of the step's tokens starts, and the end: n + 1 bounds, the first
    num_tokens % n shares one token longer (torch.tensor_split's rule)."""
    base, extra = divmod(num_tokens, n)
    bounds = [0]
    for r in range(n):
        bounds.append(bounds[-1] + base + (1 if r < extra else 0))
    return bounds


def expert_slice(state_dict: dict[str, torch.Tensor], rank: int, n: int, num_experts_of):
    """Rank `rank`'s experts, renumbered from 0: `...experts.{e}.*` for e in its contiguous E / n
    (per-expert names: weights.per_expert_names). `num_experts_of(name)`: E of that layer."""
    out = {}
    for name, t in state_dict.items():
        head, sep, tail = name.partition(".experts.")
        if not sep:
            out[name] = t
            continue
        e, rest = tail.split(".", 1)
        local = num_experts_of(name) // n
        if rank * local <= int(e) < (rank + 1) * local:
            out[f"{head}.experts.{int(e) - rank * local}.{rest}"] = t
    return out


class ExpertParallelMoE(nn.Module):
    """One rank's MoE layer under expert parallelism: `block` (a SparseMoeBlock holding this rank's
    experts and the whole router) between the all-to-alls. In: every token of the step, the same
    on every rank. Out: the layer's output for every token, the same on every rank."""

    def __init__(self, block, rank: int, n: int, log):
        super().__init__()
        self.block, self.rank, self.n, self.log = block, rank, n, log
        self.num_local = block.experts.num_experts
        self.last_traffic = None  # (n, n): pairs from rank s's share to rank d's experts

    def forward(self, x):
        topk_weights, topk_ids = self.block.route(x)  # (T, top_k) each, identical on every rank
        bounds = token_shares(x.shape[0], self.n)
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        owner = topk_ids // self.num_local  # (T, top_k): the rank that holds each pair's expert
        traffic = self.traffic(owner, bounds)  # (n, n) on the host
        self.last_traffic = traffic
        send_counts = traffic[self.rank]  # my pairs, by destination rank
        recv_counts = [row[self.rank] for row in traffic]  # pairs for my experts, by source

        # dispatch: my pairs sorted by expert (so by destination), each carrying its token's row
        own_ids = topk_ids[lo:hi]
        order = own_ids.flatten().argsort(stable=True)
        sent = x[lo:hi][order // own_ids.shape[1]]  # (my pairs, hidden)
        received = self.all_to_all(sent, recv_counts, send_counts)
        local_ids = self.received_experts(topk_ids, bounds)  # (received,) my expert of each row
        ones = torch.ones(len(local_ids), 1, dtype=torch.float32, device=x.device)
        y = self.block.experts(received, ones, local_ids[:, None])  # each row through one expert

        # combine: every row back to the rank it came from, then each token's weighted sum
        returned = self.all_to_all(y, send_counts, recv_counts)
        pairs = torch.empty_like(returned)
        pairs[order] = returned  # (my tokens * top_k, hidden) in (token, choice) order
        mine = combine(pairs, topk_weights[lo:hi], x.dtype)  # (my tokens, hidden)
        return self.all_gather(mine, bounds)

    def received_experts(self, topk_ids, bounds: list[int]) -> torch.Tensor:
        """Which of this rank's experts each received row is for, numbered from 0 here. Rank s sent
        its pairs sorted by expert, and all_to_all puts rank 0's rows first: every rank knows the
        routing, so it needs no message to know them."""
        by_source = [
            topk_ids[bounds[s] : bounds[s + 1]].flatten().sort(stable=True).values
            for s in range(self.n)
        ]
        expert = torch.cat(by_source)
        return expert[expert // self.num_local == self.rank] - self.rank * self.num_local

    def traffic(self, owner: torch.Tensor, bounds: list[int]) -> list[list[int]]:
        """(n, n) host counts: [s][d] = pairs of rank s's tokens whose expert rank d holds."""
        src = torch.zeros(owner.shape[0], dtype=torch.long, device=owner.device)
        for s in range(1, self.n):
            src[bounds[s] :] = s
        cells = (src[:, None] * self.n + owner).flatten()
        counts = torch.zeros(self.n * self.n, dtype=torch.long, device=owner.device)
        counts.scatter_add_(0, cells, torch.ones_like(cells))
        return counts.view(self.n, self.n).tolist()

    def all_to_all(self, rows, recv_counts: list[int], send_counts: list[int]):
        """Send send_counts[d] rows to rank d, receive recv_counts[s] from rank s; logs the bytes
        that leave this rank (its rows for itself stay)."""
        out = rows.new_empty(sum(recv_counts), rows.shape[1])
        row_bytes = rows.shape[1] * rows.element_size()
        self.log.record_all_to_all(row_bytes * (sum(send_counts) - send_counts[self.rank]))
        dist.all_to_all_single(out, rows.contiguous(), recv_counts, send_counts)
        return out

    def all_gather(self, mine, bounds: list[int]):
        """Every rank's share, in order: (T, hidden). Shares are padded to the longest (all_gather
        takes equal sizes)."""
        longest = bounds[1] - bounds[0]
        padded = mine.new_zeros(longest, mine.shape[1])
        padded[: mine.shape[0]] = mine
        shares = [torch.empty_like(padded) for _ in range(self.n)]
        self.log.record_all_gather(padded.numel() * padded.element_size())
        dist.all_gather(shares, padded)
        return torch.cat([shares[s][: bounds[s + 1] - bounds[s]] for s in range(self.n)])


def expert_traffic(model) -> list[list[list[int]]] | None:
    """Per MoE layer, the last step's (n, n) traffic matrix; None without expert parallelism."""
    layers = [m.last_traffic for m in model.modules() if isinstance(m, ExpertParallelMoE)]
    return layers or None
