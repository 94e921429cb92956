"""`reel run` end to end on this CPU: every role a real process, a real Redis, the real log."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reel.bus.events import MismatchSplit, RunFinished, StepCommitted, Trajectory, WeightsPublished
from reel.bus.run_log import RunLog
from runbuilder import MISMATCH_ROLE, e2e_config
from reel.runtime.launch.cli import main

pytestmark = pytest.mark.slow

def _config(tmp_path: Path, name: str, steps: int) -> Path:
    return e2e_config(tmp_path / f"{name}.toml", name, steps)


def _commits(run_dir: Path) -> list[StepCommitted]:
    with RunLog(run_dir, readonly=True) as log:
        return [e for _, e in log.events("steps") if isinstance(e, StepCommitted)]


def test_short_run_commits_every_step_and_replays_bitwise(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    # Two workers reporting every 0.2 s keep the bus busier than the archiver's 0.5 s block: the run
    # still ends (the workers stop before RunFinished, so the archiver finds the bus drained).
    config = e2e_config(tmp_path / "e2e.toml", "e2e", 4, {"rollout": {"workers": 2, "stats_every_s": 0.2},
                                                         **MISMATCH_ROLE})
    started = time.monotonic()
    assert main(["run", str(config), "--out", str(run_dir), "--no-live"]) == 0
    assert time.monotonic() - started < 100, "the archiver waited out its drain timeout"
    assert "warm-start policy (version 0): mean sampled reward" in capsys.readouterr().out
    commits = _commits(run_dir)
    assert [c.step for c in commits] == [1, 2, 3, 4]
    assert all(0.0 <= c.metrics["reward_mean"] <= 1.0 for c in commits)
    with RunLog(run_dir, readonly=True) as log:
        assert log.verify()["trajectories"] >= 4 * 4
        versions = [e.version for _, e in log.events("weights") if isinstance(e, WeightsPublished)]
        splits = sorted(e.step for _, e in log.events("steps") if isinstance(e, MismatchSplit))
    assert versions == [0, 1, 2, 3, 4]
    assert splits == [1, 2, 3, 4]  # the mismatch role split every step before the run ended
    assert main(["log", "verify", "--run", str(run_dir)]) == 0
    capsys.readouterr()
    for step in (1, 2, 3, 4):
        assert main(["replay", "step", str(step), "--run", str(run_dir), "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["bitwise"] is True, report
    assert not (run_dir / "bus_url").exists()  # the embedded Redis was stopped


def _top(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    assert main(["top", "--run", str(run_dir), "--once"]) == 0
    return " ".join(capsys.readouterr().out.split("training")[0].split())  # the title, however it wraps


def _ends(run_dir: Path) -> list[str]:
    with RunLog(run_dir, readonly=True) as log:
        return [e.reason for _, e in log.events("control") if isinstance(e, RunFinished)]


def test_killed_role_stops_the_run_and_resume_completes_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The log records the failure (the role, its exit code), so `reel top` says failed, not running."""
    run_dir = tmp_path / "run"
    config = _config(tmp_path, "kill", 30)
    argv = [sys.executable, "-m", "reel.runtime.launch.cli", "run", str(config), "--out", str(run_dir), "--no-live"]
    launcher = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not ((run_dir / "log" / "steps").is_dir() and _commits(run_dir)):
            assert launcher.poll() is None, launcher.communicate()
            time.sleep(0.2)
        os.kill(int((run_dir / "roles" / "rollout-0.pid").read_text()), signal.SIGKILL)
        _, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 1
    assert "role rollout-0 stopped" in err and "--resume" not in err.splitlines()[0]
    stopped_at = len(_commits(run_dir))
    assert stopped_at < 30
    assert _ends(run_dir) == ["failed: rollout-0 exited -9"]
    head = _top(run_dir, capsys)
    assert f"failed after step {stopped_at}: rollout-0 exited -9" in head and "running" not in head, head

    resumed = subprocess.run(argv + ["--resume"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    commits = _commits(run_dir)
    assert [c.step for c in commits] == list(range(1, 31))  # the failure's record did not end the resumed run
    assert _ends(run_dir) == ["failed: rollout-0 exited -9", "completed"]
    assert "finished: completed" in _top(run_dir, capsys)
    trained = [g for c in commits for g in c.groups]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    with RunLog(run_dir, readonly=True) as log:
        published = {e.group_id for _, e in log.events("trajectories") if isinstance(e, Trajectory)}
    assert set(trained) <= published
