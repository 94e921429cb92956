"""Chaos, bounded in time, against local processes: a `reel run` whose roles are SIGKILLed at random
points, whose Redis is SIGKILLed and restarted from an AOF that lost its last second, and whose
streams are fed entries that are not events. After each fault it is resumed; at the end the run is
complete, the log verifies, no group is trained twice, no (producer, seq) repeats, every bad entry
is dead-lettered with its reason, and the loss window was reported (a line and a commit metric)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
import redis

from reel.bus.events import STREAMS, StepCommitted, Trajectory, stream_key
from reel.bus.run_log import RunLog
from reel.bus.server import EmbeddedRedis
from reel.bus.streams import DEAD
from runbuilder import TINY_MODEL_TOML
from reel.runtime.launch.cli import main

pytestmark = pytest.mark.slow

STEPS = 40  # every fault lands by a commit count (below), so steps are left for each phase at any speed
CONFIG = """
[run]
name = "chaos"
steps = {steps}
{model}[init]
warmup_steps = 0
[rollout]
concurrency = 4
group_size = 3
async_level = 1
max_tokens = 5
[trainer]
batch_groups = 4
checkpoint_every = 2
max_off_policy_steps = 2
"""
PHASE_TIMEOUT_S = 240
# Redis is killed within this (and a random 0.3 s) of an entry's write that the log already holds,
# so the AOF's lost last second holds something the archiver logged.
FRESH_S = 0.4


def _logged_commits(run_dir: Path) -> list[tuple[str, StepCommitted]]:
    """(entry id, commit) of the steps the log holds."""
    if not (run_dir / "log" / "steps").is_dir():
        return []
    with RunLog(run_dir, readonly=True) as log:
        return [(i, e) for i, e in log.events("steps") if isinstance(e, StepCommitted)]


def _commits(run_dir: Path) -> list[StepCommitted]:
    return [e for _, e in _logged_commits(run_dir)]


def _entry_s(entry_id: str) -> float:
    """When Redis took an entry (its id starts with Redis's clock in ms), in time.time()'s seconds."""
    return int(entry_id.split("-")[0]) / 1000


class Launch:
    """`reel run` (or --resume) as a child process."""

    def __init__(self, config: Path, run_dir: Path, resume: bool):
        argv = [sys.executable, "-m", "reel.runtime.launch.cli", "run", str(config), "--out", str(run_dir), "--no-live"]
        self.proc = subprocess.Popen(argv + (["--resume"] if resume else []), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.output = ""

    def wait_for_commits(self, run_dir: Path, at_least: int) -> None:
        deadline = time.monotonic() + PHASE_TIMEOUT_S
        while len(_commits(run_dir)) < at_least:
            assert self.proc.poll() is None, self.finish()
            assert time.monotonic() < deadline, f"no step {at_least} within {PHASE_TIMEOUT_S} s\n" + _role_logs(run_dir)
            time.sleep(0.2)

    def wait_for_fresh_commit(self, run_dir: Path) -> None:
        """Until the log holds a commit Redis took under FRESH_S ago: the archiver has caught up, as a
        restarted one has not while it logs its backlog."""
        deadline = time.monotonic() + PHASE_TIMEOUT_S
        while not (logged := _logged_commits(run_dir)) or time.time() - _entry_s(logged[-1][0]) > FRESH_S:
            assert self.proc.poll() is None, self.finish()
            assert time.monotonic() < deadline, f"no commit logged {FRESH_S} s after its write\n" + _role_logs(run_dir)
            time.sleep(0.05)

    def finish(self) -> str:
        self.output += self.proc.communicate(timeout=PHASE_TIMEOUT_S)[0]
        return self.output


def _role_logs(run_dir: Path, lines: int = 15) -> str:
    return "\n".join(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
                     for log in sorted((run_dir / "roles").glob("*.log")))


class AofWatch:
    """Sizes of the embedded Redis's append-only file over time, to cut off its last second."""

    def __init__(self, run_dir: Path):
        self.dir = run_dir / "redis"
        self.sizes: list[tuple[float, Path, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            files = sorted(self.dir.rglob("*.aof"), key=lambda p: p.stat().st_mtime)
            if files:
                self.sizes.append((time.monotonic(), files[-1], files[-1].stat().st_size))
            time.sleep(0.05)

    def lose_last_second(self, killed_at: float) -> int:
        """Truncate the AOF to its size one second before the kill; bytes cut off."""
        self._stop.set()
        self._thread.join()
        before = [(path, size) for t, path, size in self.sizes if t <= killed_at - 1.0]
        path, size = before[-1]
        cut = path.stat().st_size - size
        os.truncate(path, size)
        return cut


def _inject_bad_entries(url: str) -> dict[str, list[str]]:
    """On each stream: not msgpack, an unknown (newer) tag, an oversized entry, no `e` field."""
    client = redis.Redis.from_url(url)
    future = msgspec.msgpack.encode({"type": "from_a_newer_reel", "run": "chaos", "producer": "x:0", "seq": 0})
    ids = {}
    for stream in STREAMS:
        key = stream_key("chaos", stream)
        ids[stream] = [client.xadd(key, fields).decode() for fields in (
            {"e": b"\xc1 not msgpack"}, {"e": future}, {"e": os.urandom(1 << 20)}, {"x": b"no e field"})]
    client.close()
    return ids


def _kill_role(run_dir: Path, role: str, rng: random.Random) -> None:
    # A random point of whatever the role is doing, within about a step even on an idle machine
    # (0.1 s a step), so a fault never waits for the run to end.
    time.sleep(rng.uniform(0.0, 0.3))
    os.kill(int((run_dir / "roles" / f"{role}.pid").read_text()), signal.SIGKILL)


def test_run_survives_killed_roles_a_killed_redis_and_hostile_entries(tmp_path: Path) -> None:
    seed = int(os.environ.get("REEL_CHAOS_SEED", random.randrange(1 << 16)))
    rng = random.Random(seed)
    print(f"chaos seed {seed} (REEL_CHAOS_SEED={seed} reproduces the choices)")
    config = tmp_path / "chaos.toml"
    config.write_text(CONFIG.format(steps=STEPS, model=TINY_MODEL_TOML))
    run_dir = tmp_path / "run"
    first_victim, second_victim = rng.sample(["trainer", "archiver", "rollout-0"], 2)

    # 1. hostile entries on every stream of the live run, then a role SIGKILLed at a random point
    launch = Launch(config, run_dir, resume=False)
    launch.wait_for_commits(run_dir, 1)
    bad = _inject_bad_entries((run_dir / "bus_url").read_text().strip())
    launch.wait_for_commits(run_dir, 2)  # the run keeps going
    _kill_role(run_dir, first_victim, rng)
    assert launch.proc.wait(timeout=PHASE_TIMEOUT_S) == 1, launch.finish()

    # 2. resumed; then Redis SIGKILLed, its AOF losing the last second before the kill
    launch = Launch(config, run_dir, resume=True)
    aof = AofWatch(run_dir)
    launch.wait_for_commits(run_dir, len(_commits(run_dir)) + 2)
    # Redis has been up for the resume's seconds already, so its AOF has a last second to lose; the
    # commits above may be the backlog a restarted archiver logs first, so wait until it has caught up.
    launch.wait_for_fresh_commit(run_dir)
    time.sleep(rng.uniform(0.0, 0.3))
    os.kill(int((run_dir / "redis" / "redis.pid").read_text()), signal.SIGKILL)
    cut = aof.lose_last_second(time.monotonic())
    assert launch.proc.wait(timeout=PHASE_TIMEOUT_S) == 1, launch.finish()

    # 3. resumed: the loss is reported; then another role SIGKILLed
    launch = Launch(config, run_dir, resume=True)
    launch.wait_for_commits(run_dir, len(_commits(run_dir)) + 1)
    _kill_role(run_dir, second_victim, rng)
    out = launch.finish()
    assert launch.proc.returncode == 1, out
    reported = "Redis lost writes the log had archived" in out

    # 4. resumed to the end
    launch = Launch(config, run_dir, resume=True)
    out = launch.finish()
    assert launch.proc.returncode == 0, out[-3000:]

    commits = _commits(run_dir)
    assert [c.step for c in commits] == list(range(1, STEPS + 1))
    trained = [g for c in commits for g in c.groups] + [d.group_id for c in commits for d in c.dropped]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    with RunLog(run_dir, readonly=True) as log:
        log.verify()
        events = [e for s in log.names() for _, e in log.events(s)]
        published = {e.group_id for e in events if isinstance(e, Trajectory)}
    keys = [(e.producer, e.seq) for e in events]
    assert len(keys) == len(set(keys)), "a (producer, seq) was used twice"
    assert set(trained) <= published
    assert main(["log", "verify", "--run", str(run_dir)]) == 0
    # The loss window: a line on resume and a metric in the next commit, whenever Redis lost
    # anything the archiver had logged (Redis was killed under FRESH_S + 0.3 s after a logged commit).
    assert cut > 0 and reported
    assert any(c.metrics.get("bus_lost_events", 0) > 0 for c in commits)
    # Every hostile entry was dead-lettered, with a reason, by the archiver (and the trainer on its streams).
    with EmbeddedRedis(run_dir) as server:
        client = redis.Redis.from_url(server.url)
        dead = client.xrange(stream_key("chaos", DEAD))
        client.close()
    by_group: dict[str, set[str]] = {}
    for _, fields in dead:
        assert fields[b"reason"]
        by_group.setdefault(fields[b"group"].decode(), set()).add(fields[b"entry_id"].decode())
    assert {i for ids in bad.values() for i in ids} <= by_group["archiver"]
    assert set(bad["trajectories"] + bad["routing"]) <= by_group["trainer"]
    print(f"chaos: killed {first_victim} and {second_victim}; Redis AOF lost its last {cut} bytes; "
          f"{len(dead)} dead letters")
