"""`reel run` with a role frozen (SIGSTOP) or its Redis killed: the liveness rules act, nothing is lost.

A frozen rollout worker is named, killed and started again, and the run completes and verifies; a
frozen trainer stops the run with the resume command, and the resume completes and replays bitwise; an
embedded Redis that has exited (not paused) stops the run at once, not after bus.ride_out_s, with the
resume command, and the resume completes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from reel.runtime.heartbeat import read_beats
from reel.runtime.launch import liveness
from reel.runtime.launch.cli import main
from stall_config import reverse_text_with_stall_bound

TIMEOUT_S = 300


def _launch(config: Path, run_dir: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "reel.runtime.launch.cli", "run", str(config), "--out", str(run_dir),
                             "--no-live", *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _resume_completes(config: Path, run_dir: Path) -> None:
    """`reel run --resume` finishes the run, and its log verifies."""
    resumed = _launch(config, run_dir, "--resume")
    out = resumed.communicate(timeout=TIMEOUT_S)[0]
    assert resumed.returncode == 0, out
    assert main(["log", "verify", "--run", str(run_dir)]) == 0


def _until_progress(run: subprocess.Popen[str], run_dir: Path, role: str, count: int) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while (beat := read_beats(run_dir / "roles").get(role)) is None or beat.progress_count < count:
        assert run.poll() is None, run.communicate()[0]
        assert time.monotonic() < deadline, f"{role} made no progress"
        time.sleep(0.2)


def test_a_frozen_rollout_worker_is_restarted_and_the_run_completes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run = _launch(reverse_text_with_stall_bound(tmp_path, steps=10, stall_s=15), run_dir)
    _until_progress(run, run_dir, "rollout-0", 2)
    frozen = int((run_dir / "roles" / "rollout-0.pid").read_text())
    os.kill(frozen, signal.SIGSTOP)
    out = run.communicate(timeout=TIMEOUT_S)[0]
    assert run.returncode == 0, out
    assert "reel: rollout-0 has made no progress for " in out
    assert out.count("reel: killed rollout-0, which had stalled, and started it again") == 1, out
    assert int((run_dir / "roles" / "rollout-0.pid").read_text()) != frozen
    assert main(["log", "verify", "--run", str(run_dir)]) == 0


def test_a_frozen_trainer_stops_the_run_with_the_resume_command_and_the_resume_replays_bitwise(
        tmp_path: Path, capsys) -> None:
    steps = 14  # frozen after 6 commits: the resume trains 8 more (30 took the suite 25 s longer)
    config = reverse_text_with_stall_bound(tmp_path, steps=steps, stall_s=5)
    run_dir = tmp_path / "run"
    run = _launch(config, run_dir)
    _until_progress(run, run_dir, "trainer", 6)
    os.kill(int((run_dir / "roles" / "trainer.pid").read_text()), signal.SIGSTOP)
    frozen = time.monotonic()
    out = run.communicate(timeout=TIMEOUT_S)[0]
    assert run.returncode == 1, out
    assert "reel: trainer has made no progress for " in out
    assert "reel: role trainer stalled, so the run was stopped" in out
    assert f"`reel run {config} --resume --out {run_dir}` continues this run" in out
    # Named within its bound, stopped within HUNG_FACTOR bounds (and the supervisor's stop), not waited on.
    assert time.monotonic() - frozen < 5 * liveness.HUNG_FACTOR + 40, out
    _resume_completes(config, run_dir)
    capsys.readouterr()
    assert main(["replay", "step", str(steps), "--run", str(run_dir), "--json"]) == 0  # a step of the resume
    assert json.loads(capsys.readouterr().out)["bitwise"] is True


def test_a_killed_redis_stops_the_run_at_once_and_the_resume_completes(tmp_path: Path) -> None:
    config = reverse_text_with_stall_bound(tmp_path, steps=8, stall_s=15)
    run_dir = tmp_path / "run"
    run = _launch(config, run_dir)
    _until_progress(run, run_dir, "trainer", 4)
    os.kill(int((run_dir / "redis" / "redis.pid").read_text()), signal.SIGKILL)
    killed = time.monotonic()
    out = run.communicate(timeout=TIMEOUT_S)[0]
    # Every role stops within the supervisor's stop bound (20 s), not after bus.ride_out_s (60 s).
    assert run.returncode == 1 and time.monotonic() - killed < 40, out
    assert "reel: the run's Redis refuses connections: it has exited" in out
    assert f"`reel run {config} --resume --out {run_dir}` restarts Redis" in out
    _resume_completes(config, run_dir)
