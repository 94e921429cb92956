"""How the MoE model is split across the trainer's ranks (the model itself stays free of it).

FSDP2 (`fully_shard`) per decoder layer, then the root (embeddings, final norm, lm_head): a layer's
parameters are gathered for its forward and backward only. Expert weights [E, I, H] shard on dim 0,
the expert dim, so a rank holds whole experts' slices. Gradients are summed across ranks, never
averaged: train_step already weights each micro-batch by its share of the whole batch's tokens,
and gloo has no PREMUL_SUM, so the sum is forced.
"""

from __future__ import annotations

import warnings

from runtime.distributed import World
from runtime.model.model import MoEModel


def apply_fsdp(model: MoEModel, world: World) -> MoEModel:
    if not world.distributed:
        return model
    from torch.distributed.fsdp import FSDPModule, fully_shard

    # The model returns logits as a view; nothing downstream modifies them in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model
