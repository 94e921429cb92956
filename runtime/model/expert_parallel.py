"""Expert parallelism: each rank of an EP group holds whole experts, and tokens travel to them.

Built on torch's own pieces (DeviceMesh, DTensor `distribute_tensor`, the functional
`all_to_all_single_autograd`), not TorchTitan's `ExpertParallel`: torchtitan 0.3.0 does not import
without Triton (absent on CPU machines), is config-driven around its own module classes, and its
EP dispatch assumes its GroupedExperts signature. gloo runs the uneven `all_to_all_single` with
autograd on CPU (checked with 2 ranks), so this same code is what the CPU tests run; NCCL on GPU.

Weights: the experts' [E, ...] parameters become DTensors sharded Shard(0) on the EP mesh dim,
so EP rank r holds experts [r * El, (r + 1) * El) whole; FSDP shards them further over the other
mesh dim (parallelize.py). The state dict keeps its names and full shapes (DCP, full export).

One MoE layer on each rank of an EP group of R ranks, for that rank's own tokens:
  1. its N*K assignments sorted by expert, hence by the rank that holds the expert
  2. the counts per expert exchanged (all-to-all), then the rows (all-to-all, with autograd)
  3. rows received as [source rank, local expert] regrouped as [local expert, source rank]; one
     grouped GEMM over the local experts (moe.swiglu_grouped, the single-process math)
  4. the inverse regrouping and the reverse all-to-all bring every row home; moe.combine
Expert ids are whatever the router gave, replayed (R3) or its own, so router replay is unchanged.

Shape legend: N tokens, K top-k, E experts, El experts per EP rank, R EP ranks, H hidden,
A assignments sent (N * K), B assignments received.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from reel.runtime.model.moe import Experts, combine, sort_by_expert, swiglu_grouped


def received_order(recv_counts_RE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows received grouped [source rank, local expert] (counts [R, El]): -> (the stable
    order that groups them by local expert [B], rows per local expert [El])."""
    R, El = recv_counts_RE.shape
    local_ids_B = torch.arange(El, device=recv_counts_RE.device).repeat(R).repeat_interleave(recv_counts_RE.flatten())
    return torch.argsort(local_ids_B, stable=True), recv_counts_RE.sum(0)


class ExpertParallelExperts(nn.Module):
    """`mlp.experts` with its experts spread over an EP mesh dim (same parameter names as Experts)."""

    gate_proj: nn.Parameter  # DTensor [E, I, H], Shard(0) on the EP mesh
    up_proj: nn.Parameter
    down_proj: nn.Parameter  # DTensor [E, H, I]
    mesh: DeviceMesh  # the EP group: ranks holding different experts
    efsdp_mesh: DeviceMesh  # ranks holding the same experts (FSDP shards the experts over them)

    def __init__(self, experts: Experts, mesh: DeviceMesh, efsdp_mesh: DeviceMesh):
        super().__init__()
        self.mesh, self.efsdp_mesh = mesh, efsdp_mesh
        for name, param in experts.named_parameters():
            sharded = distribute_tensor(param.detach(), mesh, [Shard(0)])
            self.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))

    def forward(self, x_NH: torch.Tensor, ids_NK: torch.Tensor, weights_NK: torch.Tensor, precision: str):
        gate_EIH, up_EIH, down_EHI = (_local(p) for p in (self.gate_proj, self.up_proj, self.down_proj))
        R, El = self.mesh.size(), gate_EIH.shape[0]
        group = self.mesh.get_group()
        order_A, counts_E = sort_by_expert(ids_NK, R * El)
        x_AH = x_NH[order_A // ids_NK.shape[1]]
        recv_counts_RE = funcol.wait_tensor(funcol.all_to_all_single(counts_E, None, None, group)).view(R, El)
        send_R, recv_R = counts_E.view(R, El).sum(1).tolist(), recv_counts_RE.sum(1).tolist()
        x_BH = funcol.wait_tensor(funcol.all_to_all_single_autograd(x_AH, recv_R, send_R, group))
        order_B, counts_El = received_order(recv_counts_RE)
        y_sorted_BH = swiglu_grouped(x_BH[order_B], gate_EIH, up_EIH, down_EHI, counts_El, precision)
        y_BH = y_sorted_BH[torch.argsort(order_B)]
        y_AH = funcol.wait_tensor(funcol.all_to_all_single_autograd(y_BH, send_R, recv_R, group))
        return combine(y_AH, order_A, weights_NK)


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's experts (FSDP has gathered its own dim by forward time; what is left is EP's)."""
    return param.to_local() if isinstance(param, DTensor) else param
