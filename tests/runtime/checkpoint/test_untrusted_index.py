"""A checkpoint's shard index is untrusted input: its names never reach outside the checkpoint, and
nothing is linked into a run's init/ before every name is checked (runtime/model/weights.py,
runtime/train/initial_policy.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hf_checkpoint import make_checkpoint
from reel.runtime.train.initial_policy import link_checkpoint
from reel.runtime.model.config import ModelError
from reel.runtime.model.weights import load, shard_files

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("hf") / "tiny-qwen3-moe")


def _copy_with_index_entry(checkpoint: Path, where: Path, shard_name: str) -> Path:
    copy = where / "model"
    shutil.copytree(checkpoint, copy)
    index = json.loads((copy / INDEX).read_text())
    index["weight_map"]["stolen"] = shard_name
    (copy / INDEX).write_text(json.dumps(index))
    return copy


@pytest.mark.parametrize("name", ["/etc/passwd", "../../../../etc/passwd", "sub/x.safetensors", "model.bin"])
def test_index_names_outside_the_checkpoint_are_refused_before_any_link(tmp_path: Path, checkpoint: Path,
                                                                         name: str) -> None:
    source = _copy_with_index_entry(checkpoint, tmp_path, name)
    target = tmp_path / "init"
    target.mkdir()
    with pytest.raises(ModelError, match="which is not a \\*.safetensors file name in its directory"):
        link_checkpoint(source, target)
    assert list(target.iterdir()) == []


def test_a_shard_that_links_out_of_the_checkpoint_is_refused(tmp_path: Path, checkpoint: Path) -> None:
    secret = tmp_path / "secret.safetensors"
    secret.write_bytes(b"0600 secret")
    secret.chmod(0o600)
    source = _copy_with_index_entry(checkpoint, tmp_path, "evil.safetensors")
    (source / "evil.safetensors").symlink_to(secret)
    target = tmp_path / "init"
    target.mkdir()
    with pytest.raises(ModelError, match="is not a regular file inside"):
        link_checkpoint(source, target)
    assert list(target.iterdir()) == []
    with pytest.raises(ModelError, match="is not a regular file inside"):
        shard_files(source)


def test_a_hugging_face_cache_snapshot_still_loads(tmp_path: Path, checkpoint: Path) -> None:
    """The hub's layout: snapshots/REV/NAME links to ../../blobs/HASH, inside the repo's folder."""
    repo = tmp_path / "models--tiny"
    snapshot, blobs = repo / "snapshots" / "abc", repo / "blobs"
    snapshot.mkdir(parents=True), blobs.mkdir()
    for f in checkpoint.iterdir():
        shutil.copyfile(f, blobs / f.name)
        (snapshot / f.name).symlink_to(Path("../../blobs") / f.name)
    assert [p.name for p in shard_files(snapshot)] == [p.name for p in shard_files(checkpoint)]
    target = tmp_path / "init"
    target.mkdir()
    link_checkpoint(snapshot, target)
    assert all(not p.is_symlink() for p in target.iterdir())
    assert load(target).config == load(checkpoint).config
