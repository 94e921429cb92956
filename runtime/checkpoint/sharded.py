"""Checkpoints of an N-rank trainer with torch.distributed.checkpoint (DCP), resharded on load.

Every rank writes its own shards of the model and AdamW state into RUN_DIR/checkpoints/step-N/
(DCP's files: tensors, loaded with torch's weights_only unpickler, and DCP's pickled `.metadata`,
read only through runtime/checkpoint/dcp_metadata.py); rank 0 then returns a small manifest
(format, step, world size, every file's sha256) that goes to the blob store, and its BlobRef into
the StepCommitted like a one-process checkpoint (runtime/checkpoint/single.py). Loading reads the manifest,
checks the files and lets DCP reshard onto whatever world loads it: 2 ranks -> 1 process, 1 -> 2.
Keys are parameter names (FQNs), the same sharded or not, so a plain module loads it too.
"""

from __future__ import annotations

import contextlib
import hashlib
import stat
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec

from reel.runtime.checkpoint.single import CheckpointError
from reel.runtime.train.distributed import World, barrier
from reel.runtime.train.step import TrainState

FORMAT = "reel-dcp-1"
METADATA = ".metadata"  # DCP's pickled index of the shards (runtime/checkpoint/dcp_metadata.py)


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
    import torch.distributed.checkpoint as dcp  # here, not above: DCP's import costs every trainer ~1.5 s of CPU
    from torch.distributed.checkpoint.state_dict import get_state_dict

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


def delete_files(run_dir: Path, step: int) -> int:
    """Delete the files of step `step`'s checkpoint (retention, bus/retention.py: its manifest blob goes
    after them); bytes freed. Only the directory `save` writes, never through a link."""
    directory = directory_of(run_dir, step)
    if directory.is_symlink() or not directory.is_dir():
        return 0
    freed = 0
    for path in directory.iterdir():
        if path.is_file() and not path.is_symlink():
            freed += path.stat().st_size
            path.unlink()
    with contextlib.suppress(OSError):  # something else in it: left for a person to look at
        directory.rmdir()
    return freed


def is_manifest(data: bytes) -> bool:
    return data[:1] == b"{" and FORMAT.encode() in data[:200]


def load(data: bytes, state: TrainState, world: World, run_dir: Path, *, source: str) -> TrainState:
    """Restore `state` (its model and optimizer, in place) from a manifest: any world size.

    The manifest is trusted only as far as its own hash (named by the commit): its directory must be
    the step's own under the run, every file in it one of the manifest's, each a regular file whose
    sha256 matches, `.metadata` among them; only then is `.metadata` read (runtime/checkpoint/dcp_metadata.py)."""
    import torch.distributed.checkpoint as dcp  # as in save: only N-rank checkpoints need DCP
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from reel.runtime.checkpoint.dcp_metadata import CheckedReader, read_metadata

    manifest, directory = verify_files(data, run_dir, source=source)
    metadata = read_metadata((directory / METADATA).read_bytes(), source, set(manifest.files))
    model_sd, optim_sd = get_state_dict(state.model, state.optimizer)
    with _single_process_is_meant(world):
        dcp.load({"model": model_sd, "optim": optim_sd}, storage_reader=CheckedReader(directory, metadata),
                 no_dist=not world.distributed)
    set_state_dict(state.model, state.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    return TrainState(state.model, state.optimizer, manifest.step)


def verify_files(data: bytes, run_dir: Path, *, source: str) -> tuple[Manifest, Path]:
    """(the manifest, its directory) once every file it lists is in place and matches its sha256."""
    try:
        manifest = msgspec.json.decode(data, type=Manifest)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise CheckpointError(f"{source} is not a Reel DCP checkpoint manifest: {exc}") from exc
    directory = _checked_directory(manifest, run_dir, source)
    for name, digest in manifest.files.items():
        _check_file(directory, name, digest, source)
    return manifest, directory


def _checked_directory(manifest: Manifest, run_dir: Path, source: str) -> Path:
    """The step's checkpoint directory, exactly where `save` puts it: no other path is read."""
    expected = directory_of(run_dir, manifest.step)
    if manifest.directory != str(expected.relative_to(run_dir)):
        raise CheckpointError(f"{source} names directory {manifest.directory!r}, not "
                              f"{str(expected.relative_to(run_dir))!r}; the run directory was tampered with")
    if METADATA not in manifest.files:
        raise CheckpointError(f"{source} lists no {METADATA} file; the run directory was tampered with")
    if expected.is_symlink() or not expected.resolve().is_relative_to(run_dir.resolve()):
        raise CheckpointError(f"{source}: {expected} is a link out of the run directory; replace it with the "
                              "checkpoint's own files")
    return expected


def _check_file(directory: Path, name: str, digest: str, source: str) -> None:
    path = directory / name
    if "/" in name or name in ("", ".", ".."):
        raise CheckpointError(f"{source} lists {name!r}, which is not a file name in {directory}")
    try:
        mode = path.lstat().st_mode
    except OSError:
        mode = 0
    if not stat.S_ISREG(mode) or _sha256(path) != digest:
        raise CheckpointError(f"{source}: {path} is missing, not a regular file, or damaged; restore it or delete "
                              f"the run's checkpoints after it")


@contextmanager
def _single_process_is_meant(world: World) -> Iterator[None]:
    """DCP warns on every single-process save or load; for a one-process trainer that is the plan."""
    with warnings.catch_warnings():
        if not world.distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()

