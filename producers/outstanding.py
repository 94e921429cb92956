"""What a restarted rollout worker already has in the trainer's queue.

A worker stopped with `async_level` rounds published but not yet trained leaves them on the bus,
and the trainer reads them first when the run resumes. The async gate (producers/rollout.py)
must count them as this process's first groups: a worker that started a fresh round on top of
them would keep one batch more queued for the rest of the run, so every step would train tokens
one version staler than `async_level` allows.

The count is taken against one snapshot of the commits: groups of this worker that the trainer
still has to read (pending for its group or not yet delivered) and that no commit up to version
c has trained or dropped. Entries are read before commits, so a commit landing in between is
seen with its groups (never counting a trained group, which could stall a synchronous gate).
A group the trainer has announced as dropped (GroupsDropped) for a step after c is still counted:
the gate takes it off as replaced (producers/async_gate.py), and taking it off here too would count
its replacement twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from pathlib import Path

import msgspec
import redis.asyncio

from reel.bus.events import MalformedEvent, StepCommitted, decode
from reel.bus.log import LogError
from reel.bus.run_log import RunLog
from reel.bus.partitions import lane_key, lane_of
from reel.bus.streams import FIELD
from reel.bus.trust import wrong_producer

__all__ = ["Outstanding", "outstanding_groups"]

TRAINER_GROUP = "trainer"


class Outstanding(msgspec.Struct, frozen=True):
    version: int  # c: the newest committed policy version of the snapshot (0 before any commit)
    groups: int  # this worker's published groups that no commit up to `version` lists


class _Head(msgspec.Struct):
    """The fields of an event this count needs (the rest of a Trajectory is not decoded)."""

    type: str
    producer: str
    group_id: str = ""


_head = msgspec.msgpack.Decoder(_Head)


async def outstanding_groups(redis_client: redis.asyncio.Redis, run_dir: Path, run: str, producer: str,
                             partition: int | None) -> Outstanding:
    """Groups `producer` published (on its `partition`) that the trainer will still train or drop."""
    key = lane_key(run, lane_of("trajectories", partition))
    queued = [h.group_id for h in await _unread_by_trainer(redis_client, key)
              if h.type == "trajectory" and h.producer == producer]
    commits = await asyncio.to_thread(_logged_commits, run_dir)
    for _, fields in await redis_client.xrange(lane_key(run, "steps")):
        try:
            event = decode(fields[FIELD])
        except (KeyError, MalformedEvent):  # not a Publisher's entry: the archiver dead-letters it
            continue
        if isinstance(event, StepCommitted) and wrong_producer(event, run) is None:
            commits.append(event)
    done = {g for c in commits for g in c.groups} | {d.group_id for c in commits for d in c.dropped}
    return Outstanding(version=max((c.version for c in commits), default=0),
                       groups=sum(1 for g in queued if g not in done))


async def _unread_by_trainer(redis_client: redis.asyncio.Redis, key: str) -> list[_Head]:
    """Entries of `key` the trainer's group has pending or not yet delivered (all, before it exists)."""
    entries = await redis_client.xrange(key)
    if not entries:
        return []
    groups = {g["name"]: g for g in await redis_client.xinfo_groups(key)}
    trainer = groups.get(TRAINER_GROUP.encode()) or groups.get(TRAINER_GROUP)
    if trainer is None:
        return _heads(fields for _, fields in entries)
    last = _entry_id(trainer["last-delivered-id"])
    pending = {_entry_id(p["message_id"]) for p in await redis_client.xpending_range(
        key, TRAINER_GROUP, min="-", max="+", count=max(1, int(trainer["pending"])))}
    return _heads(fields for entry_id, fields in entries if _entry_id(entry_id) > last or _entry_id(entry_id) in pending)


def _heads(entries: Iterable[dict]) -> list[_Head]:
    """The entries that decode; anything else was not written by a Publisher (the trainer dead-letters
    it), so it is no group of this worker's."""
    heads = []
    for fields in entries:
        try:
            heads.append(_head.decode(fields[FIELD]))
        except (KeyError, msgspec.DecodeError, msgspec.ValidationError):
            continue
    return heads


def _entry_id(raw: bytes | str) -> tuple[int, int]:
    ms, _, seq = (raw.decode() if isinstance(raw, bytes) else raw).partition("-")
    return int(ms), int(seq or 0)


def _logged_commits(run_dir: Path) -> list[StepCommitted]:
    try:
        with RunLog(run_dir, readonly=True) as run_log:
            if "steps" not in run_log.names():
                return []
            return [e for _, e in run_log.events("steps") if isinstance(e, StepCommitted)]
    except LogError:
        return []  # no log yet
