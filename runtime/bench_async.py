"""`reel bench async`: the same run at async_level 0 (synchronous) and 2, on an agentic-shaped workload.

The workload has a long-tail completion-length distribution (env.long_tail: a few prompts ask for
answers that take the whole max_tokens), so a synchronous step waits for its slowest sample while
the engine runs nearly empty and the trainer idles. Both runs use the same config, seed, machine
and number of steps, one after the other in this process; the warm-start is shared (cached).

Prints one JSON line: wall time, trainer idle share, rollout idle share and final reward of each,
and ratio = sync wall / async wall.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

from reel.bus.events import StepCommitted, WorkerStats
from reel.bus.jsonout import print_json
from reel.bus.log import RunLog
from reel.runtime import config as config_mod
from reel.runtime.config import Config
from reel.runtime.launch.supervisor import Supervisor, bus_for, prepare_run_dir

# The agentic shape: mostly 3..6-character answers, 20% of prompts answering with max_tokens.
WORKLOAD = {
    "run": {"name": "bench_async", "seed": 0, "steps": 40},
    "model": {"hidden_size": 64, "num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2},
    "init": {"warmup_steps": 300, "warmup_noise": 0.4},
    "env": {"name": "reverse_text", "min_len": 3, "max_len": 6, "long_tail": 0.2},
    "rollout": {"workers": 1, "concurrency": 24, "group_size": 8, "max_tokens": 48},
    "trainer": {"batch_groups": 8, "lr": 1e-3, "max_off_policy_steps": 2, "checkpoint_every": 1000,
                "micro_batch_tokens": 1024},
}


def bench_async(args: argparse.Namespace) -> int:
    raw = json.loads(json.dumps(WORKLOAD))
    if args.quick:
        raw["run"]["steps"] = 8
    results = {}
    with tempfile.TemporaryDirectory(prefix="reel-bench-async-") as tmp:
        for level in (0, 2):
            raw["rollout"]["async_level"] = level
            config = config_mod.from_dict(raw, source="bench async workload")
            results[level] = _measure(Path(tmp) / f"async{level}", config)
    sync, overlapped = results[0], results[2]
    print_json({
        "bench": "async", "steps": raw["run"]["steps"], "sync": sync, "async": overlapped,
        "ratio": round(sync["wall_s"] / overlapped["wall_s"], 3),
    })
    return 0


def _measure(run_dir: Path, config: Config) -> dict[str, float]:
    prepare_run_dir(run_dir, config_mod.to_toml(config), config, resume=False)
    with contextlib.redirect_stdout(sys.stderr):  # progress lines must not mix with the JSON line
        with bus_for(run_dir, config) as url:
            supervisor = Supervisor(run_dir, url, config, live=False)
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
    return {
        "async_level": config.rollout.async_level,
        "wall_s": round(wall, 3),
        "trainer_idle": round(waited / wall, 3),
        "rollout_idle": round(sum(s.idle_share for s in stats) / len(stats), 3) if stats else None,
        "worker_stats": len(stats),
        "reward_first": round(steps[0].metrics.get("reward_mean", float("nan")), 3),
        "reward_last": round(steps[-1].metrics.get("reward_mean", float("nan")), 3),
        "tokens_per_step": round(sum(s.metrics.get("tokens", 0) for s in steps) / len(steps), 1),
    }


def _ms(entry_id: str) -> int:
    return int(entry_id.split("-")[0])
