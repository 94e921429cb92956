"""`reel bench bus`'s pipeline: Reel's delivery and persistence against the raw medium.

 one realistic Trajectory event (8 samples x 1024 tokens, int32 ids + float32 logprobs,
     ~67 KB). Reel: Publisher -> a GroupConsumer (read + ack, in its own process, like the
     trainer) and the archiver (its own process, acks once fdatasync'd); an event counts once both
     groups have acknowledged it. Baseline: the same work raw with plain redis-py: pipelined XADD
     of the event's bytes, two consumer groups in their own processes each reading with
     XREADGROUP and acking, one of them first appending the bytes to a file with fdatasync (on a
     thread, overlapping the next read, as the archiver does); so
     ratio = Reel events/s / raw events/s measures Reel's own overhead. The old baseline, a bare
     pipelined XADD with no readers, stays in the output (raw_xadd_events_per_s, ratio_vs_xadd).
     All against one EmbeddedRedis (unix socket, AOF everysec, no AOF rewrites) in a temp dir,
     publishing from uvloop like the roles do; `cpus` is in the output because the ratio depends
     on it. `--partitions P`: runtime/bench/bus.py.

The baseline and Reel run alternately (rounds) and each one's best is kept, so a burst of noise
on a shared machine does not decide the ratio. Children (the archiver, the raw readers, the
consumer) run in their own processes, named "module:function" for the child's command line.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import numpy as np
import redis
import redis.asyncio
import uvloop

from reel.bus.events import STREAMS, Sample, Tensor, Trajectory, encode
from reel.bus.jsonout import print_json
from reel.bus.log import StreamLog
from reel.bus.partitions import lane_key, lanes, worker_partition
from reel.bus.server import EmbeddedRedis
from reel.bus.streams import GroupConsumer, Publisher, connect
from reel.consumers import archiver

__all__ = ["bench_bus", "trajectory", "reel_pipeline", "consume", "raw_read"]

_PIPELINE = 50  # events per pipelined round trip (baseline and Publisher alike)
_ARCHIVER = f"{archiver.__name__}:main"
_CHILD = """
import sys
from importlib import import_module
module, function = sys.argv[1].split(":")
sys.exit(getattr(import_module(module), function)(*sys.argv[2:]))
"""


def trajectory(seq: int = 0, samples: int = 8, tokens: int = 1024) -> Trajectory:
    """A GRPO group as a rollout worker publishes it (random ids and logprobs)."""
    rng = np.random.default_rng(seq)
    return Trajectory(
        run="bench", producer="rollout:0", seq=seq, group_id=f"g{seq}", env="reverse_text", worker="rollout:0",
        prompt=Tensor.from_numpy(rng.integers(0, 32_000, 128, dtype=np.int32)),
        samples=[Sample(tokens=Tensor.from_numpy(rng.integers(0, 32_000, tokens, dtype=np.int32)),
                        logprobs=Tensor.from_numpy(-rng.random(tokens, dtype=np.float32)), reward=1.0,
                        finish_reason="stop", seed=i, spans=[(0, 0)]) for i in range(samples)],
    )


# -- bench bus ------------------------------------------------------------------------------------

def bench_bus(args: argparse.Namespace) -> int:
    n, rounds = (300, 1) if args.quick else (3000, 3)
    event = trajectory()
    xadd, raw, reel, published = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="reel-bench-bus-") as tmp, EmbeddedRedis(Path(tmp)) as server:
        _no_aof_rewrites(server.url)
        for r in range(rounds):
            xadd.append(uvloop.run(_raw_xadd(server.url, encode(event), n)))
            raw.append(_raw_groups(server.url, Path(tmp) / f"raw{r}", encode(event), n))
            done, publish = reel_pipeline(server.url, Path(tmp) / f"run{r}", f"bench{r}", event, n)
            reel.append(done)
            published.append(publish)
    print_json({
        "bench": "bus", "events": n, "event_bytes": len(encode(event)), "rounds": rounds, "cpus": os.cpu_count(),
        "raw_events_per_s": round(max(raw)), "reel_events_per_s": round(max(reel)),
        # how fast the Reel publisher got its events out, while the two readers ran beside it
        "reel_publish_events_per_s": round(published[reel.index(max(reel))]),
        "ratio": round(max(reel) / max(raw), 3),
        # the baseline before: a bare pipelined XADD, no readers (Redis does a third of the work)
        "raw_xadd_events_per_s": round(max(xadd)), "ratio_vs_xadd": round(max(reel) / max(xadd), 3),
    })
    return 0


def _no_aof_rewrites(url: str) -> None:
    """The bench's server appends to its AOF (everysec) but never rewrites it. A rewrite forks and
    copies the live dataset, which here is a whole round of events (nothing trims them, unlike in a
    run), about a CPU-second on a laptop, and it lands in whichever side's round happens to run."""
    with redis.Redis.from_url(url) as client:
        client.config_set("auto-aof-rewrite-percentage", 0)


