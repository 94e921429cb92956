"""Checkpoints of an N-rank trainer with torch.distributed.checkpoint (DCP), resharded on load.

Every rank writes its own shards of the model and AdamW state into RUN_DIR/checkpoints/step-N/
(DCP's files, no pickle: tensors plus DCP's metadata); rank 0 then returns a small manifest
(format, step, world size, every file's sha256) that goes to the blob store, and its BlobRef into
the StepCommitted like a one-process checkpoint (runtime/checkpoint.py). Loading reads the manifest,
checks the files and lets DCP reshard onto whatever world loads it: 2 ranks -> 1 process, 1 -> 2.
Keys are parameter names (FQNs), the same sharded or not, so a plain module loads it too.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from reel.runtime.checkpoint import CheckpointError
from reel.runtime.distributed import World, barrier
from reel.runtime.train_step import TrainState

FORMAT = "reel-dcp-1"


class Manifest(msgspec.Struct, frozen=True):
    format: str
    step: int
    world_size: int
    directory: str  # relative to the run directory
    files: dict[str, str]  # file name -> sha256


def directory_of(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step:06d}"


def save(state: TrainState, world: World, run_dir: Path) -> bytes:
    """A collective: every rank writes its shards; returns the manifest on rank 0, b"" elsewhere."""
    directory = directory_of(run_dir, state.step)
    model_sd, optim_sd = get_state_dict(state.model, state.optimizer)
    with _single_process_is_meant(world):
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(directory), no_dist=not world.distributed)
    barrier(world)
    if world.rank != 0:
        return b""
    files = {p.name: _sha256(p) for p in sorted(directory.iterdir()) if p.is_file()}
    manifest = Manifest(FORMAT, state.step, world.size, str(directory.relative_to(run_dir)), files)
    return msgspec.json.encode(manifest)


def is_manifest(data: bytes) -> bool:
    return data[:1] == b"{" and FORMAT.encode() in data[:200]


def load(data: bytes, state: TrainState, world: World, run_dir: Path, *, source: str) -> TrainState:
    """Restore `state` (its model and optimizer, in place) from a manifest: any world size."""
    try:
        manifest = msgspec.json.decode(data, type=Manifest)
    except msgspec.ValidationError as exc:
        raise CheckpointError(f"{source} is not a Reel DCP checkpoint manifest: {exc}") from exc
    directory = run_dir / manifest.directory
    for name, digest in manifest.files.items():
        path = directory / name
        if not path.is_file() or _sha256(path) != digest:
            raise CheckpointError(f"{source}: {path} is missing or damaged; restore it or delete the run's "
                                  f"checkpoints after it")
    model_sd, optim_sd = get_state_dict(state.model, state.optimizer)
    with _single_process_is_meant(world):
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(directory), no_dist=not world.distributed)
    set_state_dict(state.model, state.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    return TrainState(state.model, state.optimizer, manifest.step)


@contextmanager
def _single_process_is_meant(world: World) -> Iterator[None]:
    """DCP warns on every single-process save or load; for a one-process trainer that is the plan."""
    with warnings.catch_warnings():
        if not world.distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()

