"""Mixture of experts: softmax top-k router with router replay (R3), stacked SwiGLU experts.

Router replay: given expert ids recorded at inference, the router uses those ids but takes their
gate weights from its own live softmax scores (then the usual renormalisation), so the router
still receives gradients. Replaying the router's own choice is bitwise a no-op because both paths
gather the same scores.

Shape legend: N tokens, K top-k, E experts, H hidden, I expert width, A = N * K assignments.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from reel.runtime.model.layers import Linear, grouped_linear, linear, unquantised


class Router(nn.Module):
    """`mlp.gate`: one logit per expert; never quantised to fp8."""

    def __init__(self, hidden: int, experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    def forward(self, x_NH: torch.Tensor, precision: str, replay_ids_NK: torch.Tensor | None = None):
        """-> (gate weights [N, K] fp32, expert ids [N, K] int64, softmax scores [N, E] fp32)."""
        scores_NE = torch.softmax(linear(x_NH, self.weight, unquantised(precision)).float(), dim=-1)
        if replay_ids_NK is None:
            ids_NK = torch.topk(scores_NE, self.top_k, dim=-1).indices
        else:
            ids_NK = replay_ids_NK.long()
        weights_NK = scores_NE.gather(-1, ids_NK)
        if self.norm_topk_prob:
            weights_NK = weights_NK / weights_NK.sum(-1, keepdim=True)
        return weights_NK, ids_NK, scores_NE


class Experts(nn.Module):
    """`mlp.experts`: weights stacked over experts; state_dict_adapter.py maps to per-expert HF keys."""

    def __init__(self, experts: int, hidden: int, width: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(experts, width, hidden))
        self.up_proj = nn.Parameter(torch.empty(experts, width, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, width))

    def forward(self, x_NH: torch.Tensor, ids_NK: torch.Tensor, weights_NK: torch.Tensor, precision: str):
        order_A, counts_E = sort_by_expert(ids_NK, self.gate_proj.shape[0])
        x_AH = x_NH[order_A // ids_NK.shape[1]]
        y_AH = swiglu_grouped(x_AH, self.gate_proj, self.up_proj, self.down_proj, counts_E, precision)
        return combine(y_AH, order_A, weights_NK)


def sort_by_expert(ids_NK: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (order [A]: the N*K assignments sorted by expert, stable; assignments per expert [E]).

    Sorted, each expert's rows are contiguous for a grouped GEMM."""
    order_A = torch.argsort(ids_NK.flatten(), stable=True)
    return order_A, torch.bincount(ids_NK.flatten(), minlength=experts)


def swiglu_grouped(x_AH: torch.Tensor, gate_EIH: torch.Tensor, up_EIH: torch.Tensor, down_EHI: torch.Tensor,
                   counts_E: torch.Tensor, precision: str) -> torch.Tensor:
    """SwiGLU of rows sorted by expert, counts_E[e] rows through expert e."""
    offs_E = counts_E.cumsum(0).to(torch.int32)
    gate_AI = grouped_linear(x_AH, gate_EIH, offs_E, precision)
    up_AI = grouped_linear(x_AH, up_EIH, offs_E, precision)
    return grouped_linear(F.silu(gate_AI) * up_AI, down_EHI, offs_E, precision)


def combine(y_AH: torch.Tensor, order_A: torch.Tensor, weights_NK: torch.Tensor) -> torch.Tensor:
    """Expert outputs back in assignment order, summed per token with the gate weights -> [N, H]."""
    N, K = weights_NK.shape
    y_NKH = y_AH[torch.argsort(order_A)].view(N, K, -1)
    return (y_NKH * weights_NK.unsqueeze(-1)).sum(1)


class MoE(nn.Module):
    def __init__(self, hidden: int, width: int, experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.gate = Router(hidden, experts, top_k, norm_topk_prob)
        self.experts = Experts(experts, hidden, width)

    def forward(self, x_NH: torch.Tensor, precision: str, replay_ids_NK: torch.Tensor | None = None):
        """-> (output [N, H], expert ids [N, K], router scores [N, E])."""
        weights_NK, ids_NK, scores_NE = self.gate(x_NH, precision, replay_ids_NK)
        return self.experts(x_NH, ids_NK, weights_NK, precision), ids_NK, scores_NE


class DenseMLP(nn.Module):
    """SwiGLU MLP for layers without experts (`mlp_only_layers`, off the sparse step)."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_proj = Linear(hidden, width)
        self.up_proj = Linear(hidden, width)
        self.down_proj = Linear(width, hidden)

    def forward(self, x_NH: torch.Tensor, precision: str) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x_NH, precision)) * self.up_proj(x_NH, precision), precision)


def load_balancing_loss(scores_NE: torch.Tensor, ids_NK: torch.Tensor, mask_N: torch.Tensor | None) -> torch.Tensor:
    """Switch-style aux loss E * sum_e f_e * P_e over real tokens; 1.0 at perfect balance.

    f_e (share of assignments, from the ids actually used) carries no gradient; P_e (mean router
    score) does, so minimising it flattens the router.
    """
    E = scores_NE.shape[-1]
    m_N = torch.ones(scores_NE.shape[0], device=scores_NE.device) if mask_N is None else mask_N.float()
    counts_E = (F.one_hot(ids_NK, E).float() * m_N[:, None, None]).sum((0, 1))
    f_E = counts_E / counts_E.sum().clamp(min=1)
    P_E = (scores_NE * m_N[:, None]).sum(0) / m_N.sum().clamp(min=1)
    return E * (f_E * P_E).sum()
