"""A restarted producer's next seq: never one it used, even when Redis lost its last second.

Redis persists with AOF `appendfsync everysec`, so a crash can bring it back without its last
second of writes, the producers' seq marks included, while the archiver had already logged some
of those events. The next seq is therefore 1 + the highest seq found on the bus or in the log.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from pathlib import Path

import msgspec
import redis.asyncio

from reel.bus.log import LogError
from reel.bus.run_log import RunLog
from reel.bus.streams import recover_next_seq

__all__ = ["recover_seq", "next_seq_in_log"]


class _Key(msgspec.Struct):
    producer: str
    seq: int


_key_decoder = msgspec.msgpack.Decoder(_Key)


async def recover_seq(redis: redis.asyncio.Redis, run_dir: Path, run: str, producer: str,
                      streams: Iterable[str], partitions: int = 1) -> int:
    """max(next seq on the bus, next seq in the log's `streams`, those `producer` publishes on)."""
    on_bus = await recover_next_seq(redis, run, producer, partitions)
    in_log = await asyncio.to_thread(next_seq_in_log, run_dir, producer, tuple(streams))
    return max(on_bus, in_log)


def next_seq_in_log(run_dir: Path, producer: str, streams: Iterable[str]) -> int:
    """1 + the highest seq of `producer` in the run's on-disk log (0 if none)."""
    try:
        run_log = RunLog(run_dir, readonly=True)
    except LogError:
        return 0  # no log yet
    best = -1
    try:
        for stream in set(streams) & set(run_log.names()):
            for record in run_log.stream(stream).records():
                key = _key_decoder.decode(record.data)
                if key.producer == producer:
                    best = max(best, key.seq)
    finally:
        run_log.close()
    return best + 1
