"""Soak: a 1,000-step run of the tiny E2E config, with `reel run` as a user starts it.

While it runs, Redis memory and the archiver's lag are sampled: both must stay flat (a Redis whose
streams are never trimmed, or an archiver that falls further behind, grows with the steps and fails).
The trainer is killed just after committing step 15, and again after step 995, and the run resumed
each time: each resume re-executes 5 steps from a checkpoint before it trains a new one, so the time
from `reel run --resume` to the next step in the log, and the peak RSS of `reel replay step` of the
last logged step at each kill (on a log of ~15 and of ~995 steps), must be within 2x of each other:
neither may grow with the log (one run serves both: with a separate 20-step run the test took 30% longer).
At the end the blob store holds the checkpoints and the retention window's weight versions, nothing else.
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

from reel.bus.run_log import RunLog
from runbuilder import e2e_config

STEPS, EARLY, LATE = 1000, 15, 995  # the run, and the steps after which the trainer is killed
# No mismatch role: the soak bounds the bus, the log and the trainer over 1,000 steps, and counts the steps
# stream's records as commits (its poll must stay cheap); the role has its own whole-run test.
OVERRIDES = {"trainer": {"checkpoint_every": 10, "batch_groups": 2}, "rollout": {"max_tokens": 4, "concurrency": 2},
             "mismatch": {"every": 0}}
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


def _launch(config: Path, run_dir: Path, samples: list[tuple[int, int, int]], *, resume_from: int = 0,
            kill_at: int | None = None) -> float | None:
    """Run (or resume) until the launcher stops, the trainer set to die after committing `kill_at`;
    sample (step on the bus, Redis used_memory, steps not yet logged) every half second once the log
    holds a step after `resume_from`. -> seconds from the start until it did."""
    env = dict(os.environ)
    env.pop("REEL_CRASH_AT", None)
    if kill_at is not None:
        env["REEL_CRASH_AT"] = f"{kill_at}:committed"
    started = time.perf_counter()
    argv = _argv(config, run_dir) + ["--resume"] * bool(resume_from)
    launcher = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first_new: float | None = None
    client = None
    try:
        while launcher.poll() is None:
            time.sleep(0.25 if first_new is None else 0.5)
            logged = _logged_steps(run_dir)
            if first_new is None and logged > resume_from:
                first_new = time.perf_counter() - started
            socket = run_dir / "redis" / "redis.sock"
            if client is None and socket.exists():
                client = redis.Redis(unix_socket_path=str(socket), socket_timeout=5)
            if client is None or first_new is None:
                continue
            try:
                memory = int(client.info("memory")["used_memory"])
                bus = _newest_step(client, config)
            except redis.RedisError:
                continue
            samples.append((bus, memory, max(0, bus - logged)))
        stderr = launcher.communicate(timeout=120)[1]
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if client is not None:
            client.close()
    assert (launcher.returncode != 0) == (kill_at is not None), stderr[-2000:]  # killed: the launcher stops the run
    return first_new


def _newest_step(client: redis.Redis, config: Path) -> int:
    from reel.bus.events import StepCommitted, decode
    from reel.runtime.config.run import load

    name = load(config).run.name
    newest = client.xrevrange(f"reel:{{{name}}}:steps", count=1)
    if not newest:
        return 0
    event = decode(newest[0][1][b"e"])
    return event.step if isinstance(event, StepCommitted) else 0


def _replay_peak_rss(run_dir: Path, step: int) -> int:
    done = subprocess.run([sys.executable, "-c", _PEAK_RSS, "replay", "step", str(step), "--run", str(run_dir),
                           "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and json.loads(done.stdout)["bitwise"], done.stderr[-2000:]
    return int(done.stderr.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(1500)  # 1,000 steps at ~0.2 s and three starts: ~5 min on an idle 2-core machine
def test_a_1000_step_run_stays_bounded_and_resumes_at_step_995_as_fast_as_at_15(tmp_path: Path) -> None:
    config = e2e_config(tmp_path / "soak.toml", "soak", STEPS, OVERRIDES)
    run_dir = tmp_path / "soak"
    samples: list[tuple[int, int, int]] = []
    _launch(config, run_dir, [], kill_at=EARLY)
    replayed = [_logged_steps(run_dir)]  # the archiver may not have logged the last commit when it was stopped
    rss_early = _replay_peak_rss(run_dir, replayed[0])
    resume_early = _launch(config, run_dir, samples, resume_from=EARLY, kill_at=LATE)
    replayed.append(_logged_steps(run_dir))
    rss_late = _replay_peak_rss(run_dir, replayed[1])
    resume_late = _launch(config, run_dir, [], resume_from=LATE)
    du = json.loads(subprocess.run([sys.executable, "-m", "reel.runtime.launch.cli", "log", "du", "--run",
                                    str(run_dir), "--json"], capture_output=True, text=True, check=True).stdout)

    samples = [s for s in samples if s[0] >= 20]  # after the first resume's start-up
    third = len(samples) // 3
    early, late = samples[:third], samples[-third:]
    memory_early, memory_late = max(s[1] for s in early), max(s[1] for s in late)
    lag_early, lag_late = max(s[2] for s in early), max(s[2] for s in late)
    print(f"\nsoak: {len(samples)} samples; Redis used_memory max {memory_early / 1e6:.1f} MB (steps "
          f"{early[0][0]}..{early[-1][0]}) -> {memory_late / 1e6:.1f} MB (steps {late[0][0]}..{late[-1][0]}); "
          f"archiver lag max {lag_early} -> {lag_late} steps; resume to the next commit at {LATE} {resume_late:.1f} s "
          f"vs at {EARLY} {resume_early:.1f} s; replay peak RSS of step {replayed[1]} {rss_late / 1e6:.0f} MB vs step "
          f"{replayed[0]} {rss_early / 1e6:.0f} MB; "
          f"blobs: {du['weight_versions_stored']} weight versions, {du['checkpoints']} checkpoints, "
          f"bytes {du['bytes']}, routing at rest {du['routing_at_rest_ratio']}x")
    assert len(samples) >= 30 and late[-1][0] >= 900 and EARLY - 3 <= replayed[0] and LATE - 3 <= replayed[1]
    assert memory_late <= 1.5 * memory_early, "Redis memory grows with the run (are streams trimmed?)"
    assert lag_late <= max(5, 2 * lag_early), "the archiver falls further behind as the run goes on"
    assert resume_early is not None and resume_late is not None and resume_late <= 2 * resume_early
    assert rss_late <= 2 * rss_early
    assert du["steps"] == STEPS and du["checkpoints"] == STEPS // 10
    assert du["weight_versions_stored"] <= 4 and du["bytes"]["other_blobs"] == 0  # window 3, + the republished
