"""Which training draws a rollout worker makes, so an env that walks a dataset in epochs
(Env.counts_draws, producers/envs/dataset.py) gives the same rows at the same draws after a resume.

Draw n of the run belongs to worker n mod W (W = rollout.workers), so the workers between them take
every index once and, as the async gate keeps them in step, walk each epoch together. A worker's
draws are in the meta of its Trajectories (`draw`): published (the log, and the bus for what the
archiver has not logged yet) or dead-lettered (a failed reward: that row had its turn). A restarted
worker first makes the draws of its own that are nowhere (groups abandoned when it stopped), in
order, then goes on after its newest.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec
import redis.asyncio

from reel.bus.log import LogError
from reel.bus.run_log import RunLog
from reel.bus.partitions import lane_key, lane_of, slot_key
from reel.bus.streams import DEAD, FIELD

__all__ = ["Draws", "recover_draws"]


class _Head(msgspec.Struct):
    """The fields of a Trajectory this needs (its samples are not decoded)."""

    type: str
    producer: str
    meta: dict[str, Any] = {}


_head = msgspec.msgpack.Decoder(_Head)


class Draws:
    """The next draw indices of worker `worker` of `workers`, given the ones it already made."""

    def __init__(self, worker: int, workers: int, made: Iterable[int] = ()):
        mine = {n for n in made if n % workers == worker}
        newest = max(mine, default=worker - workers)
        self._missing = [n for n in range(worker, newest, workers) if n not in mine]
        self._next = newest + workers
        self._workers = workers

    def next(self) -> int:
        if self._missing:
            return self._missing.pop(0)
        n, self._next = self._next, self._next + self._workers
        return n


async def recover_draws(client: redis.asyncio.Redis, run_dir: Path, run: str, producer: str,
                        partition: int | None) -> set[int]:
    """The draw indices in `producer`'s Trajectories: in the run's log, on its bus lane, dead-lettered."""
    made = await asyncio.to_thread(_logged_draws, run_dir, producer)
    key = lane_key(run, lane_of("trajectories", partition))
    raw = [fields.get(FIELD) for _, fields in await client.xrange(key)]
    raw += [fields.get(b"raw") for _, fields in await client.xrange(slot_key(key, DEAD))]
    return made | _draws((data for data in raw if data is not None), producer)


def _logged_draws(run_dir: Path, producer: str) -> set[int]:
    try:
        with RunLog(run_dir, readonly=True) as log:
            if "trajectories" not in log.names():
                return set()
            return _draws((record.data for record in log.stream("trajectories").records()), producer)
    except LogError:
        return set()  # no log yet


def _draws(entries: Iterable[bytes], producer: str) -> set[int]:
    """Draws of `producer`'s trajectories among encoded events; anything else (or undecodable) is skipped."""
    made = set()
    for data in entries:
        try:
            head = _head.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        draw = head.meta.get("draw")
        if head.type == "trajectory" and head.producer == producer and isinstance(draw, int):
            made.add(draw)
    return made


def group_seed(run_seed: int, worker: int, seq_base: int, counter: int) -> int:
    """A 63-bit seed for one group's prompt and samples (sample i uses seed + i)."""
    digest = hashlib.sha256(f"reel-group:{run_seed}:{worker}:{seq_base}:{counter}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2
