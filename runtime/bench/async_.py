"""`reel bench async`: the same run at async_level 0 (synchronous) and 2, on an agentic-shaped workload.

The workload has a long-tail completion-length distribution (env.long_tail: a few prompts ask for
answers that take the whole max_tokens), so a synchronous step waits for its slowest sample while
the engine runs nearly empty and the trainer idles. Both runs use the same config, seed, machine
and number of steps, one after the other in this process; the warm-start is shared (cached).

Pinning: the trainer gets the first half of this process's cores and the rollout side (workers,
archiver, the embedded Redis, this process watching them) the rest, with os.sched_setaffinity,
the same in both modes; unpinned, both sides compete for the same cores and overlapping them
cannot save time, so the bench would measure the scheduler, not the pipeline. With one core there is nothing to split (`pinned` says so).

Prints one JSON line: wall time, trainer idle share, rollout idle share and final reward of each;
ratio = achieved speedup = sync wall / async wall; ideal = sync wall / max(rollout busy, trainer
busy) of the sync run (what perfect overlap would give); efficiency = ratio / ideal; each mode's
trainer CPU seconds per trained token and its phase totals (StepTiming: wait, compute and, within
it, score_old, forward_backward, optimizer; publish; commit), with cpu_per_token_ratio = async / sync
(an async step should cost the trainer no more per token than a sync one); and
`simulated_dedicated`, the speedup `reel simulate --dedicated` predicts for async_level 2 from the
sync run's log alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from reel.bus.events import StepCommitted, StepTiming, WorkerStats
from reel.bus.jsonout import print_json
from reel.bus.log import RunLog
from reel.runtime.config import run as config_mod
from reel.runtime.config.sections import Config
from reel.runtime.launch.run_dir import bus_for, prepare_run_dir
from reel.runtime.launch.supervisor import Supervisor

# The agentic shape: mostly 3..6-character answers, 20% of prompts answering with max_tokens.
WORKLOAD = {
    "run": {"name": "run", "seed": 0, "steps": 40},
    "model": {"hidden_size": 64, "num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2},
    "init": {"warmup_steps": 300, "warmup_noise": 0.4},
    "env": {"name": "reverse_text", "min_len": 3, "max_len": 6, "long_tail": 0.2},
    "rollout": {"workers": 1, "concurrency": 24, "group_size": 8, "max_tokens": 48},
    "trainer": {"batch_groups": 8, "lr": 1e-3, "max_off_policy_steps": 2, "checkpoint_every": 1000,
                "micro_batch_tokens": 1024},
}


def run(args: argparse.Namespace) -> int:
    raw = json.loads(json.dumps(WORKLOAD))
    if args.quick:
        raw["run"]["steps"] = 8
    results = {}
    with tempfile.TemporaryDirectory(prefix="reel-bench-async-") as tmp:
        for level in (0, 2):
            raw["rollout"]["async_level"] = level
            config = config_mod.from_dict(raw, source="bench async workload")
            results[level] = _measure(Path(tmp) / f"async{level}", config)
            if level == 0:
                predicted = _simulated_dedicated(Path(tmp) / "async0", async_level=2)
    sync, overlapped = results[0], results[2]
    ratio = sync["wall_s"] / overlapped["wall_s"]
    ideal = sync["wall_s"] / max(sync["rollout_busy_s"], sync["trainer_busy_s"])
    print_json({
        "bench": "async", "steps": raw["run"]["steps"], "pinned": _pinning_note(), "sync": sync, "async": overlapped,
        "ideal": round(ideal, 3), "efficiency": round(ratio / ideal, 3),
        "simulated_dedicated": round(sync["wall_s"] / predicted, 3) if predicted else None,
        "cpu_per_token_ratio": round(overlapped["trainer_cpu_s_per_token"] / sync["trainer_cpu_s_per_token"], 3),
        "ratio": round(ratio, 3),
    })
    return 0


def role_cores() -> tuple[set[int], set[int]] | None:
    """(trainer cores, rollout-side cores): this process's cores split in two; None with one core."""
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
    child inherits the affinity of the process that forks it, threads included."""

    def _start(self, name: str, role: str, *extra: str, **kw: object) -> None:
        with forking_on(0 if role == "trainer" else 1):
            super()._start(name, role, *extra, **kw)


def _pinning_note() -> str:
    split = role_cores()
    if split is None:
        return "no: one core, nothing to split"
    return f"trainer on cores {sorted(split[0])}, rollout side (workers, archiver, Redis) on {sorted(split[1])}"


def _simulated_dedicated(run_dir: Path, async_level: int) -> float | None:
    """Wall seconds `reel simulate --dedicated --async-level N` predicts from this run's log (None if
    the log cannot be calibrated: the simulator's sentence goes to stderr). Run as the command a
    user would type: runtime/ reaches replay/ by command, not by import."""
    argv = [sys.executable, "-m", "reel.runtime.launch.cli", "simulate", "--run", str(run_dir), "--dedicated",
            "--async-level", str(async_level), "--json"]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"bench async: no simulator prediction: {done.stderr.strip()}", file=sys.stderr)
        return None
    return float(json.loads(done.stdout)["rows"][0]["result"]["wall_s"])


def _measure(run_dir: Path, config: Config) -> dict[str, float]:
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
    wall = sum(s.timing.wait + s.timing.compute + s.timing.publish for s in timed)
    waited = sum(s.timing.wait for s in timed)
    rollout_idle = sum(s.idle_share for s in stats) / len(stats) if stats else None
    return {
        "async_level": config.rollout.async_level,
        "wall_s": round(wall, 3),
        "trainer_idle": round(waited / wall, 3),
        "rollout_idle": round(rollout_idle, 3) if rollout_idle is not None else None,
        "trainer_busy_s": round(wall - waited, 3),  # compute + publish
        # CPU seconds of the trainer's compute: more per token in asynchronous mode is work the step
        # does only there (the mismatch split scores the batch again per older version), not cores.
        "trainer_cpu_s": round(sum(s.cpu_s for s in timed), 3),
        "rollout_busy_s": round(wall * (1 - rollout_idle), 3) if rollout_idle is not None else wall,
        "worker_stats": len(stats),
        "reward_first": round(steps[0].metrics.get("reward_mean", float("nan")), 3),
        "reward_last": round(steps[-1].metrics.get("reward_mean", float("nan")), 3),
        "tokens_per_step": round(sum(s.metrics.get("tokens", 0) for s in steps) / len(steps), 1),
        **_trainer_costs(timed),
    }


def _trainer_costs(timed: list[StepCommitted]) -> dict:
    """Trainer CPU seconds per trained token and wall seconds per phase, over the timed steps."""
    tokens = sum(s.metrics.get("tokens", 0) for s in timed)
    return {"trainer_cpu_s_per_token": round(sum(s.cpu_s for s in timed) / max(tokens, 1), 9),
            "trainer_phases_s": {phase: round(sum(getattr(s.timing, phase) for s in timed), 3)
                                 for phase in StepTiming.__struct_fields__}}


def _ms(entry_id: str) -> int:
    return int(entry_id.split("-")[0])
