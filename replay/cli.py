"""`reel replay step N` and `reel replay range A..B`: parse, run replay/analysis.py, print, plot.

`step` (and `range --recompute`) exit 1 when a step did not reproduce bitwise, with the reason on
stderr; errors that stop the replay (a step not in the log, a damaged record, a catch-up step that
does not reproduce) are ReelErrors, one line on stderr and exit 2 (runtime/cli.py).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bus.errors import ReelError
from bus.jsonout import print_json
from replay import report as report_mod
from replay.analysis import OnStep, Run, replay_range, replay_step
from replay.console import print_view
from runtime.reexecute import newest_checkpoint


class RangeError(ReelError):
    """A step range argument that is not A..B."""


def main_step(args: argparse.Namespace) -> int:
    run = Run(Path(args.run_dir))
    with _progress(run, first=args.step, last=args.step) as on_step:
        report, analysis = replay_step(run, args.step, on_step)
    if args.json:
        print_json(report)
    else:
        print_view(report_mod.step_view(report))
    if args.plot:
        report_mod.plot_step(report, analysis, Path(args.plot))
    if not report.bitwise:
        print(f"reel: step {report.step} did not reproduce: {report.mismatch}", file=sys.stderr)
        return 1
    return 0


def main_range(args: argparse.Namespace) -> int:
    first, last = parse_range(args.range)
    run = Run(Path(args.run_dir))
    if args.recompute:
        with _progress(run, first=first, last=last, analysed=last - first + 1) as on_step:
            rows = replay_range(run, first, last, recompute=True, on_step=on_step)
    else:
        rows = replay_range(run, first, last, recompute=False)
    if args.json:
        print_json({"first": first, "last": last, "steps": rows})
    else:
        print_view(report_mod.range_view(rows))
    if args.plot:
        report_mod.plot_range(rows, Path(args.plot))
    failed = [row for row in rows if row.recomputed is not None and not row.recomputed.bitwise]
    for row in failed:
        print(f"reel: step {row.step} did not reproduce: {row.recomputed.mismatch}", file=sys.stderr)
    return 1 if failed else 0


def parse_range(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)\.\.(\d+)", text.strip())
    if match is None:
        raise RangeError(f"step range {text!r} must be A..B with whole step numbers, e.g. 1..20")
    return int(match.group(1)), int(match.group(2))


@contextmanager
def _progress(run: Run, *, first: int, last: int, analysed: int = 1) -> Iterator[OnStep]:
    """A progress bar on a terminal's stderr over the steps re-executed up to `last`."""
    console = Console(stderr=True)
    if not console.is_terminal:
        yield lambda step: None
        return
    base = newest_checkpoint(run.commits, first - 1)
    start = base.step if base is not None else 0
    total = max(0, first - 1 - start) + analysed
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task(f"replaying steps {start + 1}..{last} of {run.run_dir}", total=total)
        yield lambda step: progress.update(task, advance=1, description=f"re-executed step {step} of {last}")
