"""DeepSeek-V3's router: sigmoid scores, a bias that balances the experts' load, and experts
chosen from a few groups only (vLLM's grouped_topk with scoring_func="sigmoid").

Mixtral and Qwen3-MoE pick their top_k experts from a softmax over all of them (fused_moe.py).
DeepSeek-V3 (technical report, 2024, section 2.1.2) scores each expert with a sigmoid instead, and
routes in two stages:

  scores  = sigmoid(x @ W_gate^T)                       (num_tokens, E), in float32
  choice  = scores + e_score_correction_bias             the bias only steers the choice
  groups  = the topk_group of n_group expert groups with the highest sum of their 2 best choices
  experts = the top_k choices within those groups
  weights = their scores (without the bias), renormalized to sum to 1, times routed_scaling_factor

The bias replaces an auxiliary balancing loss: training nudges an overloaded expert's bias down
("auxiliary-loss-free load balancing"), so it is chosen less, while its weight, when chosen, stays
its own score. The groups bound how many devices a token's experts span (DeepSeek-V3 places one
group per node), which caps the all-to-all of expert parallelism. Shared experts, which every
token runs through besides its routed ones, are a plain MLP beside the block (fused_moe.py).
"""

import torch
import torch.nn.functional as F
from torch import nn


def grouped_topk(
    router_logits: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    correction_bias: torch.Tensor,
    renormalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights, topk_ids), each (num_tokens, top_k), float32 weights. router_logits:
    (num_tokens, E) in float32."""
    num_tokens, num_experts = router_logits.shape
    scores = router_logits.sigmoid()
    choice = scores + correction_bias  # (num_tokens, E)
    per_group = choice.view(num_tokens, num_groups, num_experts // num_groups)
    group_scores = per_group.topk(2, dim=-1).values.sum(dim=-1)  # (num_tokens, num_groups)
    best_groups = group_scores.topk(topk_groups, dim=-1).indices
    kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    kept = kept[:, :, None].expand_as(per_group).reshape(num_tokens, num_experts)
    topk_ids = choice.masked_fill(~kept, float("-inf")).topk(top_k, dim=-1).indices
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * scaling, topk_ids


class GroupedTopkRouter(nn.Module):
    """The router of a DeepSeek-V3 MoE layer: `weight` (E, hidden) and `e_score_correction_bias`
    (E,), the checkpoint's names. Scores in float32 whatever the model's dtype, as DeepSeek's."""

    def __init__(self, cfg):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.empty(cfg.n_routed_experts))
        self.top_k, self.num_groups, self.topk_groups = (
            cfg.num_experts_per_tok,
            cfg.n_group,
            cfg.topk_group,
        )
        self.renormalize, self.scaling = bool(cfg.norm_topk_prob), cfg.routed_scaling_factor

    def forward(self, x) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())  # (num_tokens, E)
        bias = self.e_score_correction_bias.float()
        args = (self.top_k, self.num_groups, self.topk_groups, bias, self.renormalize)
        return grouped_topk(logits, *args, self.scaling)

    def extra_repr(self):
        return (
            f"experts={self.weight.shape[0]}, top_k={self.top_k}, "
            f"groups={self.topk_groups} of {self.num_groups}, scaling={self.scaling}"
        )
