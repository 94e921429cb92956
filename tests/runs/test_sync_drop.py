"""A synchronous run (rollout.async_level = 0) whose trainer drops one of a worker's groups: the worker
replaces it and the run completes. The trainer announces the drop (GroupsDropped) while its batch is
one short; were it known only at the commit, trainer and worker would wait for each other for ever,
both saying "waiting", so no liveness check would fire.

The drop: a role-valid worker (published through Publisher, so bus/trust.py lets it through) sends a
RoutingTrace under the group id worker 0 will give a group of a later round; the trainer joins it with
that group's Trajectory and drops the group as bad_routing."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from reel.bus.events import GroupsDropped, RoutingTrace, StepCommitted, Trajectory, decode, stream_key
from reel.bus.run_log import RunLog
from reel.bus.streams import FIELD, Publisher, connect
from reel.runtime.launch.cli import main
from runbuilder import TINY_MODEL_TOML
from test_chaos import CONFIG, _commits, _role_logs

pytestmark = pytest.mark.slow

RUN = "chaos"  # test_chaos's config names the run
STEPS = 8
ROUND = 4  # a worker's round: trainer.batch_groups / rollout.workers of test_chaos's config
# A hang guard, not a speed figure: the run takes seconds; without the announcement it never ends.
HANG_S = 180


def _bus_events(client: redis.Redis, stream: str) -> list:
    return [decode(fields[FIELD]) for _, fields in client.xrange(stream_key(RUN, stream))]


def _poison_a_later_group(url: str) -> str:
    """Once worker 0 has published a group of its first round, a routing trace for a group of its third
    round (two commits away); the group's id."""
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + HANG_S
    while not (groups := [e for e in _bus_events(client, "trajectories") if isinstance(e, Trajectory)]):
        assert time.monotonic() < deadline, "no group published"
        time.sleep(0.02)
    client.close()
    worker, base, _ = groups[0].group_id.split("-")  # "<worker>-<seq base>-<counter>" (producers/rollout.py)
    group_id = f"{worker}-{base}-{2 * ROUND + 1}"

    async def publish() -> None:
        async with connect(url) as bus:
            publisher = Publisher(bus, RUN, "rollout:7")
            await publisher.publish([publisher.stamp(RoutingTrace, group_id=group_id, experts=[])])

    asyncio.run(publish())
    return group_id


def test_a_synchronous_run_replaces_a_group_its_trainer_drops(tmp_path: Path) -> None:
    config = tmp_path / "sync.toml"
    config.write_text(CONFIG.format(steps=STEPS, model=TINY_MODEL_TOML).replace("async_level = 1", "async_level = 0"))
    run_dir = tmp_path / "run"
    launch = subprocess.Popen([sys.executable, "-m", "reel.runtime.launch.cli", "run", str(config), "--out",
                               str(run_dir), "--no-live"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        while not (run_dir / "bus_url").exists():
            assert launch.poll() is None, launch.communicate()[0]
            time.sleep(0.05)
        poisoned = _poison_a_later_group((run_dir / "bus_url").read_text().strip())
        try:
            out = launch.communicate(timeout=HANG_S)[0]
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run hung at {len(_commits(run_dir))} of {STEPS} steps\n" + _role_logs(run_dir))
    finally:
        if launch.poll() is None:
            launch.terminate()  # the launcher stops its roles and Redis
            launch.wait(timeout=60)
    assert launch.returncode == 0, out[-3000:]

    commits = _commits(run_dir)
    assert [c.step for c in commits] == list(range(1, STEPS + 1))
    dropped = {d.group_id: (c.step, d.reason) for c in commits for d in c.dropped}
    step, reason = dropped[poisoned]
    assert reason.startswith("bad_routing: ")
    assert all(len(c.groups) == ROUND for c in commits)  # every batch full: the dropped group was replaced
    with RunLog(run_dir, readonly=True) as log:
        steps = [e for _, e in log.events("steps")]
    announced = [i for i, e in enumerate(steps) if isinstance(e, GroupsDropped)
                 and poisoned in {d.group_id for d in e.dropped}]
    committed = next(i for i, e in enumerate(steps) if isinstance(e, StepCommitted) and e.step == step)
    assert announced and announced[0] < committed and steps[announced[0]].step == step
    assert main(["log", "verify", "--run", str(run_dir)]) == 0
    assert main(["replay", "step", str(step), "--run", str(run_dir), "--json"]) == 0  # bitwise, the drop and all
