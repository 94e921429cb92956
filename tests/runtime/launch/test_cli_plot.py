"""`--plot` is checked before any work: a missing folder or a suffix matplotlib cannot write is
one sentence and exit 2 at once, for every command that plots (the run directory here does not
even exist: the analysis would fail on it first if it started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from reel.runtime.launch.cli import main

COMMANDS = {
    "replay step": ["replay", "step", "2", "--run", "{run}"],
    "replay range": ["replay", "range", "1..3", "--run", "{run}"],
    "replay bisect": ["replay", "bisect", "--run", "{run}", "--metric", "loss", "--above", "1"],
    "compare": ["compare", "{run}", "{run}"],
    "simulate": ["simulate", "--run", "{run}"],
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(("plot", "says"), [("missing/dir/fig.png", "does not exist"),
                                            ("fig.pnk", "cannot write a figure as .pnk"),
                                            ("fig", "without a suffix")])
def test_bad_plot_path_is_refused_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  command: str, plot: str, says: str) -> None:
    argv = [a.format(run=tmp_path / "no-such-run") for a in COMMANDS[command]]
    assert main([*argv, "--plot", str(tmp_path / plot)]) == 2
    err = capsys.readouterr().err
    assert says in err and "--plot" in err and "no-such-run" not in err, err
    assert len(err.strip().splitlines()) == 1


def test_a_good_plot_path_passes_the_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--plot", str(tmp_path / "ab.svg")])
    assert code != 0 and "--plot" not in capsys.readouterr().err  # it fails later, on the missing runs
