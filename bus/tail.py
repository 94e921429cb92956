"""Watchers: plain XREAD over a run's streams, no consumer group, so any number can attach
without touching what the trainer or the archiver read."""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio

from reel.bus.cluster import SlotReader, is_cluster
from reel.bus.dead_letter import dead_letter_key, queue_dead_letter
from reel.bus.events import AnyEvent, MalformedEvent, decode, encode
from reel.bus.partitions import lane_key, lanes
from reel.bus.redis_boundary import FIELD, READ_MARGIN_S, as_str, by_stream, connect, ride_out

__all__ = ["Tail", "dead_letter_read"]

log = logging.getLogger(__name__)


class Tail:
    """A watcher: plain XREAD from "0" (everything), "$" (what arrives after the first read()
    starts) or an entry id (what follows it); any number of tails can attach. Entries that do not
    decode are skipped with a warning (consumer groups dead-letter them). A split stream is
    followed on all of its lanes (bus/partitions.py); what read() returns names the lane."""

    def __init__(self, url: str, run: str, streams: list[str], start: str = "0", partitions: int = 1):
        self.url = url
        self.run = run
        self._name = {lane_key(run, lane): lane for lane in lanes(streams, partitions)}
        self._cursor = {key: start for key in self._name}  # key -> last entry id read
        self._redis: redis.asyncio.Redis | None = None
        self._timeout = 0.0  # socket timeout of _redis; must exceed BLOCK
        self._slots: SlotReader | None = None  # one XREAD per cluster slot

    async def __aenter__(self) -> Tail:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        client, self._redis = self._redis, None
        if client is not None:
            await asyncio.shield(client.aclose())

    async def read(self, count: int = 100, block_ms: int = 1000) -> list[tuple[str, str, AnyEvent]]:
        """Up to `count` entries per stream, (stream, entry_id, event); block_ms = 0: do not block."""
        client = await self._client(block_ms)
        if "$" in self._cursor.values():
            await self._resolve_now(client)
        # A plain XREAD from a cursor may be repeated: it rides out a Redis pause (bus/redis_boundary.py).
        reply = await ride_out(client, f"XREAD on {', '.join(self._cursor)}", lambda: self._slots.read(
            lambda some, block: client.xread(some, count=count, block=block), dict(self._cursor), block_ms or None))
        out = []
        for key, entries in by_stream(reply):
            for entry_id, fields in entries:
                self._cursor[key] = entry_id = as_str(entry_id)
                try:
                    out.append((self._name[key], entry_id, decode(fields.get(FIELD, b""))))
                except MalformedEvent as exc:
                    log.warning("tail of run %s skips %s %s: %s", self.run, key, entry_id, exc)
        return out

    async def _client(self, block_ms: int) -> redis.asyncio.Redis:
        timeout = block_ms / 1000 + READ_MARGIN_S
        if self._redis is None or self._timeout < timeout:
            await self.close()
            self._redis, self._timeout = connect(self.url, socket_timeout=timeout, retries=2), timeout
            self._slots = SlotReader(is_cluster(self._redis))
        return self._redis

    async def _resolve_now(self, client: redis.asyncio.Redis) -> None:
        """Pin "$" to each stream's last entry, so nothing added between two reads is missed."""
        keys = [key for key, cursor in self._cursor.items() if cursor == "$"]

        async def attempt() -> list:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.xrevrange(key, count=1)
            return await pipe.execute()

        lasts = await ride_out(client, f"XREVRANGE on {', '.join(keys)}", attempt)
        for key, last in zip(keys, lasts):
            self._cursor[key] = as_str(last[0][0]) if last else "0-0"


async def dead_letter_read(client: redis.asyncio.Redis, run: str, lane: str, entry_id: str, event: AnyEvent,
                           reason: str, reader: str) -> None:
    """Dead-letters the entry `entry_id` of `lane` (as Tail.read names it) that `reader` could not use.

    A rollout worker follows the weights stream with a Tail, so a version it read but cannot load (a
    shard missing or corrupted) is recorded here with no group: there is nothing to ack, and the entry
    stays for the other readers."""
    key = lane_key(run, lane)

    async def attempt() -> None:
        pipe = client.pipeline(transaction=False)
        queue_dead_letter(pipe, key, run=run, stream=lane, entry_id=entry_id, raw=encode(event), reason=reason,
                          group="", consumer=reader)
        await pipe.execute()

    await ride_out(client, f"dead-lettering {entry_id} of {key} to {dead_letter_key(key)}", attempt)
