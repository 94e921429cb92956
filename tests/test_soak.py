"""Soak: a 1,000-step run of the tiny E2E config, with `reel run` as a user starts it.

While it runs, Redis memory and the archiver's lag are sampled: both must stay flat (a Redis whose
streams are never trimmed, or an archiver that falls further behind, grows with the steps and fails).
The trainer is killed just after committing step 995 and the run resumed; so is a 20-step run at
step 15. Both resumes re-execute 5 steps from a checkpoint and train 5 more, so their wall times,
and the peak RSS of `reel replay step` at 995 and at 15, must be within 2x of each other: neither
may grow with the log. At the end the blob store holds the checkpoints and the retention window's
weight versions, nothing else.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from reel.bus.log import RunLog
from runbuilder import e2e_config

OVERRIDES = {"trainer": {"checkpoint_every": 10, "batch_groups": 2}, "rollout": {"max_tokens": 4, "concurrency": 2}}
_PEAK_RSS = """
import sys
from reel.runtime.launch.cli import main
code = main(sys.argv[1:])
print(int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024, file=sys.stderr)
sys.exit(code)
"""


def _argv(config: Path, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "reel.runtime.launch.cli", "run", str(config), "--out", str(run_dir), "--no-live"]


def _logged_steps(run_dir: Path) -> int:
    try:
        with RunLog(run_dir, readonly=True) as log:
            return len(log.stream("steps"))
    except Exception:  # not created yet
        return 0


def _run_until_killed(config: Path, run_dir: Path, kill_at: int, samples: list[tuple[int, int, int]]) -> None:
    """Start the run with the trainer set to die after committing `kill_at`; sample (step on the bus,
    Redis used_memory, steps not yet logged) every half second until the launcher stops."""
    env = {**os.environ, "REEL_CRASH_AT": f"{kill_at}:committed"}
    launcher = subprocess.Popen(_argv(config, run_dir), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
    client = None
    try:
        while launcher.poll() is None:
            time.sleep(0.5)
            socket = run_dir / "redis" / "redis.sock"
            if client is None and socket.exists():
                client = redis.Redis(unix_socket_path=str(socket), socket_timeout=5)
            if client is None:
                continue
            try:
                memory = int(client.info("memory")["used_memory"])
                bus = _newest_step(client, config)
            except redis.RedisError:
                continue
            samples.append((bus, memory, max(0, bus - _logged_steps(run_dir))))
        launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if client is not None:
            client.close()
    assert launcher.returncode != 0  # the trainer died: the launcher stopped the run


def _newest_step(client: redis.Redis, config: Path) -> int:
    from reel.bus.events import StepCommitted, decode
    from reel.runtime.config import load

    name = load(config).run.name
    newest = client.xrevrange(f"reel:{{{name}}}:steps", count=1)
    if not newest:
        return 0
    event = decode(newest[0][1][b"e"])
    return event.step if isinstance(event, StepCommitted) else 0


def _resume_seconds(config: Path, run_dir: Path) -> float:
    started = time.perf_counter()
    resumed = subprocess.run(_argv(config, run_dir) + ["--resume"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    return time.perf_counter() - started


def _replay_peak_rss(run_dir: Path, step: int) -> int:
    done = subprocess.run([sys.executable, "-c", _PEAK_RSS, "replay", "step", str(step), "--run", str(run_dir),
                           "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and json.loads(done.stdout)["bitwise"], done.stderr[-2000:]
    return int(done.stderr.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(1500)  # 1,000 steps at ~0.2 s: ~5 min on an idle 2-core machine, much longer on a busy one
def test_a_1000_step_run_stays_bounded_and_resumes_at_step_995_as_fast_as_at_15(tmp_path: Path) -> None:
    figures = {}
    for name, steps, kill_at in (("short", 20, 15), ("soak", 1000, 995)):
        config = e2e_config(tmp_path / f"{name}.toml", name, steps, OVERRIDES)
        run_dir = tmp_path / name
        samples: list[tuple[int, int, int]] = []
        _run_until_killed(config, run_dir, kill_at, samples)
        resume_s = _resume_seconds(config, run_dir)
        rss = _replay_peak_rss(run_dir, kill_at)
        du = subprocess.run([sys.executable, "-m", "reel.runtime.launch.cli", "log", "du", "--run", str(run_dir),
                             "--json"], capture_output=True, text=True, check=True)
        figures[name] = {"samples": samples, "resume_s": resume_s, "replay_rss": rss, "du": json.loads(du.stdout)}

    soak, short = figures["soak"], figures["short"]
    samples = [s for s in soak["samples"] if s[0] >= 20]  # after start-up
    third = len(samples) // 3
    early, late = samples[:third], samples[-third:]
    memory_early, memory_late = max(s[1] for s in early), max(s[1] for s in late)
    lag_early, lag_late = max(s[2] for s in early), max(s[2] for s in late)
    du = soak["du"]
    print(f"\nsoak: {len(samples)} samples; Redis used_memory max {memory_early / 1e6:.1f} MB (steps "
          f"{early[0][0]}..{early[-1][0]}) -> {memory_late / 1e6:.1f} MB (steps {late[0][0]}..{late[-1][0]}); "
          f"archiver lag max {lag_early} -> {lag_late} steps; resume at 995 {soak['resume_s']:.1f} s vs at 15 "
          f"{short['resume_s']:.1f} s; replay peak RSS {soak['replay_rss'] / 1e6:.0f} MB vs "
          f"{short['replay_rss'] / 1e6:.0f} MB; blobs: {du['weight_versions_stored']} weight versions, "
          f"{du['checkpoints']} checkpoints, bytes {du['bytes']}")
    assert len(samples) >= 30 and late[-1][0] >= 900
    assert memory_late <= 1.5 * memory_early, "Redis memory grows with the run (are streams trimmed?)"
    assert lag_late <= max(5, 2 * lag_early), "the archiver falls further behind as the run goes on"
    assert soak["resume_s"] <= 2 * short["resume_s"]
    assert soak["replay_rss"] <= 2 * short["replay_rss"]
    assert du["steps"] == 1000 and du["checkpoints"] == 100
    assert du["weight_versions_stored"] <= 4 and du["bytes"]["other_blobs"] == 0  # window 3, + the republished
    assert du["bytes"]["weight_versions"] <= 4 * short["du"]["bytes"]["weight_versions"]
