"""Checkpoints in Hugging Face layout: `config.json` + safetensors with Hub tensor names.

A directory written by `save` loads unchanged in transformers' Qwen3MoeForCausalLM and vLLM;
`load` reads those (and transformers' own save_pretrained output, sharded or not).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import load_file, save_file
from safetensors.torch import save as st_save

from runtime.model import state_dict_adapter
from runtime.model.config import ModelError, MoEConfig
from runtime.model.model import MoEModel


def _as_hf(state_dict: dict[str, torch.Tensor], config: MoEConfig) -> dict[str, torch.Tensor]:
    sd = state_dict_adapter.to_hf(state_dict, config)
    return {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in sd.items()}


def save(model: MoEModel, directory: str | Path) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2) + "\n")
    save_file(_as_hf(model.state_dict(), model.config), directory / "model.safetensors", metadata={"format": "pt"})


def load(directory: str | Path, precision: str = "fp32") -> MoEModel:
    directory = Path(directory)
    config_path = directory / "config.json"
    try:
        config = MoEConfig.from_hf_dict(json.loads(config_path.read_text()))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(f"cannot read {config_path}: {exc}") from exc
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelError(f"no *.safetensors file in {directory}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(f))
        except (OSError, SafetensorError) as exc:
            raise ModelError(f"cannot read {f}: {exc}") from exc
    model = MoEModel(config, precision)
    _copy_in(model, tensors, str(directory))
    return model


def state_dict_bytes(model: MoEModel) -> bytes:
    """Weights as one safetensors blob with Hub names (what WeightsPublished points to)."""
    return state_dict_to_bytes(model.state_dict(), model.config)


def state_dict_to_bytes(state_dict: dict[str, torch.Tensor], config: MoEConfig) -> bytes:
    """`state_dict_bytes` of a model whose (full, unsharded) state dict is given."""
    return st_save(_as_hf(state_dict, config), metadata={"format": "pt"})


def load_state_dict_bytes(model: MoEModel, data: bytes) -> None:
    """Copies a `state_dict_bytes` blob into `model` in place (keeps its device and any KV caches)."""
    try:
        tensors = st_load(data)
    except SafetensorError as exc:
        raise ModelError(f"weights blob is not valid safetensors: {exc}") from exc
    _copy_in(model, tensors, "weights blob")


@torch.no_grad()
def _copy_in(model: MoEModel, hf: dict[str, torch.Tensor], source: str) -> None:
    tensors = state_dict_adapter.from_hf(hf, model.config)
    params = dict(model.named_parameters())
    for name in params.keys() - tensors.keys():
        raise ModelError(f"{source} lacks tensor {name}")
    for name in tensors.keys() - params.keys():
        raise ModelError(f"{source} has unexpected tensor {name} (does config.json match the weights?)")
    for name, p in params.items():
        t = tensors[name]
        if t.shape != p.shape:
            raise ModelError(f"{source}: {name} has shape {tuple(t.shape)}, the config needs {tuple(p.shape)}")
        p.copy_(t)
