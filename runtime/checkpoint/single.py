"""Trainer checkpoints as one safetensors file: model, AdamW state and RNG, no pickle.

Keys: `model.<name>` (the module's own state dict), `optim.<param name>.<exp_avg|exp_avg_sq|step>`
and `rng.torch`; the metadata holds the step and the format version. Restoring gives bit-identical
continuation: the same tensors, the same optimizer hyperparameters (from the config).
"""

from __future__ import annotations

import json
import struct

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from reel.bus.errors import ReelError
from reel.runtime.config.sections import TrainerSection
from reel.runtime.model.model import MoEModel
from reel.runtime.train.step import TrainState, make_optimizer

FORMAT = "reel-checkpoint-1"


class CheckpointError(ReelError):
    """A checkpoint that does not fit the run's model."""


def checkpoint_bytes(state: TrainState) -> bytes:
    tensors: dict[str, torch.Tensor] = {
        f"model.{k}": v.detach().contiguous().cpu() for k, v in state.model.state_dict().items()
    }
    names = {id(p): n for n, p in state.model.named_parameters()}
    for group in state.optimizer.param_groups:
        for param in group["params"]:
            for key, value in state.optimizer.state.get(param, {}).items():
                tensors[f"optim.{names[id(param)]}.{key}"] = value.detach().contiguous().cpu()
    tensors["rng.torch"] = torch.get_rng_state()
    return st_save(tensors, metadata={"format": FORMAT, "step": str(state.step)})


def restore(data: bytes, model: MoEModel, cfg: TrainerSection, *, source: str) -> TrainState:
    """Load a checkpoint into `model` (in place) and a fresh optimizer; `source` names it in errors."""
    tensors = st_load(data)
    step = _metadata_step(data, source)
    model_sd = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    missing = set(model.state_dict()) - set(model_sd)
    if missing:
        raise CheckpointError(f"checkpoint {source} lacks {sorted(missing)[:3]}...; it belongs to another model")
    with torch.no_grad():
        model.load_state_dict(model_sd, strict=True)
    optimizer = make_optimizer(model, cfg)
    for name, param in model.named_parameters():
        state = {key: tensors[f"optim.{name}.{key}"] for key in ("step", "exp_avg", "exp_avg_sq")
                 if f"optim.{name}.{key}" in tensors}
        if state:
            optimizer.state[param] = {k: v.clone() for k, v in state.items()}
    torch.set_rng_state(tensors["rng.torch"])
    return TrainState(model, optimizer, step)


def _metadata_step(data: bytes, source: str) -> int:
    # safetensors: u64 little-endian header length, then a JSON header holding __metadata__.
    (header_len,) = struct.unpack("<Q", data[:8])
    meta = json.loads(data[8:8 + header_len]).get("__metadata__", {})
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{source} is not a Reel checkpoint (format {meta.get('format')!r})")
    return int(meta["step"])
