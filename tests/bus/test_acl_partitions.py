"""The run's ACL rule (runtime/launch/bus_access.py) covers everything Reel sends with bus.partitions = 3
and a dead letter present: partition keys reel:{RUN:P}:..., the seq marks, XINFO for the dead-letter
count, the archiver; and still nothing of another run. Against the real TLS + ACL redis-server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from reel.bus.events import RunFinished, encode
from reel.bus.partitions import lane_key
from reel.bus.streams import (
    BusError, GroupConsumer, Publisher, connect, dead_letters_added, recover_next_seq, safe_trim,
)
from reel.consumers.archiver import Archiver
from reel.runtime.launch.bus_access import bus_url
from test_bus_security import PASSWORD, _config, _run_user, secure_redis  # noqa: F401 - the fixture
from partition_setup import P, publish_group, worker_publishers

assert P == 3


async def test_acl_rule_covers_partitions_dead_letters_and_the_archiver(secure_redis, run_name, monkeypatch,
                                                                      tmp_path: Path):
    port, d, admin = secure_redis
    _run_user(admin, run_name, "reel-p")
    monkeypatch.setenv("REEL_BUS_PASSWORD", PASSWORD)
    url = bus_url(_config(port, d, run_name, "reel-p"))
    async with connect(url) as client:
        workers = worker_publishers(client, run_name)
        for worker in workers:
            await worker.publish([e for i in range(2) for e in publish_group(worker, i)])
        # A forged entry on partition 2: squatting rollout:2's seqs, so the consumer dead-letters it.
        forged = msgspec.structs.replace(publish_group(workers[2], 0)[0], seq=10**6)
        await client.xadd(lane_key(run_name, "trajectories/2"), {"e": encode(forged)})
        async with GroupConsumer(url, run_name, "trainer", "t0", ["trajectories", "routing"], block_ms=50,
                                 partitions=P) as consumer:
            got = []
            for _ in range(20):
                got += await consumer.read(count=100)
                if len(got) == 2 * 2 * P:
                    break
            await consumer.ack(got)
        assert len(got) == 2 * 2 * P
        assert await dead_letters_added(client, run_name, P) == 1  # XINFO STREAM on every slot's dead letters
        assert await recover_next_seq(client, run_name, "rollout:1", P) == 4
        launcher = Publisher(client, run_name, "launcher:0")
        await launcher.publish([launcher.stamp(RunFinished, reason="done")])
        archiver = Archiver(tmp_path, url, run_name, block_ms=50, partitions=P)
        await asyncio.wait_for(archiver.run(asyncio.Event()), timeout=30)  # exits once RunFinished is logged
        assert archiver.archived == 2 * 2 * P + 1 and archiver.finished
        assert await dead_letters_added(client, run_name, P) == 2  # the archiver's own dead letter of it
        for lane in ("trajectories/0", "trajectories/2", "control"):  # the Lua script on partition keys
            await safe_trim(client, run_name, lane)
        other = Publisher(client, "another-run", "rollout:0", partition=1)
        with pytest.raises(BusError, match="NoPermissionError"):
            await other.publish(publish_group(other, 0))
