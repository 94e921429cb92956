"""SIGTERM and SIGHUP stop `reel run` as Ctrl-C does: under `timeout` (which passes on the signals
it gets, as Slurm and systemd send them), every role and the embedded Redis stop, and the run
resumes to its last step (resumed after SIGTERM only: the record of a stop does not depend on the signal). How the run ended is in its log, so `reel top` tells a stopped run from a
finished one (a failed one: tests/runs/test_run_e2e.py), and a resume of it runs to the end."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reel.bus.events import ConfigChanged, RunFinished, StepCommitted
from reel.bus.log import LogError
from reel.bus.run_log import RunLog
from reel.runtime.launch.cli import main
from runbuilder import MISMATCH_ROLE, e2e_config

pytestmark = pytest.mark.slow

STEPS = 6


def _commits(run_dir: Path) -> list[int]:
    try:
        with RunLog(run_dir, readonly=True) as log:
            if "steps" not in log.names():
                return []
            return [e.step for _, e in log.events("steps") if isinstance(e, StepCommitted)]
    except LogError:
        return []


def _ends(run_dir: Path) -> list[str]:
    """The log's record of the run's ends and resumes, in order."""
    with RunLog(run_dir, readonly=True) as log:
        return [e.reason if isinstance(e, RunFinished) else "resumed" for _, e in log.events("control")
                if isinstance(e, (RunFinished, ConfigChanged))]


def _top(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    assert main(["top", "--run", str(run_dir), "--once"]) == 0
    return " ".join(capsys.readouterr().out.split("training")[0].split())  # the title, however it wraps


def _wait_for_a_commit(run_dir: Path, launcher: subprocess.Popen) -> None:
    deadline = time.monotonic() + 240
    while not _commits(run_dir):
        assert launcher.poll() is None, launcher.communicate()
        assert time.monotonic() < deadline, "no commit within 240 s"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for a parent that is gone (PID 1 of a container may never reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=["SIGTERM", "SIGHUP", "SIGINT"])
def test_stop_signal_stops_every_process_and_the_run_resumes(tmp_path: Path, sig: signal.Signals,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    config = e2e_config(tmp_path / "c.toml", f"signal-{sig.name.lower()}", STEPS, MISMATCH_ROLE)
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "reel.runtime.launch.cli", "run", str(config), "--out", str(run_dir), "--no-live"]
    launcher = subprocess.Popen(["timeout", "-s", "TERM", "600", *argv], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_a_commit(run_dir, launcher)
        pids = {p.stem: int(p.read_text()) for p in (run_dir / "roles").glob("*.pid")}
        pids["redis"] = int((run_dir / "redis" / "redis.pid").read_text())
        assert {"archiver", "trainer", "rollout-0", "mismatch", "redis"} <= set(pids)
        launcher.send_signal(sig)  # to `timeout`, which sends it on to `reel run`
        _, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + sig, err
    assert f"stopped by {sig.name}; every role stopped" in err and "--resume" in err, err
    assert "Traceback" not in err, err
    assert not [name for name, pid in pids.items() if _alive(pid)], "processes left running after the stop"
    assert not (run_dir / "bus_url").exists()
    stopped_at = len(_commits(run_dir))
    assert 1 <= stopped_at < STEPS
    assert _ends(run_dir) == [f"stopped: {sig.name}"]
    assert f"stopped after step {stopped_at} by {sig.name}, not finished" in _top(run_dir, capsys)
    if sig != signal.SIGTERM:
        return  # a stop is recorded alike whatever the signal: resuming it once (SIGTERM) is enough

    resumed = subprocess.run(["timeout", "-s", "TERM", "300", *argv, "--resume"], capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert _commits(run_dir) == list(range(1, STEPS + 1))  # the old end did not stop the resumed archiver
    assert _ends(run_dir) == [f"stopped: {sig.name}", "resumed", "completed"]
    assert "finished: completed" in _top(run_dir, capsys)

