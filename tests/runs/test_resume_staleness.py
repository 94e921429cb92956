"""A resumed run keeps its staleness bound: interrupted during warm-start, mid-step (the trainer
killed after computing a step, before its commit), between commit and ack, and by Ctrl-C, then
resumed, no step trains tokens older than rollout.async_level allows.

Before the fix, a resumed worker started fresh rounds on top of the groups it had already queued,
so every step after the resume trained a batch one version staler than configured (staleness 2
with async_level = 1, up to max_off_policy_steps = 2)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reel.bus.events import StepCommitted
from reel.bus.log import LogError
from reel.bus.run_log import RunLog
from runbuilder import e2e_config

pytestmark = pytest.mark.slow

STEPS = 10
ASYNC_LEVEL = 1


def _commits(run_dir: Path) -> list[StepCommitted]:
    try:
        with RunLog(run_dir, readonly=True) as log:
            if "steps" not in log.names():
                return []
            return [e for _, e in log.events("steps") if isinstance(e, StepCommitted)]
    except LogError:
        return []


def _argv(config: Path, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "reel.runtime.launch.cli", "run", str(config), "--out", str(run_dir), "--no-live"]


def _wait_for(launcher: subprocess.Popen, ready, what: str, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert launcher.poll() is None, f"the run ended before {what}: {launcher.communicate()}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s"
        time.sleep(0.1)


def _interrupted_run(tmp_path: Path, how: str) -> tuple[Path, Path]:
    """A run of STEPS steps stopped `how`; returns (config, run_dir)."""
    # A seed of its own: the warm-start is not in the session's cache, so there is one to interrupt.
    config = e2e_config(tmp_path / "c.toml", f"stale-{how}", STEPS,
                        {"run": {"seed": 101 if how == "warm-start" else 0}})
    run_dir = tmp_path / "run"
    env = dict(os.environ)
    if how in ("mid-step", "commit-ack"):
        env["REEL_CRASH_AT"] = "3:computed" if how == "mid-step" else "3:committed"
    launcher = subprocess.Popen(_argv(config, run_dir), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    try:
        if how == "warm-start":
            _wait_for(launcher, lambda: (run_dir / "roles" / "progress.json").exists(), "warm-start progress")
            launcher.send_signal(signal.SIGINT)
        elif how == "ctrl-c":
            _wait_for(launcher, lambda: len(_commits(run_dir)) >= 3, "third commit")
            launcher.send_signal(signal.SIGINT)
        out, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == (130 if how in ("warm-start", "ctrl-c") else 1), err
    if how == "warm-start":  # long work is not silent: progress, where its cache goes, and the stop
        assert "warm-start: " in out and "REEL_CACHE moves the cache" in out, out
        assert "stopping every role" in err, err
    done = len(_commits(run_dir))
    assert done == 0 if how == "warm-start" else 2 <= done < STEPS, (how, done)
    return config, run_dir


@pytest.mark.parametrize("how", ["warm-start", "mid-step", "commit-ack", "ctrl-c"])
def test_resumed_run_keeps_the_staleness_bound(tmp_path: Path, how: str) -> None:
    config, run_dir = _interrupted_run(tmp_path, how)
    resumed = subprocess.run(_argv(config, run_dir) + ["--resume"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    commits = _commits(run_dir)
    assert [c.step for c in commits] == list(range(1, STEPS + 1))
    histogram: dict[int, int] = {}
    for c in commits:
        for behind, tokens in c.staleness.items():
            histogram[behind] = histogram.get(behind, 0) + tokens
    assert max(histogram) <= ASYNC_LEVEL, f"tokens per versions behind: {histogram}"
    assert not [d for c in commits for d in c.dropped if d.reason.startswith("stale")]
