"""`reel bench async`: the same run at async_level 0 (synchronous) and 2, on an agentic workload.

The default workload (`--workload slow-tool`, examples/slow_calc.toml's run) is multi-turn: the
model calls a calculator whose every call waits a seeded heavy-tailed wall time (median 50 ms,
capped at 2 s, no CPU), so a synchronous step waits for its slowest episode's chain of calls while
the engine and the trainer idle. `--workload long-tail` is the earlier one: one-turn answers with
a long-tail length distribution (env.long_tail: a few prompts ask for the whole max_tokens). Both
runs use the same config, seed, machine and number of steps, one after the other in this process;
the warm-start is shared (cached); `--steps N` sets their length. `--repeats N` runs N such pairs
in turn (sync, async, sync, ...) and reports medians (`summarize`): on a shared machine one pair
is one draw of its load.

Pinning: the trainer gets the first half of this process's cores and the rollout side (workers,
archiver, the embedded Redis, this process watching them) the rest, with os.sched_setaffinity,
the same in both modes (the mismatch role, at the lowest CPU priority, may run on any of them); unpinned, both sides compete for the same cores and overlapping them
cannot save time, so the bench would measure the scheduler, not the pipeline. With one core there is nothing to split (`pinned` says so).

Prints one JSON line: wall time, trainer idle share, rollout idle share, where the rollout
worker's time went (engine busy, tool wait, idle: WorkerStats) and the reward of each;
ratio = achieved speedup = sync wall / async wall; ideal = sync wall / max(rollout engine busy,
trainer busy) of the sync run (what perfect overlap would give: tool waits are latency, which
other rounds' decoding can fill); efficiency = ratio / ideal; time_to_reward = the sync run's wall
time to first reach the reward target over the async run's (reward_to_reward below); each mode's
trainer CPU seconds per trained token and its phase totals (StepTiming: wait, compute and, within
it, score_old, forward_backward, optimizer; publish; commit), with cpu_per_token_ratio = async / sync
(an async step should cost the trainer no more per token than a sync one), and the share of a core
it got while computing (trainer_core_share: whether the machine gave both runs the same);
`simulated` and `simulated_dedicated`, the async wall and speedup `reel simulate` predicts for
async_level 2 from the sync run's log alone (on this machine's shared cores, and on dedicated
ones), with `simulated_error`, the prediction's error against the measured async wall.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from reel.bus.events import StepCommitted, StepTiming, WorkerStats
from reel.bus.jsonout import print_json
from reel.bus.run_log import RunLog
from reel.runtime.config import run as config_mod
from reel.runtime.config.sections import Config, MismatchSection
from reel.runtime.launch.run_dir import bus_for, prepare_run_dir
from reel.runtime.launch.supervisor import Supervisor

# Multi-turn tool calls with a heavy-tailed wall time: examples/slow_calc.toml's run (same model,
# warm-start, env and rollout, so the warm-start cache is shared), 40 steps.
SLOW_TOOL = {
    "run": {"name": "run", "seed": 0, "steps": 40},
    "model": {"hidden_size": 64, "moe_intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2},
    "init": {"warmup_steps": 500, "warmup_noise": 0.1},
    "env": {"name": "slow_calc", "options": {"min_terms": 2, "max_terms": 6, "terms_per_call": 3, "max_value": 99,
                                             "tool_median_s": 0.05, "tool_sigma": 1.25, "tool_max_s": 2.0,
                                             "tool_seed": 0}},
    "rollout": {"workers": 1, "concurrency": 24, "group_size": 8, "max_tokens": 20, "tool_concurrency": 256,
                "tool_timeout_s": 10.0},
    "trainer": {"objective": "tis", "lr": 5e-4, "batch_groups": 8, "max_off_policy_steps": 2, "router_replay": True,
                "precision": "fp32", "checkpoint_every": 1000},
}
# The long-tail shape: mostly 3..6-character answers, 20% of prompts answering with max_tokens.
LONG_TAIL = {
    "run": {"name": "run", "seed": 0, "steps": 40},
    "model": {"hidden_size": 64, "num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2},
    "init": {"warmup_steps": 300, "warmup_noise": 0.4},
    "env": {"name": "reverse_text", "min_len": 3, "max_len": 6, "long_tail": 0.2},
    "rollout": {"workers": 1, "concurrency": 24, "group_size": 8, "max_tokens": 48},
    "trainer": {"batch_groups": 8, "lr": 1e-3, "max_off_policy_steps": 2, "checkpoint_every": 1000,
                "micro_batch_tokens": 1024},
}


WORKLOADS = {"slow-tool": SLOW_TOOL, "long-tail": LONG_TAIL}
REWARD_WINDOW = 5  # steps in the running mean that time_to_reward follows
REWARD_SHARE = 0.8  # the target: this share of the way from the start to the lower of the two runs' best


def run(args: argparse.Namespace) -> int:
    workload = getattr(args, "workload", "slow-tool")
    repeats = getattr(args, "repeats", 1)
    if repeats < 1:
        raise SystemExit(f"bench async: --repeats {repeats} runs nothing; pass 1 or more pairs")
    raw = json.loads(json.dumps(WORKLOADS[workload]))
    steps = getattr(args, "steps", None) or (8 if args.quick else None)
    if steps is not None and steps < 2:
        raise SystemExit(f"bench async: --steps {steps} leaves no step to time after the first; pass 2 or more")
    if steps is not None:
        raw["run"]["steps"] = steps
    with _runs_dir(getattr(args, "keep", None), repeats) as tmp:
        pairs = [_pair(raw, Path(tmp), i) for i in range(repeats)]
    print_json({"bench": "async", "workload": workload, "steps": raw["run"]["steps"], "pinned": _pinning_note(),
                **summarize(pairs)})
    return 0


def _pair(raw: dict, runs: Path, index: int) -> dict:
    """One synchronous run, its log's prediction of the asynchronous one, then that run: their figures."""
    results, curves, predicted = {}, {}, {}
    for level in (0, 2):
        raw["rollout"]["async_level"] = level
        config = config_mod.from_dict(raw, source="bench async workload")
        run_dir = runs / _run_name(level, index)
        results[level], curves[level] = _measure(run_dir, config)
        if level == 0:
            predicted = {dedicated: _simulated(run_dir, 2, dedicated) for dedicated in (False, True)}
    sync, overlapped = results[0], results[2]
    ratio = sync["wall_s"] / overlapped["wall_s"]
    ideal = sync["wall_s"] / max(sync["rollout_busy_s"], sync["trainer_busy_s"])
    target, reached = reward_target(curves[0], curves[2])
    return {
        "sync": sync, "async": overlapped, "ideal": ideal, "reward_target": target,
        "time_to_reward_s": {"sync": reached[0], "async": reached[1]},
        "time_to_reward": reached[0] / reached[1] if None not in reached and reached[1] > 0 else None,
        "simulated": predicted[False],
        "simulated_dedicated": sync["wall_s"] / predicted[True] if predicted[True] else None,
        "cpu_per_token_ratio": overlapped["trainer_cpu_s_per_token"] / sync["trainer_cpu_s_per_token"],
        "ratio": ratio,
    }


