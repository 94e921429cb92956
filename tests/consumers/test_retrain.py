"""`reel retrain`: offline training from a run's log reproduces it bit for bit, or diverges on purpose."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from reel.bus.events import StepCommitted
from reel.bus.run_log import RunLog
from reel.bus.retention import RetentionPolicy
from reel.runtime.config.run import load
from reel.runtime.launch.cli import main
from runbuilder import build_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_run(tmp_path_factory.mktemp("retrain") / "A")


def _commits(run_dir: Path) -> list[StepCommitted]:
    with RunLog(run_dir, readonly=True) as log:
        return [e for _, e in log.events("steps") if isinstance(e, StepCommitted)]


def test_retrain_without_override_reproduces_every_weight_hash(source: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "B"
    assert main(["retrain", "--from", str(source), "--out", str(out)]) == 0
    a, b = _commits(source), _commits(out)
    assert [c.step for c in b] == [c.step for c in a]
    assert [c.weights_sha256 for c in b] == [c.weights_sha256 for c in a]
    assert [c.groups for c in b] == [c.groups for c in a]
    capsys.readouterr()
    # B is a normal run: its log verifies and replay works on it.
    assert main(["log", "verify", "--run", str(out)]) == 0
    assert main(["replay", "step", "3", "--run", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["bitwise"] is True


def test_retrain_keeps_what_reel_run_would_and_replays_after_retention(source: Path, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "B"
    assert main(["retrain", "--from", str(source), "--out", str(out), "--epochs", "3"]) == 0
    config = load(out / "config.toml")
    window = RetentionPolicy.of(config.rollout.async_level, config.trainer.max_off_policy_steps).window
    steps = 3 * len(_commits(source))
    assert config.log.keep_weights_every == 0 and steps > window + 1
    capsys.readouterr()
    assert main(["log", "du", "--run", str(out), "--json"]) == 0
    du = json.loads(capsys.readouterr().out)
    assert (du["weight_versions_published"], du["weight_versions_stored"]) == (steps + 1, window)
    assert du["checkpoints"] == steps // config.trainer.checkpoint_every and du["bytes"]["other_blobs"] == 0
    # Step 4 starts from version 3: deleted, re-derived from the checkpoint of step 2.
    assert main(["replay", "step", "4", "--run", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["bitwise"] is True


def test_retrain_with_a_changed_learning_rate_diverges_and_completes(source: Path, tmp_path: Path) -> None:
    override = tmp_path / "lr.toml"
    override.write_text("[trainer]\nlr = 0.01\n")
    out = tmp_path / "B"
    assert main(["retrain", "--from", str(source), "--out", str(out), "--config", str(override)]) == 0
    a, b = _commits(source), _commits(out)
    assert len(b) == len(a)
    assert all(x.weights_sha256 != y.weights_sha256 for x, y in zip(a, b))
    assert main(["replay", "range", f"1..{len(b)}", "--run", str(out), "--json"]) == 0


def test_steps_epochs_and_shuffle_shape_the_schedule(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "B"
    assert main(["retrain", "--from", str(source), "--out", str(out), "--epochs", "2", "--shuffle", "3",
                 "--steps", "5"]) == 0
    b = _commits(out)
    assert [c.step for c in b] == [1, 2, 3, 4, 5]
    used = {g for c in _commits(source) for g in c.groups}
    assert all(set(c.groups) <= used for c in b)
    assert [c.groups for c in b[:4]] != [c.groups for c in _commits(source)]


def test_missing_or_damaged_log_is_one_clear_error(source: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.toml").write_text((source / "config.toml").read_text())
    assert main(["retrain", "--from", str(empty), "--out", str(tmp_path / "B1")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "log" in err, err
    assert not (tmp_path / "B1").exists()

    damaged = tmp_path / "damaged"
    shutil.copytree(source, damaged)
    segment = sorted((damaged / "log" / "trajectories").glob("*.seg"))[0]
    data = bytearray(segment.read_bytes())
    data[len(data) // 3] ^= 0xFF
    segment.write_bytes(bytes(data))
    assert main(["retrain", "--from", str(damaged), "--out", str(tmp_path / "B2")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(segment) in err and "byte" in err, err
    assert not (tmp_path / "B2").exists()
