"""The weights of one policy version of a run, read from its log and blob store.

Every reader that needs a version's weights (export; later the rebuild of a version retention
deleted) goes through `version_weights`: the newest WeightsPublished of that version names them,
either one whole-model safetensors blob or a bus/weight_manifest.py manifest of full shards.
Version 0 is the run's init/ directory. A version whose blobs are gone from the store (retention
keeps checkpoints and recent versions only) is a `VersionMissing` naming the nearest checkpoint
at or before it, from which re-execution re-derives it.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import torch
from safetensors.torch import load as st_load

from reel.bus.blobs import BlobBackend, BlobError
from reel.bus.errors import ReelError
from reel.bus.events import StepCommitted, WeightsPublished
from reel.bus.log import LogError
from reel.bus.run_log import RunLog
from reel.bus.weight_manifest import decode_manifest
from reel.runtime.train.initial_policy import load_initial_model
from reel.runtime.model.model import MoEModel
from reel.runtime.model.weights import load_tensors
from reel.runtime.weights.load import version_tensors

__all__ = ["VersionError", "VersionMissing", "Version", "find_version", "version_weights", "load_version"]


class VersionError(ReelError):
    """A policy version that this run does not have, or cannot be read."""


class VersionMissing(VersionError):
    """The version was published, but its weights are no longer in the blob store."""

    def __init__(self, message: str, nearest_checkpoint: int | None):
        super().__init__(message)
        self.nearest_checkpoint = nearest_checkpoint  # step of the newest checkpoint at or before it (None: v0)


class Version(msgspec.Struct, frozen=True):
    version: int
    published: WeightsPublished | None  # None for version 0 (the run's init/ directory)
    commit: StepCommitted | None  # the commit that made it (None for version 0)


def find_version(run_dir: Path, version: int | None) -> tuple[Version, list[StepCommitted]]:
    """Version `version` of the run (None: the newest committed one) and every commit of the run."""
    try:
        with RunLog(run_dir, readonly=True) as log:
            names = log.names()
            commits = [e for _, e in log.events("steps") if isinstance(e, StepCommitted)] if "steps" in names else []
            published = [e for _, e in log.events("weights") if isinstance(e, WeightsPublished)] if "weights" in names \
                else []
    except LogError as exc:
        raise VersionError(f"cannot read the log of {run_dir}: {exc}") from exc
    newest = max((c.version for c in commits), default=0)
    wanted = newest if version is None else version
    if wanted == 0:
        return Version(0, None, None), commits
    commit = next((c for c in commits if c.version == wanted), None)
    if commit is None:
        raise VersionError(f"step {wanted} is not committed in {run_dir} (its steps are 1..{newest}); "
                           f"pass --step between 0 and {newest}")
    event = next((e for e in reversed(published) if e.version == wanted), None)
    if event is None:
        raise VersionError(f"the log of {run_dir} has no WeightsPublished for version {wanted}")
    return Version(wanted, event, commit), commits


def version_weights(blobs: BlobBackend, found: Version, commits: list[StepCommitted]) -> dict[str, torch.Tensor]:
    """Hub-named tensors of a published version (each blob's hash checked on read)."""
    assert found.published is not None
    event = found.published
    try:
        if event.format == "safetensors":
            return st_load(blobs.get(event.weights))
        if event.format == "manifest":
            manifest = decode_manifest(blobs.get(event.weights))
            if manifest.base_version >= 0:
                raise VersionError(f"version {found.version} is stored as a delta against version "
                                   f"{manifest.base_version}; export a checkpoint step instead")
            return version_tensors(blobs, manifest)  # pieces written by N trainer ranks put together
    except BlobError as exc:
        nearest = max((c.step for c in commits if c.checkpoint is not None and c.step <= found.version), default=None)
        where = f"the checkpoint of step {nearest}" if nearest is not None else "the initial policy (version 0)"
        raise VersionMissing(f"the weights of version {found.version} are not in the blob store ({exc}); "
                             f"the nearest checkpoint is {where}, from which re-execution re-derives them",
                             nearest) from exc
    raise VersionError(f"version {found.version} has weights in an unknown format {event.format!r}")


def load_version(run_dir: Path, blobs: BlobBackend, found: Version, commits: list[StepCommitted]) -> MoEModel:
    """The run's model (fp32) with the weights of `found`."""
    model = load_initial_model(run_dir)
    if found.published is not None:
        load_tensors(model, version_weights(blobs, found, commits), f"policy version {found.version}")
    return model