def summarize(pairs: list[dict]) -> dict:
    """The figures of one or more pairs (`--repeats N`), rounded for the JSON line.

    Each mode's wall is the median over the pairs, and ratio = median sync wall / median async wall;
    `simulated` is the median of the N predictions (one per synchronous log) and simulated_error its
    error against the median measured async wall: this shared machine moves a single run's wall by
    more than the 15% the simulator is held to (docs/simulator.md), so one pair compares one draw of
    the machine with another. Every other figure is the median of the pairs' own; `sync` and `async`
    are the runs of median wall (the lower middle one for even N). With N > 1, `repeats` lists each
    pair's walls, ratio, prediction and error and the trainer's core share in both modes, and
    `async_wall_spread` is the slowest asynchronous wall over the fastest, minus 1."""
    sync_wall = statistics.median(p["sync"]["wall_s"] for p in pairs)
    async_wall = statistics.median(p["async"]["wall_s"] for p in pairs)
    ratio = sync_wall / async_wall
    ideal = _median(p["ideal"] for p in pairs)
    simulated = _median(p["simulated"] for p in pairs)
    figures = {
        "sync": _median_run([p["sync"] for p in pairs]), "async": _median_run([p["async"] for p in pairs]),
        "ideal": _round(ideal), "efficiency": _round(ratio / ideal),
        "reward_target": _round(_median(p["reward_target"] for p in pairs)),
        "time_to_reward_s": {mode: _round(_median(p["time_to_reward_s"][mode] for p in pairs))
                             for mode in ("sync", "async")},
        "time_to_reward": _round(_median(p["time_to_reward"] for p in pairs)),
        "simulated": _round(simulated),
        "simulated_error": _round(simulated / async_wall - 1) if simulated else None,
        "simulated_dedicated": _round(_median(p["simulated_dedicated"] for p in pairs)),
        "cpu_per_token_ratio": _round(_median(p["cpu_per_token_ratio"] for p in pairs)),
        "ratio": _round(ratio),
    }
    if len(pairs) > 1:
        walls = [p["async"]["wall_s"] for p in pairs]
        figures["async_wall_spread"] = _round(max(walls) / min(walls) - 1)
        figures["repeats"] = [{
            "sync_wall_s": p["sync"]["wall_s"], "async_wall_s": p["async"]["wall_s"], "ratio": _round(p["ratio"]),
            "simulated": _round(p["simulated"]),
            "simulated_error": _round(p["simulated"] / p["async"]["wall_s"] - 1) if p["simulated"] else None,
            "trainer_core_share": [p["sync"]["trainer_core_share"], p["async"]["trainer_core_share"]],
        } for p in pairs]
    return figures


