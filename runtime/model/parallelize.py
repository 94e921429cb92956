"""How the MoE model is split across the trainer's ranks (the model itself stays free of it).

Expert parallelism first (expert_parallel.py), when trainer.expert_parallel = R > 1: the ranks form
a mesh ("efsdp", "ep") of shape (ranks / R, R); each EP group of R ranks spreads the experts over
itself and sends tokens to them. Then FSDP2 (`fully_shard`) per decoder layer and at the root
(embeddings, final norm, lm_head) over all ranks: a layer's parameters are gathered for its forward
and backward only. Experts have their own FSDP over "efsdp" (the ranks holding the same experts);
with one such rank (ranks = R) there is nothing to shard and FSDP leaves them out. Without EP,
expert weights [E, I, H] shard on dim 0, the expert dim, so a rank holds whole experts' slices.
Gradients are summed across ranks, never averaged: train_step already weights each micro-batch by
its share of the whole batch's tokens, and gloo has no PREMUL_SUM, so the sum is forced.
"""

from __future__ import annotations

import warnings

from reel.runtime.train.distributed import World
from reel.runtime.model.config import ModelError
from reel.runtime.model.context_parallel import context_degree
from reel.runtime.model.model import MoEModel
from reel.runtime.model.moe import MoE


def expert_degree(world: World, expert_parallel: int) -> int:
    """EP ranks on this world: trainer.expert_parallel where it divides the world size (a replay or
    retrain on another world size may not), else 1 (plain FSDP: a layout change, not a new config)."""
    return expert_parallel if world.distributed and world.size % expert_parallel == 0 else 1


def parallelize(model: MoEModel, world: World, expert_parallel: int = 1, context_parallel: int = 1) -> MoEModel:
    """EP (when `expert_parallel` > 1 applies to this world) then FSDP2; nothing on one process.
    Context parallelism changes no parameter (FSDP's mesh, every rank, is already DP x CP): it is
    checked here, where the trainer starts and the ranks' device is known, and runs in train_step."""
    context_degree(world, context_parallel)
    degree = expert_degree(world, expert_parallel)
    if degree > 1:
        apply_ep(model, world, degree)
    return apply_fsdp(model, world)


def apply_ep(model: MoEModel, world: World, degree: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from reel.runtime.model.expert_parallel import ExpertParallelExperts

    if model.config.num_experts % degree:
        raise ModelError(f"trainer.expert_parallel = {degree} does not divide model.num_experts = "
                         f"{model.config.num_experts}; pick a divisor of both it and trainer.ranks")
    mesh = init_device_mesh(world.device.type, (world.size // degree, degree), mesh_dim_names=("efsdp", "ep"))
    for layer in model.model.layers:
        if isinstance(layer.mlp, MoE):
            layer.mlp.experts = ExpertParallelExperts(layer.mlp.experts, mesh["ep"], mesh["efsdp"])


def apply_fsdp(model: MoEModel, world: World) -> MoEModel:
    if not world.distributed:
        return model
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from reel.runtime.model.expert_parallel import ExpertParallelExperts

    # The model returns logits as a view; nothing downstream modifies them in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    unsharded = set()  # EP experts with no other rank holding them: FSDP leaves them alone
    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if isinstance(experts, ExpertParallelExperts):
            if experts.efsdp_mesh.size() > 1:
                fully_shard(experts, mesh=experts.efsdp_mesh)
            else:
                unsharded |= set(experts.parameters())
        # Resharded after its forward: a rank holds one gathered layer at a time beyond its shards
        # (FSDP2 prefetches at most the next layer in backward), whatever the depth.
        fully_shard(layer, ignored_params=unsharded or None, reshard_after_forward=True)
    fully_shard(model, ignored_params=unsharded or None)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model
