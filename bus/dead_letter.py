"""Dead letters from plain readers: an entry a watcher (no consumer group) read but could not use.

A consumer group dead-letters with `GroupConsumer.dead_letter` (and acks). A rollout worker follows
the weights stream with a plain XREAD (bus/tail.py), so when a version it read cannot be loaded (a
shard missing or corrupted) it records the entry here, in the same dead-letter stream and with the
same fields, `group` left empty: there is nothing to ack, the entry stays for the other readers.
"""

from __future__ import annotations

import logging

import redis.asyncio

from reel.bus.events import AnyEvent, encode
from reel.bus.partitions import lane_key, slot_key
from reel.bus.streams import DEAD, boundary

__all__ = ["dead_letter_read"]

log = logging.getLogger("reel.bus")


async def dead_letter_read(client: redis.asyncio.Redis, run: str, lane: str, entry_id: str, event: AnyEvent,
                           reason: str, reader: str) -> None:
    """Adds the entry `entry_id` of `lane` (as Tail.read names it) to the run's dead letters with `reason`."""
    key = lane_key(run, lane)
    dead_key = slot_key(key, DEAD)
    with boundary(client, f"dead-lettering {entry_id} of {key} to {dead_key}"):
        await client.xadd(dead_key, {"stream": lane, "entry_id": entry_id, "raw": encode(event), "reason": reason,
                                     "group": "", "consumer": reader})
    log.warning("dead letter: %s %s of run %s: %s", lane, entry_id, run, reason)
