"""Tables fit an 80-column terminal without cutting a number: `reel top`'s and `replay range`'s
views hide whole columns from the right (and say so) instead of printing `0.…` or `1.915e…`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from rich.console import Console
from rich.table import Table

from reel.consumers.metric_views import render
from reel.consumers.metrics import RunSource, read_log
from reel.replay import report as report_mod
from reel.replay.analysis import Run, replay_range
from reel.replay.console import print_view
from runbuilder import build_run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_run(tmp_path_factory.mktemp("fit") / "run", {"run": {"name": "fit"}})


def _terminal(width: int = 80) -> Console:
    return Console(width=width, force_terminal=True, record=True, color_system=None)


def _printed(renderable: object, width: int = 80) -> str:
    console = _terminal(width)
    print_view(renderable, console)
    return console.export_text()


def test_numbers_are_never_cut_and_hidden_columns_are_named() -> None:
    table = Table(title="wide")
    values = ["1.915e-02", "1.915e-13", "0.015625", "-0.24360001", "123456.5"]
    for i in range(12):
        table.add_column(f"metric {i}", justify="right")
    table.add_row(*[values[i % len(values)] for i in range(12)])
    out = _printed(table)
    assert "…" not in out
    assert max(len(line) for line in out.splitlines()) <= 80
    shown = re.findall(r"-?\d[\d.]*e-\d+|-?\d+\.\d+", out)
    assert shown and set(shown) <= set(values), shown
    assert "1.915e-02" in out and "1.915e-13" in out
    assert "columns hidden to fit 80 columns" in " ".join(out.split())


def test_a_table_that_fits_is_unchanged() -> None:
    table = Table()
    table.add_column("a")
    table.add_row("1.915e-13")
    assert "hidden" not in _printed(table)


def test_top_and_replay_range_fit_80_columns(run_dir: Path) -> None:
    top = _printed(render(read_log(RunSource("fit", None, run_dir)), f"log {run_dir}", live=False))
    rows = replay_range(Run(run_dir), 1, 4, recompute=False)
    ranged = _printed(report_mod.range_view(rows))
    for out in (top, ranged):
        assert "…" not in out, out
        assert max(len(line) for line in out.splitlines()) <= 80, out
