"""`reel log verify` checks the files the log names (blobs, init/, checkpoints), and replay names a
tampered run directory as tampered rather than as a machine that is not deterministic
(replay/integrity.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from reel.bus.blob_backends.file import BlobStore
from reel.bus.events import StepCommitted
from reel.bus.run_log import RunLog
from reel.runtime.launch.cli import main
from runbuilder import build_run

pytestmark = pytest.mark.slow  # builds a run and replays it


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_run(tmp_path_factory.mktemp("tamper") / "run",
                     {"run": {"steps": 3}, "init": {"warmup_steps": 0}, "trainer": {"checkpoint_every": 2}})


def _copy(run: Path, where: Path) -> Path:
    import shutil

    return Path(shutil.copytree(run, where / "copy"))


def test_an_untouched_run_verifies(run: Path, capsys) -> None:
    assert main(["log", "verify", "--run", str(run)]) == 0
    assert "blobs, init/ and checkpoints match the hashes the log names" in capsys.readouterr().out


def test_changed_init_weights_are_named_by_verify_and_by_replay(run: Path, tmp_path: Path, capsys) -> None:
    copy = _copy(run, tmp_path)
    weights = copy / "init" / "model.safetensors"
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1e-3
    weights.unlink()  # a hard link to the original run's file: replace it, do not write through it
    save_file(tensors, weights, metadata={"format": "pt"})
    assert main(["log", "verify", "--run", str(copy)]) == 1
    out, err = capsys.readouterr()
    assert "tampered: init/ holds weights hashing to" in out and "do not match it" in err
    assert main(["replay", "step", "2", "--run", str(copy)]) != 0
    err = capsys.readouterr().err
    assert "step 1 re-executed to different weights" in err
    assert "the run directory was tampered with: init/ holds weights hashing to" in err
    assert "not deterministic" not in err.split("tampered")[1]


def test_a_changed_checkpoint_blob_is_named(run: Path, tmp_path: Path, capsys) -> None:
    copy = _copy(run, tmp_path)
    with RunLog(copy, readonly=True) as log:
        commit = next(e for _, e in log.events("steps") if isinstance(e, StepCommitted) and e.checkpoint)
    blob = BlobStore(copy / "blobs").path(commit.checkpoint)
    data = bytearray(blob.read_bytes())
    data[-1] ^= 1
    blob.unlink()
    blob.write_bytes(bytes(data))
    assert main(["log", "verify", "--run", str(copy)]) == 1
    assert f"tampered: the checkpoint of step {commit.step}: blob {commit.checkpoint.sha256}" in capsys.readouterr().out
