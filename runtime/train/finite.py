"""A training step that produced NaN or inf must not become a policy version.

One non-finite value anywhere in an update spreads to every weight it touches, and every later
version trains from those weights: the run keeps going with a dead model. So train_step checks
the loss and gradient before the optimizer applies them, and the weights after, and raises
NonFiniteStep naming the step and the first offending tensor; the trainer then publishes nothing
for that step. The loss and grad norm are global figures (summed over ranks), so every rank
decides alike; the weight check is agreed with one all-reduce.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from reel.bus.errors import ReelError
from reel.runtime.train.distributed import World, all_sum


class NonFiniteStep(ReelError):
    """A step's loss, gradient or new weights hold NaN or inf; nothing of it was committed."""


def check_update(step: int, loss: float, grad_norm: float, model: nn.Module) -> None:
    """Before optimizer.step(): the loss and every gradient are finite."""
    if not math.isfinite(loss):
        raise NonFiniteStep(f"step {step}: the loss is {loss}; nothing was committed for this step "
                            "(look for non-finite advantages or logprobs in its groups)")
    if not math.isfinite(grad_norm):
        name = first_non_finite((n, p.grad) for n, p in model.named_parameters() if p.grad is not None)
        raise NonFiniteStep(f"step {step}: the gradient norm is {grad_norm}, first non-finite gradient: "
                            f"{name or 'on another rank'}; nothing was committed for this step")


def check_weights(step: int, model: nn.Module, world: World) -> None:
    """After optimizer.step(): every weight is finite, on every rank."""
    name = first_non_finite(model.named_parameters())
    if all_sum(world, float(name is not None)) > 0:
        raise NonFiniteStep(f"step {step}: the updated weights are not finite, first: {name or 'on another rank'}; "
                            "nothing was committed for this step")


def first_non_finite(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first tensor holding NaN or inf (its local shard under FSDP), else None."""
    names, flags = [], []
    for name, tensor in named:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        names.append(name)
        flags.append(torch.isfinite(local.detach()).all())
    if not flags:
        return None
    finite = torch.stack(flags).tolist()  # one device sync for the whole model
    return next((name for name, ok in zip(names, finite) if not ok), None)
