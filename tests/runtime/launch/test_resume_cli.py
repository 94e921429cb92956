"""`reel run --resume` tells the truth: the advice after a failure works as printed, a resume says
where it continues and does not print the history again, a finished run says so and is extended
by raising run.steps (a ConfigChanged in the log), and a change that would alter what the run
trains is refused naming every key."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from reel.bus.events import ConfigChanged, RunFinished, StepCommitted
from reel.bus.run_log import RunLog
from runbuilder import e2e_config

pytestmark = pytest.mark.slow

REEL = [sys.executable, "-m", "reel.runtime.launch.cli"]


def _log(run_dir: Path) -> tuple[list[int], list[ConfigChanged]]:
    with RunLog(run_dir, readonly=True) as log:
        steps = [e.step for _, e in log.events("steps") if isinstance(e, StepCommitted)]
        changes = [e for _, e in log.events("control") if isinstance(e, ConfigChanged)]
    return steps, changes


def _reel(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*REEL, *args], capture_output=True, text=True, timeout=300, env=env)


def test_resume_continues_extends_and_names_what_it_refuses(tmp_path: Path) -> None:
    config = e2e_config(tmp_path / "c.toml", "resumecli", 4)
    run_dir = tmp_path / "run"
    crashed = _reel("run", str(config), "--out", str(run_dir), "--no-live",
                    env={**os.environ, "REEL_CRASH_AT": "2:committed"})
    assert crashed.returncode == 1, crashed.stderr
    advice = re.search(r"`(reel run [^`]*--resume[^`]*)` continues this run", crashed.stderr)
    assert advice, crashed.stderr
    before = len(_log(run_dir)[0])

    resumed = _reel(*shlex.split(advice.group(1))[1:], "--no-live")  # the advice, as printed
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming run resumecli in {run_dir} after step {before} of 4" in resumed.stderr
    shown = [int(m) for m in re.findall(r"^step (\d+)/4", resumed.stdout, re.M)]
    assert shown and min(shown) == before + 1, resumed.stdout  # the history is not printed again
    assert "run finished: 4 steps" in resumed.stdout and "reel export --run" in resumed.stdout

    again = _reel("run", str(config), "--out", str(run_dir), "--no-live", "--resume")
    assert again.returncode == 0 and "already complete (4 of 4 steps committed)" in again.stderr, again.stderr
    assert _log(run_dir)[0] == [1, 2, 3, 4]

    text = config.read_text()
    unsafe = text.replace("[trainer]\n", "[trainer]\nlr = 0.5\n").replace("[rollout]\n", "[rollout]\ntemperature = 0.7\n")
    config.write_text(unsafe)
    refused = _reel("run", str(config), "--out", str(run_dir), "--no-live", "--resume")
    assert refused.returncode == 1
    assert "rollout.temperature (1.0 -> 0.7)" in refused.stderr and "trainer.lr (0.001 -> 0.5)" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert "lr = 0.5" not in (run_dir / "config.toml").read_text()

    config.write_text(text.replace("steps = 4", "steps = 6"))
    extended = _reel("run", str(config), "--out", str(run_dir), "--no-live", "--resume")
    assert extended.returncode == 0, extended.stderr
    assert "after step 4 of 6, run.steps 4 -> 6" in extended.stderr
    steps, changes = _log(run_dir)
    assert steps == [1, 2, 3, 4, 5, 6]
    # Each resume is logged (a ConfigChanged, with the keys it changed): the crash's, then the extension.
    assert [(c.changed, c.after_step) for c in changes] == [({}, before), ({"run.steps": [4, 6]}, 4)]
    with RunLog(run_dir, readonly=True) as log:
        ends = [e.reason for _, e in log.events("control") if isinstance(e, RunFinished)]
    assert ends == ["failed: trainer exited -9", "completed", "completed"]
    assert "steps = 6" in (run_dir / "config.toml").read_text()