async def _raw_xadd(url: str, data: bytes, n: int) -> float:
    client = redis.asyncio.from_url(url)
    try:
        start = time.perf_counter()
        for i in range(0, n, _PIPELINE):
            pipe = client.pipeline(transaction=False)
            for _ in range(min(_PIPELINE, n - i)):
                pipe.xadd("raw", {b"e": data})
            await pipe.execute()
        rate = n / (time.perf_counter() - start)
        await client.delete("raw")
        return rate
    finally:
        await client.aclose()


def _raw_groups(url: str, out: Path, data: bytes, n: int) -> float:
    """The baseline: events/s until two raw consumer groups (one fdatasyncing a file) acked the last."""
    out.mkdir()
    key = f"raw:{out.name}"
    children = {out / "reader.log": _child(out / "reader.log", f"{__name__}:raw_read", url, key, "reader", str(n), ""),
                out / "writer.log": _child(out / "writer.log", f"{__name__}:raw_read", url, key, "writer", str(n),
                                           str(out / "events.bin"))}
    try:
        rate = uvloop.run(_raw_publish_and_wait(url, key, data, n, children))
    finally:
        _stop(children)
    if (out / "events.bin").stat().st_size != len(data) * n:
        raise RuntimeError(f"bench bus: the raw writer wrote {(out / 'events.bin').stat().st_size} bytes, not {n} events")
    return rate


async def _raw_publish_and_wait(url: str, key: str, data: bytes, n: int,
                                children: dict[Path, subprocess.Popen]) -> float:
    client = redis.asyncio.from_url(url)
    try:
        await _wait_for_groups(client, [key], children)
        start = time.perf_counter()
        for i in range(0, n, _PIPELINE):
            pipe = client.pipeline(transaction=False)
            for _ in range(min(_PIPELINE, n - i)):
                pipe.xadd(key, {b"e": data})
            last = (await pipe.execute())[-1].decode()
        await _wait_acked(client, {key: last}, children)
        rate = n / (time.perf_counter() - start)
        await client.delete(key)
        return rate
    finally:
        await client.aclose()


def raw_read(url: str, key: str, group: str, n: str, path: str) -> int:
    """A raw baseline reader: XREADGROUP, (append to `path` + fdatasync,) XACK, until n are acked.

    The writer overlaps its disk work as the archiver does: one round is appended and fdatasync'd
    on a thread while the next is read (without blocking), and acked once it is durable."""

    async def read() -> None:
        client = redis.asyncio.from_url(url)
        out = open(path, "ab") if path else None
        disk = ThreadPoolExecutor(1)
        writing: tuple[asyncio.Future, list] | None = None  # the previous round's append and its entry ids
        try:
            await client.xgroup_create(key, group, id="0", mkstream=True)
            done = 0
            while done < int(n):
                reply = await client.xreadgroup(group, "c", {key: ">"}, count=256 if out else 100,
                                                block=None if writing else 200)
                entries = [entry for _, batch in reply or () for entry in batch]
                if writing is not None:
                    await writing[0]
                    await client.xack(key, group, *writing[1])
                    done, writing = done + len(writing[1]), None
                if not entries:
                    continue
                ids = [entry_id for entry_id, _ in entries]
                if out is None:
                    await client.xack(key, group, *ids)
                    done += len(ids)
                else:
                    data = b"".join(fields[b"e"] for _, fields in entries)
                    writing = (asyncio.get_running_loop().run_in_executor(disk, _append_durably, out, data), ids)
        finally:
            disk.shutdown(wait=True)
            if out is not None:
                out.close()
            await client.aclose()

    uvloop.run(read())
    return 0


def _append_durably(out: BinaryIO, data: bytes) -> None:
    out.write(data)
    out.flush()
    os.fdatasync(out.fileno())


