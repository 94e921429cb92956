"""A Redis that stops answering for a while (SIGSTOP, then SIGCONT) against the bus's clients: a pause
shorter than bus.ride_out_s is ridden out (nothing lost, nothing doubled, the wait logged), a longer
one fails as before with the command and the stream named (bus/redis_boundary.py)."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
from pathlib import Path

import pytest

from reel.bus.events import RunFinished, WorkerStats, stream_key
from reel.bus.run_log import RunLog
from reel.bus.redis_boundary import RIDE_OUT_ENV
from reel.bus.server import EmbeddedRedis, service_redis_server
from reel.bus.streams import BusError, GroupConsumer, Publisher, connect
from reel.consumers.archiver import Archiver


class Paused:
    """A private Redis (the session's is shared) that a test freezes and thaws."""

    def __init__(self, run_dir: Path):
        self.server = EmbeddedRedis(run_dir, binary=service_redis_server())
        self.url = self.server.start()
        self.pid = int((run_dir / "redis" / "redis.pid").read_text())

    def freeze_for(self, seconds: float) -> None:
        os.kill(self.pid, signal.SIGSTOP)
        asyncio.get_running_loop().call_later(seconds, self.thaw)

    def thaw(self) -> None:
        os.kill(self.pid, signal.SIGCONT)


@pytest.fixture
def paused(tmp_path: Path):
    redis = Paused(tmp_path / "bus")
    try:
        yield redis
    finally:
        redis.thaw()
        redis.server.stop()


def stats(publisher: Publisher, n: int) -> list[WorkerStats]:
    return [publisher.stamp(WorkerStats, worker=publisher.producer, tokens_per_s=float(i), running=0, waiting=0,
                            policy_version=0, groups_published=i) for i in range(n)]


def waits(caplog: pytest.LogCaptureFixture) -> list[float]:
    """Seconds of each wait the boundary reported as ridden out."""
    return [float(m.group(1)) for r in caplog.records if (m := re.search(r" waited ([\d.]+) s \(", r.getMessage()))]


async def test_a_short_pause_is_ridden_out_and_reported_nothing_lost_or_doubled(paused: Paused, run_name: str,
                                                                                 caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.WARNING)
    async with connect(paused.url, socket_timeout=0.5) as client:  # a short timeout: each try gives up fast
        publisher = Publisher(client, run_name, "rollout:0")
        async with GroupConsumer(paused.url, run_name, "trainer", "t0", ["control"], block_ms=100) as consumer:
            got: list[WorkerStats] = []

            async def read_all() -> None:
                while len(got) < 40:
                    deliveries = await consumer.read(count=10)
                    got.extend(d.event for d in deliveries)
                    await consumer.ack(deliveries)

            reader = asyncio.ensure_future(read_all())
            for batch in range(20):
                if batch == 8:
                    paused.freeze_for(3.0)
                await publisher.publish(stats(publisher, 2))
            await asyncio.wait_for(reader, timeout=60)
            assert sorted(e.seq for e in got) == list(range(40))  # every one, once
            on_bus = await client.xlen(stream_key(run_name, "control"))
    assert on_bus >= 40  # the tries that timed out ran once Redis woke: copies that readers skip
    key = stream_key(run_name, "control")
    reported = [r.getMessage() for r in caplog.records if "answered again" in r.getMessage()]
    assert any(f"XADD of 2 events to {key}" in m for m in reported), reported
    assert waits(caplog) and max(waits(caplog)) >= 2.0


async def test_the_archiver_rides_out_a_pause_longer_than_its_read_timeout(paused: Paused, run_name: str,
                                                                          tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture):
    """Its blocking read is never retried (a lost reply would strand entries): it waits for Redis, then
    re-reads its pending list. The log then holds every event, and each (producer, seq) once for its readers."""
    caplog.set_level(logging.WARNING)
    run_dir = tmp_path / "run"
    stop = asyncio.Event()
    archiver = asyncio.ensure_future(Archiver(run_dir, paused.url, run_name, block_ms=100).run(stop))
    async with connect(paused.url, socket_timeout=0.5) as client:
        publisher = Publisher(client, run_name, "rollout:0")
        await publisher.publish(stats(publisher, 5))
        await asyncio.sleep(0.5)
        paused.freeze_for(11.0)  # longer than the archiver's read timeout (block_ms + READ_MARGIN_S)
        for _ in range(5):
            await publisher.publish(stats(publisher, 2))
        launcher = Publisher(client, run_name, "launcher")
        await launcher.publish([launcher.stamp(RunFinished, reason="done")])
        await asyncio.wait_for(archiver, timeout=60)  # returns once it logged RunFinished and drained
    assert not stop.is_set()
    with RunLog(run_dir, readonly=True) as run_log:
        run_log.verify()
        events = [e for _, e in run_log.events("control")]
    seqs = [e.seq for e in events if isinstance(e, WorkerStats)]
    assert sorted(set(seqs)) == list(range(15))
    answered = [float(m.group(1)) for r in caplog.records
                if (m := re.search(r"archiver of run .*: Redis answered again after ([\d.]+) s", r.getMessage()))]
    assert answered and answered[0] >= 10.0


async def test_a_pause_past_the_bound_fails_as_before_naming_command_stream_and_bound(
        paused: Paused, run_name: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(RIDE_OUT_ENV, "1")
    async with connect(paused.url, socket_timeout=0.5) as client:
        publisher = Publisher(client, run_name, "rollout:0")
        await publisher.publish(stats(publisher, 1))
        paused.freeze_for(5.0)
        with pytest.raises(BusError) as caught:
            await publisher.publish(stats(publisher, 1))
    message = str(caught.value)
    assert f"XADD of 1 events to {stream_key(run_name, 'control')} failed" in message
    assert "longer than bus.ride_out_s = 1" in message
