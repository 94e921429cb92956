"""The example with trainer.ranks = 2: `reel run` starts the trainer as 2 FSDP2 ranks under
torchrun; the run learns, its steps replay bitwise on 2 ranks (also from a DCP checkpoint), a
1-process replay reports how far it lands, and `reel retrain --ranks 2` reproduces its weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from reel.bus.blob_backends.file import BlobStore
from reel.bus.events import StepCommitted, WeightsPublished
from reel.bus.run_log import RunLog
from reel.runtime.weights.load import read_manifest
from paths import REPO

pytestmark = pytest.mark.slow
EXAMPLE = REPO / "examples" / "reverse_text.toml"
STEPS = 8


def _reel(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "reel.runtime.launch.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def _commits(run_dir: Path) -> list[StepCommitted]:
    with RunLog(run_dir, readonly=True) as log:
        return [e for _, e in log.events("steps") if isinstance(e, StepCommitted)]


@pytest.mark.timeout(1500)  # ~4 minutes on an idle 2-core machine; a busy one takes much longer
def test_example_on_two_ranks_learns_replays_and_retrains(tmp_path: Path) -> None:
    text = EXAMPLE.read_text().replace("steps = 60", f"steps = {STEPS}")
    text = text.replace("checkpoint_every = 10", "checkpoint_every = 4\nranks = 2")
    text += "\n[log]\nkeep_weights_every = 1  # every version kept: the 1-rank replay compares with step 5's\n"
    config = tmp_path / "ranks2.toml"
    config.write_text(text)
    run_dir = tmp_path / "run"
    done = _reel("run", str(config), "--out", str(run_dir), "--no-live", timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 8/8" in done.stdout and "nan" not in done.stdout  # N ranks log no mismatch split: none shown
    commits = _commits(run_dir)
    assert [c.step for c in commits] == list(range(1, STEPS + 1))
    assert all(c.world_size == 2 and c.weights_sha256.startswith("pieces:") for c in commits)  # no gather
    with RunLog(run_dir, readonly=True) as run_log:
        published = [e for _, e in run_log.events("weights") if isinstance(e, WeightsPublished)]
    manifest = read_manifest(BlobStore(run_dir / "blobs"), published[-1].weights)
    assert {s.rank for s in manifest.shards} == {0, 1}  # each rank wrote its own shards
    rewards = [c.metrics["reward_mean"] for c in commits]
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.05, rewards  # it learns (1 rank: ~+0.1 by step 8)

    # One 2-rank replay: from the DCP checkpoint of step 4, step 5 re-executed and checked, then 6..8.
    replayed = _reel("replay", "range", "6..8", "--recompute", "--run", str(run_dir), "--json")
    assert replayed.returncode == 0, replayed.stderr[-3000:]
    rows = json.loads(replayed.stdout)["steps"]
    assert [(r["step"], r["recomputed"]["bitwise"]) for r in rows] == [(6, True), (7, True), (8, True)]

    alone = _reel("replay", "step", "5", "--run", str(run_dir), "--json", "--ranks", "1")
    assert alone.returncode == 0, alone.stderr[-3000:]  # a deviation report, not a failure
    report = json.loads(alone.stdout)
    assert report["bitwise"] is False and report["ranks"] == 1 and report["recorded_ranks"] == 2
    assert 0 < report["max_weight_diff"] < 1e-3, report
    assert "re-executed on 1 rank(s), the run trained on 2" in report["mismatch"]

    out = tmp_path / "retrained"
    retrained = _reel("retrain", "--from", str(run_dir), "--out", str(out), "--steps", "2", "--ranks", "2")
    assert retrained.returncode == 0, retrained.stderr[-3000:]
    again = _commits(out)
    assert [c.weights_sha256 for c in again] == [c.weights_sha256 for c in commits[:2]]
    assert all(c.world_size == 2 for c in again)