def _median(values: Iterable[float | None]) -> float | None:
    """The median of the values there are (a pair without a prediction or a reward reached has None)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _median_run(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda r: r["wall_s"])[(len(runs) - 1) // 2]


def _round(value: float | None) -> float | None:
    return round(value, 3) if value is not None else None


def _run_name(level: int, index: int) -> str:
    """async0 and async2 for the first pair, async0-2 and async2-2 for the second, and so on."""
    return f"async{level}" + (f"-{index + 1}" if index else "")


@contextlib.contextmanager
def _runs_dir(keep: str | None, repeats: int) -> Iterator[str]:
    """Where the runs go: `--keep DIR` (refused if it holds any of them already), else a temporary directory."""
    if keep is None:
        with tempfile.TemporaryDirectory(prefix="reel-bench-async-") as tmp:
            yield tmp
        return
    names = [_run_name(level, i) for i in range(repeats) for level in (0, 2)]
    taken = [name for name in names if (Path(keep) / name).exists()]
    if taken:
        raise SystemExit(f"bench async: --keep {keep} already holds {', '.join(taken)}; pass an empty or new directory")
    Path(keep).mkdir(parents=True, exist_ok=True)
    yield keep


def reward_target(sync: list[tuple[float, float]], overlapped: list[tuple[float, float]]
                  ) -> tuple[float, tuple[float | None, float | None]]:
    """The reward both runs should reach, and the wall seconds (from the first commit) each first does.

    Curves are (seconds since the first commit, step reward) per step from step 2; each is smoothed
    by a running mean of REWARD_WINDOW steps. The target lies REWARD_SHARE of the way from the lower
    start to the lower best, so both runs reach it and neither's noise at its very best decides."""
    smooth = [_running_mean(curve) for curve in (sync, overlapped)]
    start = min(curve[0][1] for curve in smooth)
    best = min(max(r for _, r in curve) for curve in smooth)
    target = start + REWARD_SHARE * (best - start)
    reached = tuple(next((round(t, 3) for t, r in curve if r >= target), None) for curve in smooth)
    return target, reached