def reel_pipeline(url: str, run_dir: Path, run: str, event: Trajectory, n: int,
                  partitions: int = 1) -> tuple[float, float]:
    """(events/s until the consumer and the archiver have acked the last, events/s published).
    With partitions > 1, one publisher per partition sends n / partitions events, all at once."""
    run_dir.mkdir()
    children = {run_dir / "consumer.log": _child(run_dir / "consumer.log", f"{__name__}:consume", url, run, str(n),
                                                 str(partitions)),
                run_dir / "archiver.log": _child(run_dir / "archiver.log", _ARCHIVER, str(run_dir), url, run,
                                                 str(partitions))}
    try:
        rates = uvloop.run(_publish_and_wait(url, run, event, n, partitions, children))
    finally:
        _stop(children)
    with StreamLog(run_dir / "log" / "trajectories", readonly=True) as log:
        if len(log) != n:
            raise RuntimeError(f"bench bus: the archiver logged {len(log)} of {n} events")
    return rates


def _stop(children: dict[Path, subprocess.Popen]) -> None:
    for child in children.values():
        child.terminate()
        child.wait(timeout=30)


def _child(output: Path, target: str, *argv: str) -> subprocess.Popen:
    with open(output, "wb") as out:
        return subprocess.Popen([sys.executable, "-c", _CHILD, target, *argv], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT)


async def _publish_and_wait(url: str, run: str, event: Trajectory, n: int, partitions: int,
                            children: dict[Path, subprocess.Popen]) -> tuple[float, float]:
    client = connect(url)
    try:
        keys = [lane_key(run, lane) for lane in lanes(["trajectories"], partitions)]
        await _wait_for_groups(client, keys, children)
        fields = {f: getattr(event, f) for f in event.__struct_fields__ if f not in ("run", "producer", "seq")}

        async def publish(worker: int) -> str:
            publisher = Publisher(client, run, f"rollout:{worker}", partition=worker_partition(worker, partitions))
            mine = n // partitions + (worker < n % partitions)
            for i in range(0, mine, _PIPELINE):
                ids = await publisher.publish([publisher.stamp(Trajectory, **fields)
                                               for _ in range(min(_PIPELINE, mine - i))])
            return ids[-1]

        start = time.perf_counter()
        lasts = await asyncio.gather(*(publish(w) for w in range(partitions)))
        published = time.perf_counter() - start
        await _wait_acked(client, dict(zip(keys, lasts)), children)
        done = time.perf_counter() - start
        for key in keys + [lane_key(run, lane) for lane in STREAMS if lane != "trajectories"]:
            await client.delete(key)  # keeps AOF rewrites small (one key at a time: a cluster has many slots)
        return n / done, n / published
    finally:
        await client.aclose()


async def _wait_for_groups(client: redis.asyncio.Redis, keys: list[str], children: dict[Path, subprocess.Popen]) -> None:
    """Until both readers have created their group on every key."""
    for key in keys:
        while len(await client.xinfo_groups(key) if await client.exists(key) else []) < 2:
            _check_alive(children)
            await asyncio.sleep(0.02)


async def _wait_acked(client: redis.asyncio.Redis, lasts: dict[str, str], children: dict[Path, subprocess.Popen]) -> None:
    """Until every group on each key has read up to its last entry and acked everything."""
    for key, last in lasts.items():
        while not all(g["pending"] == 0 and g["last-delivered-id"].decode() == last
                      for g in await client.xinfo_groups(key)):
            _check_alive(children)
            await asyncio.sleep(0.005)


def _check_alive(children: dict[Path, subprocess.Popen]) -> None:
    for output, child in children.items():
        if child.poll():  # the consumer exits 0 once it has acked every event
            raise RuntimeError(f"bench bus: {child.args[3]} exited with code {child.returncode}: "
                               f"{output.read_text()[-2000:]}")


def consume(url: str, run: str, n: str, partitions: str = "1") -> int:
    """The trainer-like reader of `reel bench bus`: read and ack n trajectories."""

    async def run_consumer() -> None:
        async with GroupConsumer(url, run, "trainer", "bench", ["trajectories"], block_ms=200,
                                 partitions=int(partitions)) as consumer:
            done = 0
            while done < int(n):
                deliveries = await consumer.read(count=100)
                await consumer.ack(deliveries)
                done += len(deliveries)

    uvloop.run(run_consumer())
    return 0
