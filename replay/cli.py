"""`reel replay step N|range A..B|bisect` and `reel compare`: parse, run the analysis, print, plot.

`step` (and `range --recompute`) exit 1 when a step did not reproduce bitwise, with the reason on
stderr, and `bisect` when the metric never crosses the threshold (like grep finding nothing). So
do they when the state before the step cannot be rebuilt: a checkpoint missing or corrupt (named,
with the nearest usable one), or a re-executed step whose weight hash differs from its commit.
Other errors that stop the replay (a step not in the log, a damaged record) are ReelErrors, one
line on stderr and exit 2 (runtime/launch/cli.py).

Steps re-execute on the world size they were trained on: for a run of N trainer ranks this command
starts itself again as N ranks under torchrun (rank 0 prints); `--ranks R` picks another world
size and reports how far the re-execution lands (exit 0).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from reel.bus.errors import ReelError
from reel.bus.jsonout import print_json
from reel.replay import debug_views
from reel.replay import report as report_mod
from reel.replay.analysis import OnStep, Run, replay_range, replay_step
from reel.replay.bisect import bisect, locate
from reel.replay.compare import compare
from reel.replay.console import print_view
from reel.runtime.train import distributed, torchrun
from reel.runtime.config.run import load_run_config
from reel.runtime.train.reexecute import CheckpointUnusable, ReplayMismatch, newest_checkpoint
from reel.runtime.train.trainer_group import TrainerGroup, run_as_group


class RangeError(ReelError):
    """A step range argument that is not A..B."""


def main_step(args: argparse.Namespace) -> int:
    run = Run(Path(args.run_dir))
    run.require(args.step, args.step)
    ranks = args.ranks or run.commits[args.step].world_size
    return _on_ranks(run, ranks, ["replay", "step", str(args.step)], args,
                     lambda: _unrebuilt_exits_1(lambda: _step(run, args, ranks)))


def _unrebuilt_exits_1(lead: Callable[[], int]) -> int:
    """A state that cannot be rebuilt is a replay that did not reproduce: exit 1 with the reason."""
    try:
        return lead()
    except (CheckpointUnusable, ReplayMismatch) as exc:
        print(f"reel: {exc}", file=sys.stderr)
        return 1


def _step(run: Run, args: argparse.Namespace, ranks: int) -> int:
    with _progress(run, first=args.step, last=args.step) as on_step:
        report, analysis = replay_step(run, args.step, on_step)
    _emit(args, report, lambda: report_mod.step_view(report), lambda path: report_mod.plot_step(report, analysis, path))
    if not report.bitwise and ranks == report.recorded_ranks:
        print(f"reel: step {report.step} did not reproduce: {report.mismatch}", file=sys.stderr)
        return 1
    return 0


def main_range(args: argparse.Namespace) -> int:
    first, last = parse_range(args.range)
    run = Run(Path(args.run_dir))
    if args.recompute:
        run.require(first, first)
        ranks = args.ranks or run.commits[first].world_size
        return _on_ranks(run, ranks, ["replay", "range", args.range, "--recompute"], args,
                         lambda: _unrebuilt_exits_1(lambda: _range(run, args, first, last)))
    return _range(run, args, first, last)


def _on_ranks(run: Run, ranks: int, command: list[str], args: argparse.Namespace, lead: Callable[[], int]) -> int:
    """`lead()` on `ranks` processes: here when this process is them, else started again under torchrun."""
    world = distributed.from_env()
    if ranks > 1 and not world.distributed:
        again = [*command, "--run", str(run.run_dir), "--ranks", str(ranks)] + ["--json"] * bool(args.json)
        again += ["--plot", args.plot] if args.plot else []
        return torchrun.relaunch(ranks, again, run.config.trainer.threads or 1)

    def with_group(group: TrainerGroup) -> int:
        run.group = group
        return lead()

    return run_as_group(world, run.run_dir, run.config, with_group)


def _range(run: Run, args: argparse.Namespace, first: int, last: int) -> int:
    if args.recompute:
        with _progress(run, first=first, last=last, analysed=last - first + 1) as on_step:
            rows = replay_range(run, first, last, recompute=True, on_step=on_step)
    else:
        rows = replay_range(run, first, last, recompute=False)
    _emit(args, {"first": first, "last": last, "steps": rows}, lambda: report_mod.range_view(rows),
          lambda path: report_mod.plot_range(rows, path))
    failed = [row for row in rows if row.recomputed is not None and not row.recomputed.bitwise]
    for row in failed:
        print(f"reel: step {row.step} did not reproduce: {row.recomputed.mismatch}", file=sys.stderr)
    return 1 if failed else 0


def main_bisect(args: argparse.Namespace) -> int:
    run = Run(Path(args.run_dir))
    above = args.above is not None
    threshold = args.above if above else args.below
    found = locate(run, args.metric, threshold, above=above, before=args.before, after=args.after)
    with _progress(run, first=found.first, last=found.last, analysed=found.last - found.first + 1) as on_step:
        result = bisect(run, args.metric, threshold, above=above, before=args.before, after=args.after,
                        on_step=on_step)
    _emit(args, result, lambda: debug_views.bisect_view(result), lambda path: debug_views.plot_bisect(result, path))
    return 0 if result.first_crossing is not None else 1


def main_compare(args: argparse.Namespace) -> int:
    for run_dir in (args.run_a, args.run_b):
        load_run_config(Path(run_dir))  # one sentence when it is not a run directory
    result = compare(Path(args.run_a), Path(args.run_b))
    _emit(args, result, lambda: debug_views.compare_view(result), lambda path: debug_views.plot_compare(result, path))
    return 0


def _emit(args: argparse.Namespace, result: object, view: Callable[[], object], plot: Callable[[Path], None]) -> None:
    """JSON (--json) or the table, then the PNG when --plot names one."""
    if args.json:
        print_json(result)
    else:
        print_view(view())
    if args.plot:
        plot(Path(args.plot))


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