def _running_mean(curve: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out = []
    for i, (t, _) in enumerate(curve):
        window = [r for _, r in curve[max(0, i - REWARD_WINDOW + 1):i + 1]]
        out.append((t, sum(window) / len(window)))
    return out


@functools.cache
def role_cores() -> tuple[set[int], set[int]] | None:
    """(trainer cores, rollout-side cores): this process's cores split in two; None with one core.

    Read once, before any pinning: inside `forking_on(1)` (the embedded Redis and the watching process
    run on the rollout side) this process's own affinity is the rollout side alone, and a split read
    there found one core and pinned nothing, so the trainer shared the rollout side's core."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    half = len(cores) // 2
    return set(cores[:half]), set(cores[half:])


@contextlib.contextmanager
def forking_on(side: int) -> Iterator[None]:
    """Processes started inside inherit the cores of `side` (0 trainer, 1 rollout side); this
    process's own affinity is back as it was after. No-op with one core."""
    split = role_cores()
    if split is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, split[side])
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


class PinnedSupervisor(Supervisor):
    """Starts the trainer on the trainer cores and every other role on the rollout-side cores: a
    child inherits the affinity of the process that forks it, threads included.

    The mismatch role (lowest CPU priority, mismatch.nice) stays on the rollout side, so the trainer's
    cores are the trainer's alone and its busy time, the denominator of `ideal`, is its own. Measured
    2026-12-05 (docs/benchmarks.md): async wall 13.8 s there, 13.3 s with the role on any core (a sync
    trainer sharing its core with it may spend more CPU per token, which would flatter `ideal`), 15.4 s
    on the trainer's core."""

    def _start(self, name: str, role: str, *extra: str, **kw: object) -> None:
        with forking_on(0 if role == "trainer" else 1):
            super()._start(name, role, *extra, **kw)


def _pinning_note() -> str:
    split = role_cores()
    if split is None:
        return "no: one core, nothing to split"
    return (f"trainer on cores {sorted(split[0])}, rollout side (workers, archiver, Redis, mismatch role at "
            f"nice {MismatchSection().nice}) on {sorted(split[1])}")


def _simulated(run_dir: Path, async_level: int, dedicated: bool) -> float | None:
    """Wall seconds `reel simulate [--dedicated] --async-level N` predicts from this run's log (None if
    the log cannot be calibrated: the simulator's sentence goes to stderr). Run as the command a
    user would type: runtime/ reaches replay/ by command, not by import."""
    argv = [sys.executable, "-m", "reel.runtime.launch.cli", "simulate", "--run", str(run_dir),
            *(["--dedicated"] if dedicated else []), "--async-level", str(async_level), "--json"]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"bench async: no simulator prediction: {done.stderr.strip()}", file=sys.stderr)
        return None
    return float(json.loads(done.stdout)["rows"][0]["result"]["wall_s"])


