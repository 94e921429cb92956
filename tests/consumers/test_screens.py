"""Screens that say what is true: `reel top` on a run that stopped, tokens/s from the first step,
the step count of a finished run, `metrics serve` on a busy port, and bare `reel`."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from reel.bus.events import StepCommitted, StepTiming
from reel.runtime.config import run as config_mod
from reel.runtime.launch.cli import main
from reel.runtime.launch.progress import Progress, tokens_per_s
from runbuilder import build_run


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run's log without RunFinished and no live bus: what Ctrl-C or a failed role leaves."""
    return build_run(tmp_path_factory.mktemp("screens") / "run", {"run": {"name": "screens"}})


def _commit(step: int, tokens: int, seconds: float) -> StepCommitted:
    return StepCommitted(run="r", producer="trainer:0", seq=step, step=step, version=step, groups=[], dropped=[],
                         loss=0.0, grad_norm=0.0, weights_sha256="ab" * 32, staleness={0: tokens - 10, 1: 10},
                         timing=StepTiming(wait=seconds / 2, compute=seconds / 4, publish=seconds / 4),
                         metrics={"reward_mean": 0.5})


def test_top_says_a_run_without_runfinished_and_bus_stopped(stopped_run: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["top", "--run", str(stopped_run), "--once"]) == 0
    head = " ".join(capsys.readouterr().out.split("training")[0].split())  # the title, however it wraps
    assert "stopped after step 4, not finished" in head and "running" not in head, head


def test_tokens_per_s_is_measured_from_the_first_step() -> None:
    steps = [_commit(1, 100, 2.0), _commit(2, 300, 1.0)]
    assert tokens_per_s(steps, 1) == pytest.approx(50.0)
    assert tokens_per_s(steps, 2) == pytest.approx(400 / 3.0)
    assert tokens_per_s([_commit(s, 100, 1.0) for s in range(1, 11)], 10, window=5) == pytest.approx(100.0)
    line = Progress("redis://127.0.0.1:1", config_mod.from_dict({"run": {"steps": 2}}), live=False)
    line.steps = steps
    assert "tokens/s 50 " in line._line(steps[0])


def test_run_finished_counts_the_last_step_not_the_lines_shown(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    progress = Progress("redis://127.0.0.1:1", config_mod.from_dict({"run": {"steps": 1000}}), live=False)
    progress.steps = [_commit(s, 100, 1.0) for s in range(26, 1001)]  # the view missed the first 25 (trimmed)
    progress.finish(tmp_path)
    out = capsys.readouterr().out
    assert "run finished: 1000 steps" in out
    assert f"reel export --run {tmp_path} --out {tmp_path / 'export'}" in out and "final policy: step 1000" in out


def test_metrics_serve_on_a_busy_port_fails_without_saying_it_serves(stopped_run: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["metrics", "serve", "--run", str(stopped_run), "--port", str(port)]) == 1
    captured = capsys.readouterr()
    assert "serving metrics" not in captured.out and f"cannot serve metrics on 127.0.0.1:{port}" in captured.err


def test_bare_reel_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    err = capsys.readouterr().err
    for command in ("run", "replay", "export", "init", "top", "log"):
        assert f"\n    {command} " in err, err
