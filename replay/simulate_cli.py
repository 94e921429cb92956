"""`reel simulate --run DIR`: capacity planning from a run's log (replay/workload.py + replay/simulate.py).

The scenario is the run's own configuration with the options applied; with none it is exactly the
logged run, and its measured figures are shown beside the prediction. `--against DIR2` simulates
DIR2's configuration on DIR's measured speeds and compares with what DIR2 measured (how the model
is validated: predict the synchronous run from the asynchronous one's log, and back).
`--sweep KEY=V1,V2,...` runs one scenario per value; several --sweep options run their grid.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import msgspec

from reel.bus.errors import ReelError
from reel.bus.jsonout import print_json
from reel.replay.console import print_view
from reel.replay.rank_efficiency import rank_efficiency
from reel.runtime.config.overrides import parse_sets
from reel.replay.simulate import Scenario, simulate
from reel.replay.simulate_report import Row, caveats, compare, plot, view
from reel.replay.workload import Pipeline, Workload, extract

# --sweep keys -> (Scenario or Pipeline field, value type)
SWEEPABLE = {
    "rollout-workers": ("rollout_workers", int),
    "trainer-ranks": ("trainer_ranks", int),
    "async-level": ("async_level", int),
    "max-off-policy": ("max_off_policy", int),
    "speedup-rollout": ("speedup_rollout", float),
    "speedup-trainer": ("speedup_trainer", float),
    "background": ("background", float),
}


class SweepError(ReelError):
    """A --sweep argument that is not KEY=V1,V2,... with a known key."""


def main(args: argparse.Namespace) -> int:
    set_overrides(args)  # before the work of reading the run
    workload = extract(Path(args.run_dir))
    target = extract(Path(args.against)) if args.against else workload
    base = _scenario(args, target.pipeline)
    if args.sweep:
        axes = [parse_sweep(text) for text in args.sweep]
        rows = []
        for point in itertools.product(*[[(key, v) for v in values] for key, values in axes]):
            scenario = base
            for key, value in point:
                scenario = _with(scenario, key, value)
            rows.append(_row(workload, scenario, " ".join(f"{k}={v}" for k, v in point), None))
    else:
        logged = base.pipeline == target.pipeline and _unchanged(base)
        rows = [_row(workload, base, "as logged" if logged else "scenario", target if logged else None)]
    if args.json:
        print_json({"run": workload.run_dir, "decode": workload.decode, "trainer": workload.trainer,
                    "swap_s": workload.swap_s, "cores": workload.cores, "rank_efficiency": base.rank_efficiency,
                    "rank_efficiency_source": base.rank_efficiency_source, "caveats": caveats(workload, base),
                    "rows": rows})
    else:
        print_view(view(workload, rows))
    if args.plot:
        plot(rows, Path(args.plot))
    return 0


def parse_sweep(text: str) -> tuple[str, list[int | float]]:
    key, sep, values = text.partition("=")
    if not sep or key not in SWEEPABLE or not values:
        raise SweepError(f"--sweep {text!r} must be KEY=V1,V2,... with KEY one of {', '.join(SWEEPABLE)}")
    kind = SWEEPABLE[key][1]
    try:
        return key, [kind(v) for v in values.split(",")]
    except ValueError as exc:
        raise SweepError(f"--sweep {text!r}: every value of {key} must be "
                         f"{'an integer' if kind is int else 'a number'}") from exc


# --set config keys -> the Pipeline field they set (the keys the simulation models)
SETTABLE = {"rollout.workers": "rollout_workers", "trainer.ranks": "trainer_ranks",
            "rollout.async_level": "async_level", "trainer.max_off_policy_steps": "max_off_policy", "run.steps": "steps"}


def set_overrides(args: argparse.Namespace) -> dict[str, int]:
    """The Pipeline fields --set gives; a key the simulation does not model is an error."""
    out = {}
    for section, keys in parse_sets(args.set).items():
        for key, value in keys.items():
            if f"{section}.{key}" not in SETTABLE or not isinstance(value, int) or isinstance(value, bool):
                raise SweepError(f"--set {section}.{key}: simulate models only {', '.join(SETTABLE)} (integers)")
            out[SETTABLE[f"{section}.{key}"]] = value
    return out


def _scenario(args: argparse.Namespace, pipeline: Pipeline) -> Scenario:
    overrides = {name: getattr(args, name) for name in ("rollout_workers", "trainer_ranks", "async_level",
                                                          "max_off_policy", "steps") if getattr(args, name) is not None}
    overrides.update(set_overrides(args))
    efficiency = rank_efficiency(args.rank_efficiency, args.rank_efficiency_from)
    return Scenario(pipeline=msgspec.structs.replace(pipeline, **overrides), speedup_rollout=args.speedup_rollout,
                    speedup_trainer=args.speedup_trainer, rank_efficiency=efficiency.value,
                    rank_efficiency_source=efficiency.source,
                    redis_s_per_event=args.redis_us_per_event * 1e-6, dedicated=args.dedicated, seed=args.seed,
                    repeats=args.repeats,
                    background=args.background)


def _with(base: Scenario, key: str, value: int | float) -> Scenario:
    field = SWEEPABLE[key][0]
    if field in Pipeline.__struct_fields__:
        return msgspec.structs.replace(base, pipeline=msgspec.structs.replace(base.pipeline, **{field: value}))
    return msgspec.structs.replace(base, **{field: value})


def _unchanged(s: Scenario) -> bool:
    return s.speedup_rollout == 1.0 and s.speedup_trainer == 1.0 and not s.dedicated and not s.redis_s_per_event \
        and s.background is None


def _row(workload: Workload, scenario: Scenario, label: str, measured_run: Workload | None) -> Row:
    result = simulate(workload, scenario)
    if measured_run is None:
        return Row(label=label, scenario=scenario, result=result)
    m = measured_run.measured
    return Row(label=label, scenario=scenario, result=result, measured=m, comparison=compare(result, m))
