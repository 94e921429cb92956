"""`reel bench bus` and `reel bench log`: Reel's delivery and persistence against the raw medium.

bus: one realistic Trajectory event (8 samples x 1024 tokens, int32 ids + float32 logprobs,
     ~67 KB). Baseline: redis-py pipelined XADD of its bytes. Reel: Publisher -> a GroupConsumer
     (read + ack, in its own process, like the trainer) and the archiver (its own process, acks
     once fdatasync'd); an event counts once both groups have acknowledged it. Both against one
     EmbeddedRedis (unix socket, AOF everysec, no AOF rewrites) in a temp dir, both publishing
     from uvloop like the roles do. ratio = Reel events/s / raw events/s. In Reel each event
     crosses Redis three times (in once, out to two groups) and reaches the disk twice (AOF and
     log), all on the same cores: `cpus` is in the output because the ratio depends on it.
log: StreamLog.append_batch (framing, CRC, group commit: one fdatasync per batch) MB/s over a raw
     sequential write + one fdatasync per batch of the same bytes, to the same directory.

Both run the baseline and Reel alternately (rounds) and keep each one's best, so a burst of noise
on a shared machine does not decide the ratio. The archiver child is reached by name ("module:
function"), like every role: bus/ never imports consumers/.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import redis
import redis.asyncio
import uvloop

from bus.events import STREAMS, Sample, Tensor, Trajectory, encode, stream_key
from bus.jsonout import print_json
from bus.log import StreamLog
from bus.server import EmbeddedRedis
from bus.streams import GroupConsumer, Publisher, connect

__all__ = ["bench_bus", "bench_log", "trajectory"]

_PIPELINE = 50  # events per pipelined round trip (baseline and Publisher alike)
_ARCHIVER = "consumers.archiver:main"
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
    raw, reel, published = [], [], []
    with tempfile.TemporaryDirectory(prefix="reel-bench-bus-") as tmp, EmbeddedRedis(Path(tmp)) as server:
        _no_aof_rewrites(server.url)
        for r in range(rounds):
            raw.append(uvloop.run(_raw_xadd(server.url, encode(event), n)))
            done, publish = _reel_pipeline(server.url, Path(tmp) / f"run{r}", f"bench{r}", event, n)
            reel.append(done)
            published.append(publish)
    print_json({
        "bench": "bus", "events": n, "event_bytes": len(encode(event)), "rounds": rounds, "cpus": os.cpu_count(),
        "raw_events_per_s": round(max(raw)), "reel_events_per_s": round(max(reel)),
        # how fast the Reel publisher got its events out, while the two readers ran beside it
        "reel_publish_events_per_s": round(published[reel.index(max(reel))]),
        "ratio": round(max(reel) / max(raw), 3),
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


def _reel_pipeline(url: str, run_dir: Path, run: str, event: Trajectory, n: int) -> tuple[float, float]:
    """(events/s until the consumer and the archiver have acked the last, events/s published)."""
    run_dir.mkdir()
    children = {run_dir / "consumer.log": _child(run_dir / "consumer.log", "bus.bench:consume", url, run, str(n)),
                run_dir / "archiver.log": _child(run_dir / "archiver.log", _ARCHIVER, str(run_dir), url, run)}
    try:
        rates = uvloop.run(_publish_and_wait(url, run, event, n, children))
    finally:
        for child in children.values():
            child.terminate()
            child.wait(timeout=30)
    with StreamLog(run_dir / "log" / "trajectories", readonly=True) as log:
        if len(log) != n:
            raise RuntimeError(f"bench bus: the archiver logged {len(log)} of {n} events")
    return rates


def _child(output: Path, target: str, *argv: str) -> subprocess.Popen:
    with open(output, "wb") as out:
        return subprocess.Popen([sys.executable, "-c", _CHILD, target, *argv], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT)


async def _publish_and_wait(url: str, run: str, event: Trajectory, n: int,
                            children: dict[Path, subprocess.Popen]) -> tuple[float, float]:
    key = stream_key(run, "trajectories")
    client = connect(url)
    try:
        while len(await client.xinfo_groups(key) if await client.exists(key) else []) < 2:
            _check_alive(children)
            await asyncio.sleep(0.02)  # both children have created their groups
        publisher = Publisher(client, run, "rollout:0")
        fields = {f: getattr(event, f) for f in event.__struct_fields__ if f not in ("run", "producer", "seq")}
        start = time.perf_counter()
        for i in range(0, n, _PIPELINE):
            ids = await publisher.publish([publisher.stamp(Trajectory, **fields) for _ in range(min(_PIPELINE, n - i))])
        published = time.perf_counter() - start
        while not all(g["pending"] == 0 and g["last-delivered-id"].decode() == ids[-1]
                      for g in await client.xinfo_groups(key)):
            _check_alive(children)
            await asyncio.sleep(0.005)
        done = time.perf_counter() - start
        await client.delete(*(stream_key(run, s) for s in STREAMS))  # keeps AOF rewrites small
        return n / done, n / published
    finally:
        await client.aclose()


def _check_alive(children: dict[Path, subprocess.Popen]) -> None:
    for output, child in children.items():
        if child.poll():  # the consumer exits 0 once it has acked every event
            raise RuntimeError(f"bench bus: {child.args[3]} exited with code {child.returncode}: "
                               f"{output.read_text()[-2000:]}")


def consume(url: str, run: str, n: str) -> int:
    """The trainer-like reader of `reel bench bus`: read and ack n trajectories."""

    async def run_consumer() -> None:
        async with GroupConsumer(url, run, "trainer", "bench", ["trajectories"], block_ms=200) as consumer:
            done = 0
            while done < int(n):
                deliveries = await consumer.read(count=100)
                await consumer.ack(deliveries)
                done += len(deliveries)

    uvloop.run(run_consumer())
    return 0


# -- bench log ------------------------------------------------------------------------------------

def bench_log(args: argparse.Namespace) -> int:
    batches, rounds = (8, 1) if args.quick else (60, 3)
    per_batch = 64  # records per group commit (the archiver's batch is up to 256 per stream)
    data = encode(trajectory())
    raw, logged = [], []
    with tempfile.TemporaryDirectory(prefix="reel-bench-log-", dir=os.environ.get("REEL_BENCH_DIR")) as tmp:
        for r in range(rounds):
            raw.append(_raw_write(Path(tmp) / f"raw{r}", data, per_batch, batches))
            logged.append(_log_append(Path(tmp) / f"log{r}", data, per_batch, batches))
    total = len(data) * per_batch * batches
    print_json({
        "bench": "log", "bytes_per_round": total, "record_bytes": len(data), "records_per_fdatasync": per_batch,
        "rounds": rounds, "raw_mb_per_s": round(max(raw) / 1e6, 1), "log_mb_per_s": round(max(logged) / 1e6, 1),
        "ratio": round(max(logged) / max(raw), 3),
    })
    return 0


def _raw_write(path: Path, data: bytes, per_batch: int, batches: int) -> float:
    block = data * per_batch
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        start = time.perf_counter()
        for _ in range(batches):
            os.write(fd, block)
            os.fdatasync(fd)
        return len(block) * batches / (time.perf_counter() - start)
    finally:
        os.close(fd)
        path.unlink()


def _log_append(directory: Path, data: bytes, per_batch: int, batches: int) -> float:
    try:
        with StreamLog(directory) as log:
            start = time.perf_counter()
            for b in range(batches):
                log.append_batch([(f"{b + 1}-{i}", data) for i in range(per_batch)])
            return len(data) * per_batch * batches / (time.perf_counter() - start)
    finally:
        shutil.rmtree(directory)
