"""Checkpoints in Hugging Face layout: `config.json` + safetensors with Hub tensor names.

A directory written by `save` loads unchanged in transformers' Qwen3MoeForCausalLM and vLLM;
`load` reads those (and transformers' own save_pretrained output, sharded or not). Loading
streams: the model is built without memory for its weights (meta device), then each shard's
tensors are copied into place one at a time, so a process holds one copy of the weights.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save_file
from safetensors.torch import save as st_save

from reel.runtime.model import state_dict_adapter
from reel.runtime.model.config import ModelError, MoEConfig
from reel.runtime.model.model import MoEModel


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
    with torch.device("meta"):
        model = MoEModel(config, precision)
    model.to_empty(device="cpu")
    if config.tie_word_embeddings:  # to_empty gives each module its own tensor
        model.lm_head.weight = model.model.embed_tokens.weight
    _copy_in(model, _stream(shard_files(directory)), str(directory))
    return model


def shard_files(directory: Path) -> list[Path]:
    """The checkpoint's safetensors files: those its index names, else every *.safetensors; each one
    checked by `contained` (an index is untrusted input: its names must not reach outside)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, json.JSONDecodeError, KeyError, AttributeError, TypeError) as exc:
            raise ModelError(f"cannot read the shard index {index}: {exc}") from exc
        for name in names:
            if not isinstance(name, str) or Path(name).name != name or not name.endswith(".safetensors"):
                raise ModelError(f"the shard index {index} names {name!r}, which is not a *.safetensors file name "
                                 "in its directory; fix the index")
        return [contained(directory, directory / n) for n in names]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelError(f"no *.safetensors file in {directory}")
    return [contained(directory, f) for f in files]


def contained(directory: Path, path: Path) -> Path:
    """`path` if it is a regular file that resolves inside `directory`, else ModelError. A Hugging Face
    cache snapshot (…/snapshots/REV/) links its files to the repo's blobs/, so there the repo's folder
    is the bound."""
    bound = directory.resolve()
    if bound.parent.name == "snapshots":
        bound = bound.parent.parent
    real = path.resolve()
    if not real.is_relative_to(bound) or not real.is_file():
        raise ModelError(f"{path} is not a regular file inside {bound}; a checkpoint directory may only name "
                         "its own files")
    return path


def _stream(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        try:
            with safe_open(f, framework="pt") as shard:
                for name in shard.keys():
                    yield name, shard.get_tensor(name)
        except (OSError, SafetensorError) as exc:
            raise ModelError(f"cannot read {f}: {exc}") from exc


def hub_tensors(state_dict: dict[str, torch.Tensor], config: MoEConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """`_as_hf`, one tensor at a time (a CPU fp32 model's tensors are its own memory: nothing is copied)."""
    for name, t in state_dict_adapter.to_hf(state_dict, config).items():
        yield name, t.detach().to("cpu", torch.float32).contiguous()


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
    _copy_in(model, tensors.items(), "weights blob")


def load_tensors(model: MoEModel, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Copies Hub-named tensors (every parameter's) into `model` in place; `source` names them in errors."""
    _copy_in(model, tensors.items(), source)


@torch.no_grad()
def _copy_in(model: MoEModel, hf: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
    """Copy Hub-named tensors into `model`; every parameter (every expert) must be written exactly once."""
    params = dict(model.named_parameters())
    experts = model.config.num_experts
    written: set[tuple[str, int | None]] = set()
    for hub_name, tensor in hf:
        for name, expert, t in state_dict_adapter.param_slices(hub_name, tensor, model.config):
            if name not in params:
                raise ModelError(f"{source} has unexpected tensor {hub_name} (does config.json match the weights?)")
            p = params[name]
            if expert is not None and not 0 <= expert < experts:
                raise ModelError(f"{source} has tensor {hub_name} but config.json says num_experts = {experts}")
            target = p if expert is None else p[expert]
            if t.shape != target.shape:
                raise ModelError(f"{source}: {hub_name} has shape {tuple(t.shape)}, the config needs "
                                 f"{tuple(target.shape)}")
            target.copy_(t)
            written.add((name, expert))
    for name, p in params.items():
        stacked = p.dim() == 3 and ".mlp.experts." in name
        if (name, None) in written:
            continue
        missing = [e for e in range(experts) if (name, e) not in written] if stacked else [None]
        if missing:
            what = name if missing[0] is None else f"{name} expert {missing[0]}"
            raise ModelError(f"{source} lacks tensor {what}")
