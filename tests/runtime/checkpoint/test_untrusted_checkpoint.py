"""A run directory is untrusted input: DCP checkpoints (runtime/checkpoint/sharded.py, dcp_metadata.py).

The attacker of these tests controls every byte of a copied run, the log included, so every hash
the manifest and the commit name agree with the crafted files: only the checks themselves refuse."""

from __future__ import annotations

import hashlib
import os
import pickle
from pathlib import Path

import msgspec
import pytest

import fsdp_peer
from reel.bus.blob_backends.file import BlobStore
from reel.bus.events import StepCommitted, StepTiming
from reel.runtime.checkpoint import sharded as sharded_checkpoint
from reel.runtime.checkpoint.single import CheckpointError, checkpoint_bytes
from reel.runtime.train.distributed import LOCAL
from reel.runtime.train.reexecute import checkpoint_before


class _Payload:
    """What a crafted .metadata unpickles into with plain pickle: a call to os.system."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _manifest(run: Path, step: int, files: dict[str, bytes], directory: str | None = None) -> bytes:
    where = sharded_checkpoint.directory_of(run, step)
    where.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (where / name).write_bytes(data)
    return msgspec.json.encode(sharded_checkpoint.Manifest(
        sharded_checkpoint.FORMAT, step, 2, directory or str(where.relative_to(run)),
        {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}))


@pytest.fixture
def state():
    return fsdp_peer.fresh_state(LOCAL, fsdp_peer.config())


def test_code_execution_checkpoint_is_refused_with_one_line(tmp_path: Path, state) -> None:
    marker = tmp_path / "pwned"
    manifest = _manifest(tmp_path, 10, {".metadata": pickle.dumps(_Payload(marker)), "__0_0.distcp": b""})
    with pytest.raises(CheckpointError) as caught:
        sharded_checkpoint.load(manifest, state, LOCAL, tmp_path, source="checkpoint of step 10")
    message = str(caught.value)
    assert "\n" not in message and "posix.system" in message and "not part of DCP's metadata" in message
    assert not marker.exists()


def test_real_dcp_metadata_still_loads(tmp_path: Path, state) -> None:
    manifest = sharded_checkpoint.save(state, LOCAL, tmp_path)
    assert sharded_checkpoint.load(manifest, state, LOCAL, tmp_path, source="test").step == 0


@pytest.mark.parametrize("directory", ["../outside", "checkpoints/step-000009", "/tmp"])
def test_manifest_directory_must_be_the_steps_own(tmp_path: Path, state, directory: str) -> None:
    run = tmp_path / "run"
    manifest = _manifest(run, 10, {".metadata": b"x"}, directory=directory)
    with pytest.raises(CheckpointError, match="names directory"):
        sharded_checkpoint.load(manifest, state, LOCAL, run, source="test")


def test_manifest_without_files_skips_no_check(tmp_path: Path, state) -> None:
    manifest = _manifest(tmp_path, 10, {})
    with pytest.raises(CheckpointError, match="lists no .metadata"):
        sharded_checkpoint.load(manifest, state, LOCAL, tmp_path, source="test")


def test_manifest_file_that_is_a_symlink_is_refused(tmp_path: Path, state) -> None:
    manifest = sharded_checkpoint.save(state, LOCAL, tmp_path)
    metadata = sharded_checkpoint.directory_of(tmp_path, 0) / ".metadata"
    outside = tmp_path / "elsewhere"
    outside.write_bytes(metadata.read_bytes())  # same bytes, same hash: only the link itself is wrong
    metadata.unlink()
    metadata.symlink_to(outside)
    with pytest.raises(CheckpointError, match="not a regular file"):
        sharded_checkpoint.load(manifest, state, LOCAL, tmp_path, source="test")


def test_metadata_pointing_outside_the_manifest_is_refused(tmp_path: Path, state) -> None:
    manifest = msgspec.json.decode(sharded_checkpoint.save(state, LOCAL, tmp_path), type=sharded_checkpoint.Manifest)
    directory = sharded_checkpoint.directory_of(tmp_path, 0)
    metadata = pickle.loads((directory / ".metadata").read_bytes())  # our own file, written by DCP just now
    for info in metadata.storage_data.values():
        info.relative_path = "../../../../etc/passwd"
    crafted = pickle.dumps(metadata)
    (directory / ".metadata").write_bytes(crafted)
    files = {**manifest.files, ".metadata": hashlib.sha256(crafted).hexdigest()}
    data = msgspec.json.encode(msgspec.structs.replace(manifest, files=files))
    with pytest.raises(CheckpointError, match="not one of the checkpoint's files"):
        sharded_checkpoint.load(data, state, LOCAL, tmp_path, source="test")


def test_a_one_process_commit_never_reads_a_manifest(tmp_path: Path, state) -> None:
    """Which reader runs is the commit's world size, not the blob's content."""
    blobs = BlobStore(tmp_path / "blobs")
    manifest = blobs.put(sharded_checkpoint.save(state, LOCAL, tmp_path))
    one_process = blobs.put(checkpoint_bytes(state))
    commit = StepCommitted(run="r", producer="trainer:0", seq=1, step=2, version=2, groups=[], dropped=[], loss=0.0,
                           grad_norm=0.0, weights_sha256="", timing=StepTiming(0.0, 0.0, 0.0), checkpoint=manifest,
                           world_size=1)
    with pytest.raises(CheckpointError, match="is a DCP manifest but its commit says the trainer had 1 rank"):
        checkpoint_before({2: commit}, 2, blobs)
    sharded = msgspec.structs.replace(commit, checkpoint=one_process, world_size=2)
    with pytest.raises(CheckpointError, match="is a one-process file but its commit says the trainer had 2"):
        checkpoint_before({2: sharded}, 2, blobs)
    assert checkpoint_before({2: msgspec.structs.replace(commit, world_size=2)}, 2, blobs)[0][:1] == b"{"
