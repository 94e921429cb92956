"""consumers/archiver.py against a real Redis: the log equals the streams, across SIGKILLs."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest

from reel.bus.events import (STREAM_OF, STREAMS, BlobRef, RunFinished, Sample, StepCommitted, StepTiming, Tensor, Trajectory,
                        WeightsPublished, WorkerStats, decode, stream_key)
from reel.bus.log import LogError
from reel.bus.run_log import RunLog
from reel.bus.streams import DEAD, Publisher, connect
from reel.consumers.archiver import GROUP, Archiver

_ARCHIVER_CHILD = """
import asyncio, sys
from pathlib import Path
from reel.consumers.archiver import Archiver
import logging
logging.basicConfig(level=logging.INFO)
asyncio.run(Archiver(Path(sys.argv[1]), sys.argv[2], sys.argv[3], batch=int(sys.argv[4]), block_ms=100,
                     trim_every_s=0.2, segment_bytes=64 << 10).run(asyncio.Event()))
"""


def _events(publisher: Publisher, i: int) -> list:
    """A few events of every stream, sizes from tens of bytes to some KB."""
    tokens = Tensor.from_numpy(np.arange(i % 50 + 1, dtype=np.int32))
    sample = Sample(tokens=tokens, logprobs=Tensor.from_numpy(np.zeros(i % 50 + 1, np.float32)), reward=0.5,
                    finish_reason="stop", seed=i, spans=[(0, i)])
    return [
        publisher.stamp(Trajectory, group_id=f"g{i}", env="e", prompt=tokens, samples=[sample] * 4, worker="w"),
        publisher.stamp(WorkerStats, worker="w", tokens_per_s=1.0, running=1, waiting=0, policy_version=i,
                        groups_published=i),
        _as_trainer(publisher.stamp(WeightsPublished, version=i, step=i, weights=BlobRef("file:///w", "ab" * 32, 3))),
        _as_trainer(publisher.stamp(StepCommitted, step=i + 1, version=i + 1, groups=[f"g{i}"], dropped=[], loss=0.1,
                                    grad_norm=1.0, weights_sha256="ab" * 32, timing=StepTiming(0.0, 1.0, 0.1))),
    ]


def _as_trainer(event):
    """Versions and steps come from the trainer's role alone (bus/trust.py); Publisher records the
    seq mark of whichever producer an event names."""
    return msgspec.structs.replace(event, producer="trainer:0")


def _as_launcher(event):
    return msgspec.structs.replace(event, producer="launcher:0")


async def _stream_contents(client, run: str) -> dict[str, list[tuple[str, bytes]]]:
    return {s: [(i.decode(), f[b"e"]) for i, f in await client.xrange(stream_key(run, s))] for s in STREAMS}


def _log_contents(run_dir: Path) -> dict[str, list[tuple[str, bytes]]]:
    with RunLog(run_dir, readonly=True) as run_log:
        return {s: [(r.entry_id, r.data) for r in run_log.stream(s).records()] for s in run_log.names()}


async def _pending(client, run: str) -> int:
    return sum([(await client.xpending(stream_key(run, s), GROUP))["pending"] for s in STREAMS])


async def test_archives_everything_dead_letters_garbage_and_finishes(redis_url: str, run_name: str, tmp_path: Path):
    async with connect(redis_url) as client:
        publisher = Publisher(client, run_name, "rollout:0")
        events = [e for i in range(30) for e in _events(publisher, i)]
        await publisher.publish(events)
        await publisher.publish(events[:2])  # a retried XADD: same (producer, seq), new entry ids
        await client.xadd(stream_key(run_name, "control"), {b"e": b"\xc1 not msgpack"})
        await publisher.publish([_as_launcher(publisher.stamp(RunFinished, reason="done"))])
        archiver = Archiver(tmp_path, redis_url, run_name, batch=16, block_ms=100)
        await asyncio.wait_for(archiver.run(asyncio.Event()), timeout=30)  # returns on its own
        on_bus = await _stream_contents(client, run_name)
        garbage = on_bus["control"].pop(-2)
        logged = {stream: [] for stream in on_bus}  # every byte as on the bus, a repeated event once (its first copy)
        for stream, entries in on_bus.items():
            for entry_id, data in entries:
                if data not in {d for _, d in logged[stream]}:
                    logged[stream].append((entry_id, data))
        assert sum(map(len, on_bus.values())) - sum(map(len, logged.values())) == 2
        assert _log_contents(tmp_path) == logged
        assert archiver.archived == 30 * 4 + 1 and archiver.repeats == 2 and archiver.finished
        (dead,) = await client.xrange(stream_key(run_name, DEAD))
        assert dead[1][b"entry_id"].decode() == garbage[0] and b"undecodable" in dead[1][b"reason"]
        assert await _pending(client, run_name) == 0


async def test_logged_but_unacked_entries_are_acked_not_logged_twice(redis_url: str, run_name: str, tmp_path: Path):
    """The crash window between fdatasync and XACK, made deterministic."""
    async with connect(redis_url) as client:
        publisher = Publisher(client, run_name, "rollout:0")
        await publisher.publish([e for i in range(10) for e in _events(publisher, i)])
        await _run_until_idle(Archiver(tmp_path, redis_url, run_name), client)
        await publisher.publish([e for i in range(10, 20) for e in _events(publisher, i)])
        # Deliver the new entries to the archiver's consumer and log half of them, without acking.
        keys = {stream_key(run_name, s): ">" for s in STREAMS}
        reply = await client.xreadgroup(GROUP, "archiver", keys, count=1000)
        with RunLog(tmp_path) as run_log:
            for key, entries in reply:
                stream = key.decode().rsplit(":", 1)[1]
                half = entries[: len(entries) // 2]
                run_log.stream(stream).append_batch([(i.decode(), f[b"e"]) for i, f in half])
        await publisher.publish([e for i in range(20, 30) for e in _events(publisher, i)])  # never delivered
        # Small reads: the pending entries take several rounds, and none of the new ones may jump them.
        archiver = Archiver(tmp_path, redis_url, run_name, batch=2)
        await _run_until_idle(archiver, client)
        assert _log_contents(tmp_path) == await _stream_contents(client, run_name)
        assert archiver.repeats == sum(len(entries) // 2 for _, entries in reply) > 0
        assert await _pending(client, run_name) == 0


async def _drained(client, key: str) -> bool:
    """The archiver group has read up to the stream's last entry and acked everything (Redis 6.2 too:
    XINFO GROUPS has no `lag` before 7.0)."""
    if not await client.exists(key):  # the archiver has not created its group (mkstream) yet
        return False
    groups = await client.xinfo_groups(key)
    last = await client.xrevrange(key, count=1)
    if not groups or not last:
        return bool(groups)
    return groups[0]["pending"] == 0 and groups[0]["last-delivered-id"] == last[0][0]


async def _run_until_idle(archiver: Archiver, client) -> None:
    """Run the archiver until its group has read and acked everything in every stream."""
    stop = asyncio.Event()
    running = asyncio.ensure_future(archiver.run(stop))
    deadline = time.monotonic() + 20
    while not running.done():
        if time.monotonic() > deadline:
            stop.set()
            await running
            pytest.fail("the archiver left entries unread or unacked")
        await asyncio.sleep(0.05)
        if all([await _drained(client, stream_key(archiver.run_name, s)) for s in STREAMS]):
            stop.set()
    await running


async def test_one_archiver_per_run_dir(redis_url: str, run_name: str, tmp_path: Path):
    with RunLog(tmp_path) as run_log:
        run_log.stream("control")
        with pytest.raises(LogError, match="already open for writing"):
            await Archiver(tmp_path, redis_url, run_name).run(asyncio.Event())


async def test_sigkilled_archiver_leaves_no_gap_and_no_duplicate(redis_url: str, run_name: str, tmp_path: Path):
    seed = int(os.environ.get("REEL_TEST_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    published: dict[str, list[str]] = {s: [] for s in STREAMS}
    copies: set[str] = set()  # trajectories entry ids of retried XADDs: the log keeps an event's first copy only
    async with connect(redis_url) as client:
        publisher = Publisher(client, run_name, "rollout:0")

        async def publish() -> None:  # about 5 s of steady load, so kills land in every phase
            for i in range(0, 1500, 5):
                events = [e for j in range(i, i + 5) for e in _events(publisher, j)]
                if i % 95 == 0:  # now and then a retried XADD
                    events.append(events[0])
                ids = await publisher.publish(events)
                for event, entry_id in zip(events, ids):
                    published[STREAM_OF[type(event)]].append(entry_id)
                if i % 95 == 0:  # the copy is a Trajectory
                    copies.add(ids[-1])
                await asyncio.sleep(0.01)

        def start() -> subprocess.Popen:
            batch = rng.choice([1, 7, 64])
            return subprocess.Popen([sys.executable, "-c", _ARCHIVER_CHILD, str(tmp_path), redis_url, run_name,
                                     str(batch)], stderr=open(tmp_path / "archiver.err", "ab"))

        producing = asyncio.ensure_future(publish())
        kills = 0
        while not producing.done():
            child = start()
            await asyncio.sleep(rng.uniform(0.3, 0.8))  # start-up takes ~0.3 s; then anywhere in a round
            child.send_signal(signal.SIGKILL)
            child.wait()
            kills += 1
        await producing
        published["control"] += await publisher.publish([_as_launcher(publisher.stamp(RunFinished, reason="done"))])
        child = start()
        assert await asyncio.to_thread(child.wait, 30) == 0, (tmp_path / "archiver.err").read_text()
        logged = _log_contents(tmp_path)
        assert kills >= 3, f"seed {seed}"
        for stream in STREAMS:
            ids = [entry_id for entry_id, _ in logged[stream]]
            first = [i for i in published[stream] if stream != "trajectories" or i not in copies]
            assert ids == first, f"stream {stream}, seed {seed}"
        assert await _pending(client, run_name) == 0
        assert await client.xlen(stream_key(run_name, "trajectories")) < len(published["trajectories"])  # trimmed


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 1 MiB tmpfs: a disk that really fills up (ENOSPC from the kernel, not a simulated error)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


async def test_full_disk_stops_acking_and_freeing_space_resumes(redis_url: str, run_name: str, small_disk: Path,
                                                                caplog: pytest.LogCaptureFixture, monkeypatch):
    monkeypatch.setattr("reel.consumers.archive_disk.DISK_FULL_RETRY_S", 0.2)
    run_dir = small_disk / "run"
    async with connect(redis_url) as client:
        publisher = Publisher(client, run_name, "rollout:0")
        await publisher.publish([e for i in range(20) for e in _events(publisher, i)])
        stop = asyncio.Event()
        archiver = asyncio.ensure_future(Archiver(run_dir, redis_url, run_name, block_ms=50, trim_every_s=0.2).run(stop))
        try:
            deadline = time.monotonic() + 20
            while not (run_dir / "log" / "steps").is_dir() or len(_log_contents(run_dir)["steps"]) < 20 \
                    or await _pending(client, run_name):
                assert time.monotonic() < deadline and not archiver.done()
                await asyncio.sleep(0.05)
            filler = small_disk / "filler"
            with open(filler, "wb") as f:  # take every free block
                with contextlib.suppress(OSError):
                    while True:
                        f.write(b"\0" * 65536)
                        f.flush()
            await publisher.publish([e for i in range(20, 60) for e in _events(publisher, i)])
            await asyncio.sleep(1.5)
            assert not archiver.done()
            assert "not acking anything until space is freed" in caplog.text
            on_bus = await _stream_contents(client, run_name)
            logged = _log_contents(run_dir)
            # Nothing acked is missing from the log: what the group read and did not leave pending is logged.
            for stream in STREAMS:
                key = stream_key(run_name, stream)
                last = {g["name"].decode(): g for g in await client.xinfo_groups(key)}[GROUP]["last-delivered-id"]
                pending = {p["message_id"].decode()
                           for p in await client.xpending_range(key, GROUP, min="-", max="+", count=1000)}
                acked = {i for i, _ in on_bus[stream] if i not in pending and _order(i) <= _order(last.decode())}
                assert acked <= {i for i, _ in logged.get(stream, [])}, stream
            assert await _pending(client, run_name) > 0
            filler.unlink()
            while await _pending(client, run_name):
                assert time.monotonic() < deadline + 30 and not archiver.done()
                await asyncio.sleep(0.1)
            assert "archiving resumes" in caplog.text
        finally:
            stop.set()
            await archiver
    seqs = sorted(decode(data).seq for records in _log_contents(run_dir).values() for _, data in records)
    assert seqs == list(range(60 * 4))  # every event once: none lost, none twice


def _order(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)