def _measure(run_dir: Path, config: Config) -> tuple[dict[str, float], list[tuple[float, float]]]:
    prepare_run_dir(run_dir, config_mod.to_toml(config), config, resume=False)
    with contextlib.redirect_stdout(sys.stderr):  # progress lines must not mix with the JSON line
        with forking_on(1), bus_for(run_dir, config) as url:  # Redis serves the rollout side: its cores
            supervisor = PinnedSupervisor(run_dir, url, config, live=False)
            code = supervisor.run()
    if code != 0:
        raise RuntimeError(f"bench run at async_level {config.rollout.async_level} failed; see {run_dir}/roles")
    with RunLog(run_dir, readonly=True) as log:
        commits = [(i, e) for i, e in log.events("steps") if isinstance(e, StepCommitted)]
        stats = [(i, e) for i, e in log.events("control") if isinstance(e, WorkerStats)]
    # Wall time of the RL loop from the first commit to the last, by the trainer's own step
    # timings: step 1 also waits for the processes to start and is left out of both runs, and so
    # are worker stats from before it (entry ids start with their Redis millisecond timestamp).
    steps = [e for _, e in commits]
    timed = steps[1:]
    first_commit_ms = _ms(commits[0][0])
    stats = [e for i, e in stats if _ms(i) > first_commit_ms]
    seconds = list(itertools.accumulate(s.timing.wait + s.timing.compute + s.timing.publish for s in timed))
    wall = seconds[-1]
    waited = sum(s.timing.wait for s in timed)
    rollout_idle = sum(s.idle_share for s in stats) / len(stats) if stats else None
    split = _worker_split(stats)
    return {
        "async_level": config.rollout.async_level,
        "wall_s": round(wall, 3),
        "trainer_idle": round(waited / wall, 3),
        "rollout_idle": round(rollout_idle, 3) if rollout_idle is not None else None,
        "trainer_busy_s": round(wall - waited, 3),  # compute + publish
        # CPU seconds of the trainer's compute: per token, an asynchronous step should cost what a
        # synchronous one does (nothing async-only on the step: the mismatch split is its own role).
        "trainer_cpu_s": round(sum(s.cpu_s for s in timed), 3),
        # The engine's share of the worker's time (decoding), over this window: what no overlap can hide.
        "rollout_busy_s": round(wall * split["busy"], 3) if split else wall,
        "rollout_split": {k: round(v, 3) for k, v in split.items()} if split else None,  # busy, tool_wait, idle
        "worker_stats": len(stats),
        "reward_first": round(steps[0].metrics.get("reward_mean", float("nan")), 3),
        "reward_last": round(steps[-1].metrics.get("reward_mean", float("nan")), 3),
        "tokens_per_step": round(sum(s.metrics.get("tokens", 0) for s in steps) / len(steps), 1),
        **_trainer_costs(timed),
    }, [(t, s.metrics.get("reward_mean", 0.0)) for t, s in zip(seconds, timed)]


def _worker_split(stats: list[WorkerStats]) -> dict[str, float] | None:
    """Shares of the workers' wall time between each one's first and last stats in the window: engine
    busy, tool wait, idle (WorkerStats since 2026-12-05; None before, or with too few)."""
    parts = {"busy": 0.0, "tool_wait": 0.0, "idle": 0.0}
    for worker in {e.worker for e in stats}:
        mine = [e for e in stats if e.worker == worker]
        first, last = mine[0], mine[-1]
        if not last.tool_wait_s + last.idle_s:
            return None
        parts["busy"] += last.busy_s - first.busy_s
        parts["tool_wait"] += last.tool_wait_s - first.tool_wait_s
        parts["idle"] += last.idle_s - first.idle_s
    total = sum(parts.values())
    return {k: v / total for k, v in parts.items()} if total > 0 else None


def _trainer_costs(timed: list[StepCommitted]) -> dict:
    """Trainer CPU seconds per trained token, the cores it got while computing, and wall seconds per
    phase, over the timed steps.

    trainer_core_share = CPU seconds / wall seconds of compute (at most trainer.threads, 1 in both
    workloads). Pinned, the trainer's core is its own; a share well below the other mode's means the
    machine's other tenants (or the hypervisor) took part of that core in one run only, and the pair
    compares the machine, not the pipeline (2026-12-05, a long-tail pair: 0.76 sync, 0.61 async;
    docs/simulator.md)."""
    tokens = sum(s.metrics.get("tokens", 0) for s in timed)
    cpu, computing = sum(s.cpu_s for s in timed), sum(s.timing.compute for s in timed)
    return {"trainer_cpu_s_per_token": round(cpu / max(tokens, 1), 9),
            "trainer_core_share": round(cpu / computing, 3) if computing > 0 else None,
            "trainer_phases_s": {phase: round(sum(getattr(s.timing, phase) for s in timed), 3)
                                 for phase in StepTiming.__struct_fields__}}


def _ms(entry_id: str) -> int:
    return int(entry_id.split("-")[0])
