"""`reel run` with bus.partitions = 3 on a real three-master Redis Cluster: the run completes and
replays bitwise; a master killed mid-run and restarted from its append-only file loses nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reel.bus.cluster import CLUSTER_ENV
from reel.bus.events import StepCommitted, Trajectory, stream_key
from reel.bus.run_log import RunLog
from reel.bus.partitions import lane_key
from runbuilder import e2e_config
from reel.runtime.launch.cli import main

pytestmark = pytest.mark.slow

def _config(tmp_path: Path, name: str, url: str, steps: int) -> Path:
    """Three workers, one per partition, on the cluster at `url`."""
    return e2e_config(tmp_path / f"{name}.toml", name, steps, {
        "bus": {"url": url, "cluster": True, "partitions": 3}, "rollout": {"workers": 3, "concurrency": 2}})


def _commits(run_dir: Path) -> list[StepCommitted]:
    with RunLog(run_dir, readonly=True) as log:
        return [e for _, e in log.events("steps") if isinstance(e, StepCommitted)]


def _spread(redis_cluster, run_name: str) -> str:
    """`run_name` with a suffix that puts its partitions on more than one master. Placement is by
    slot: for about one name in nine all three partitions hash to one master, and these tests are
    about a run that a cluster spreads."""
    for i in range(100):
        name = f"{run_name[:40]}-{i}"
        if len({redis_cluster.owner(lane_key(name, f"trajectories/{p}")) for p in range(3)}) > 1:
            return name
    raise AssertionError("no spread run name found")


def _replays_bitwise(run_dir: Path, step: int, capsys: pytest.CaptureFixture[str]) -> bool:
    capsys.readouterr()
    assert main(["replay", "step", str(step), "--run", str(run_dir), "--json"]) == 0
    return json.loads(capsys.readouterr().out)["bitwise"]


def test_partitioned_run_on_a_cluster_completes_and_replays_bitwise(
        redis_cluster, run_name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CLUSTER_ENV, "0")  # the config's bus.cluster turns it on (restored after the test)
    run_dir = tmp_path / "run"
    run_name = _spread(redis_cluster, run_name)
    assert main(["run", str(_config(tmp_path, run_name, redis_cluster.url, 3)), "--out", str(run_dir),
                 "--no-live"]) == 0
    assert [c.step for c in _commits(run_dir)] == [1, 2, 3]
    with RunLog(run_dir, readonly=True) as log:
        workers = {e.worker for _, e in log.events("trajectories") if isinstance(e, Trajectory)}
    assert workers == {"rollout:0", "rollout:1", "rollout:2"}  # every partition carried groups
    owners = set()
    for key in [lane_key(run_name, f"trajectories/{p}") for p in range(3)] + [stream_key(run_name, "steps")]:
        owner = redis_cluster.owner(key)  # CLUSTER KEYSLOT + the slot ranges of CLUSTER SLOTS
        with redis_cluster.node(owner) as client:
            assert client.exists(key), f"{key} is not on master {owner}, which serves its slot"
        owners.add(owner)
    assert len(owners) > 1, f"run {run_name}: every key on one master"
    assert all(_replays_bitwise(run_dir, step, capsys) for step in (1, 2, 3))


def test_a_master_killed_mid_run_and_restarted_loses_nothing(
        redis_cluster, run_name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The master serving the run's own slot (steps, weights, control) dies after the first commit
    and comes back from its append-only file. Roles that hit the gap stop the run (as with one
    Redis); `--resume` then completes it: every step committed once, no group trained twice."""
    run_dir = tmp_path / "run"
    run_name = _spread(redis_cluster, run_name)
    steps = 4
    argv = [sys.executable, "-m", "reel.runtime.launch.cli", "run",
            str(_config(tmp_path, run_name, redis_cluster.url, steps)), "--out", str(run_dir), "--no-live"]
    env = {k: v for k, v in os.environ.items() if k != CLUSTER_ENV}
    victim = redis_cluster.owner(stream_key(run_name, "steps"))
    launcher = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 240
        while not ((run_dir / "log" / "steps").is_dir() and _commits(run_dir)):
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
            time.sleep(0.2)
        redis_cluster.kill(victim)
        time.sleep(1.0)
        redis_cluster.start(victim)
        redis_cluster.wait_ok()
        launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGINT)
            launcher.wait(timeout=60)
        redis_cluster.start(victim) if redis_cluster.procs[victim] is None else None
    if launcher.returncode != 0:
        resumed = subprocess.run(argv + ["--resume"], capture_output=True, text=True, timeout=300, env=env)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
    commits = _commits(run_dir)
    assert [c.step for c in commits] == list(range(1, steps + 1))
    trained = [g for c in commits for g in c.groups]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert _replays_bitwise(run_dir, steps, capsys)
