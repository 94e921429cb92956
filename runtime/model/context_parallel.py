"""Context parallelism: the C ranks of a CP group split each micro-batch's positions and attend over
the whole rows by ring attention, torch's own `torch.distributed.tensor.experimental.context_parallel`
(TorchTitan 0.3.0 does not import without Triton; its CP is this same torch API underneath).

What the ranks of one CP group do with the micro-batch [B, T] they all got (distributed.plan deals
rows to data-parallel groups, not ranks):
  1. positions from the whole rows' mask (model.positions_from_mask), before any split: a slice's
     own mask cannot tell where it starts
  2. every per-position field right-padded to a multiple of 2C, then sharded by torch with its
     head-tail load balancing (rank r holds chunks r and 2C-1-r of 2C), so the causal work is even.
     Padding to 2C keeps the balancer on for every length (torch silently skips it otherwise); every
     field goes through the same reorder, so each token keeps its target, masks, advantage and
     routing, and the loss, a sum over tokens, does not depend on their order
  3. the model runs on the slice with those positions and `is_causal` attention (ring attention
     takes no mask; rows are right-padded, so real tokens get the same logits); torch's patched SDPA
     passes k/v around the ring in the forward and the backward, so the backward runs in the context
  4. per-token sums are sums over the group: a rank's loss is its slice's token sum over the
     batch's tokens, FSDP sums gradients over every rank (its mesh is DP x CP flattened), and token
     lists are gathered from every rank's slice (distributed.gather_tokens)

Ring attention dispatches only to the CUDA SDPA kernels (flash, efficient, cuDNN). On CPU, torch
2.13 has no CP rule for `_scaled_dot_product_flash_attention_for_cpu` and its math kernel mixes
DTensors with tensors (probed on 2 gloo ranks), so C > 1 needs CUDA ranks (NCCL).

Shape legend: B rows, T positions, C CP ranks, L MoE layers, K top-k.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Iterator

import torch

from reel.runtime.train.batch import Batch
from reel.runtime.train.distributed import World
from reel.runtime.model.config import ModelError
from reel.runtime.model.model import positions_from_mask

# Batch fields indexed [B, T, ...]: the ones a CP rank holds a slice of, and what their padding holds.
PER_POSITION = {"input_ids_BT": 0, "attention_mask_BT": 0, "targets_BT": 0, "loss_mask_BT": False,
                "logp_mu_BT": 0.0, "advantages_BT": 0.0, "versions_BT": -1, "routing_BTLK": 0}


def context_degree(world: World, context_parallel: int) -> int:
    """CP ranks on this world: trainer.context_parallel where it divides the world size (a replay on
    another world size may not: then 1, a layout change); refused where the ranks are not on CUDA."""
    if not (world.distributed and context_parallel > 1 and world.size % context_parallel == 0):
        return 1
    if world.device.type != "cuda":
        raise ModelError(f"trainer.context_parallel = {context_parallel} needs CUDA ranks: torch's ring attention "
                         "has no CPU kernel; set trainer.context_parallel = 1 on this machine")
    return context_parallel


def with_context_parallel(world: World, context_parallel: int) -> World:
    return world._replace(cp=context_degree(world, context_parallel))


def mesh_shape(world: World) -> tuple[int, int]:
    """("dp", "cp") sizes; row-major, so a CP group is C consecutive ranks (World.dp_rank = rank // C)."""
    return world.dp_size, world.cp


@functools.cache
def cp_mesh(world: World):  # -> DeviceMesh; made once per world (a collective: every rank asks at once)
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(world.device.type, mesh_shape(world), mesh_dim_names=("dp", "cp"))["cp"]


def pad_positions(sub: Batch, multiple: int) -> tuple[Batch, torch.Tensor]:
    """`sub` right-padded to a multiple of `multiple` positions (padding: mask 0, no loss), with the
    position ids of its whole rows."""
    extra = -int(sub.input_ids_BT.shape[1]) % multiple

    def pad(t_BT: torch.Tensor, fill: float | int | bool) -> torch.Tensor:
        return torch.cat([t_BT, t_BT.new_full((t_BT.shape[0], extra, *t_BT.shape[2:]), fill)], dim=1)

    padded = sub._replace(**{name: pad(getattr(sub, name), fill) for name, fill in PER_POSITION.items()
                             if getattr(sub, name) is not None})
    return padded, positions_from_mask(padded.attention_mask_BT)


@contextmanager
def sequence_shard(world: World, sub: Batch) -> Iterator[tuple[Batch, torch.Tensor | None]]:
    """(this rank's slice of the micro-batch `sub`, its position ids) inside torch's CP context, where
    SDPA is ring attention; (sub, None) with no CP. Run the forward and the backward inside."""
    if world.cp == 1:
        yield sub, None
        return
    from torch.distributed.tensor.experimental import context_parallel

    padded, positions_BT = pad_positions(sub, 2 * world.cp)
    buffers = [getattr(padded, name) for name in PER_POSITION if getattr(padded, name) is not None]
    buffers.append(positions_BT)
    # torch shards the buffers in place, so `padded` holds the slices inside; they are fresh copies
    # of the micro-batch, so nothing needs restoring afterwards.
    with context_parallel(cp_mesh(world), buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                          no_restore_buffers=set(buffers)):
        yield padded, positions_BT
