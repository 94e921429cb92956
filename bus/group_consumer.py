"""A consumer of a consumer group: the trainer's reader (the archiver has its own, consumers/archiver.py).

Entries come from the run's lanes (bus/partitions.py); an entry has one field FIELD = the encoded
event. Redis's blocking `XREADGROUP >` is never retried (bus/redis_boundary.py says why): after a
lost reply the next read() walks this consumer's pending list again. Every other command rides
out a short Redis pause (redis_boundary.ride_out); re-reading is harmless, and an XACK or a
dead letter repeated after a lost reply changes nothing a reader sees twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

import msgspec
import redis.asyncio
from redis.exceptions import ResponseError

from reel.bus.cluster import SlotReader, is_cluster
from reel.bus.dead_letter import dead_letter_key, queue_dead_letter
from reel.bus.events import AnyEvent, MalformedEvent, decode, encode, event_key
from reel.bus.partitions import lane_key, lanes
from reel.bus.redis_boundary import (FIELD, READ_MARGIN_S, BusError, as_str, boundary, by_stream, connect, no_answer,
                                     ride_out)
from reel.bus.trust import SeqMarks, wrong_producer

__all__ = ["Delivery", "GroupConsumer"]

log = logging.getLogger(__name__)
_Raw = tuple[str, str, "dict | None", int]  # (stream, entry id, fields, deliveries) as read
_DEDUPE_KEYS = 1 << 20  # (producer, seq) keys a consumer remembers


class Delivery(msgspec.Struct, frozen=True):
    stream: str  # lane (bus/partitions.py): short name, e.g. "trajectories", or "trajectories/2"
    entry_id: str
    event: AnyEvent
    deliveries: int  # times Redis has delivered this entry to the group, this one included


class GroupConsumer:
    """One consumer of a consumer group over some of a run's streams.

    read() returns, in order of priority: this consumer's own pending entries (left by a previous
    process under the same consumer name, or by a lost reply; re-reading them is not a delivery, so
    restarts never count towards max_deliveries), entries idle longer than claim_idle_ms in any consumer
    of the group (XAUTOCLAIM; so claim_idle_ms must exceed the longest processing time), then new
    entries (blocking up to block_ms; 0 = do not block). Every delivery must be acked, failed or
    dead-lettered; a failed one comes back after claim_idle_ms. An entry delivered more than
    max_deliveries times, or one that does not decode, goes to the dead-letter stream instead.
    With `partitions` > 1 a split stream is read on all of its lanes (bus/partitions.py).
    """

    def __init__(self, url: str, run: str, group: str, consumer: str, streams: list[str], *,
                 block_ms: int = 1000, claim_idle_ms: int = 30_000, max_deliveries: int = 5,
                 partitions: int = 1):
        # what to read
        self.url = url
        self.run = run
        self.group = group
        self.consumer = consumer
        self.streams = lanes(streams, partitions)
        self.block_ms = block_ms
        self.claim_idle_ms = claim_idle_ms
        self.max_deliveries = max_deliveries
        self._key = {stream: lane_key(run, stream) for stream in self.streams}
        self._name = {key: stream for stream, key in self._key.items()}
        # set by start()
        self._redis: redis.asyncio.Redis | None = None  # acks, claims, dead letters
        self._reader: redis.asyncio.Redis | None = None  # blocking XREADGROUP only
        self._slots: SlotReader | None = None  # one XREADGROUP per cluster slot
        # read state
        self._history: dict[str, str] = {}  # stream -> cursor through our own pending entries
        self._claim_from: dict[str, str] = {}  # stream -> XAUTOCLAIM cursor
        self._next_claim = 0.0  # monotonic time of the next XAUTOCLAIM round
        self._seen: OrderedDict[tuple[str, int], tuple[str, int]] = OrderedDict()  # (producer, seq) -> (entry id,
        # hash of its bytes): a second entry of the same key is a repeat only with the same bytes
        self._marks = SeqMarks(run, partitions)  # producers' published ranges (bus/trust.py)
        self._failures: dict[str, str] = {}  # entry id -> last reason given to fail()
        self._handed: set[str] = set()  # entry ids handed out by this process, not yet acked or failed

    async def __aenter__(self) -> GroupConsumer:
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Create the group on each stream if missing (from the start, MKSTREAM); open connections."""
        self._redis = connect(self.url, retries=2)
        # No retries here: a retried XREADGROUP ">" would strand the entries of the lost reply.
        self._reader = connect(self.url, socket_timeout=self.block_ms / 1000 + READ_MARGIN_S)
        self._slots = SlotReader(is_cluster(self._reader))
        for key in self._key.values():
            await ride_out(self._redis, f"XGROUP CREATE {self.group} on {key}", lambda key=key: self._create(key))
        self._history = {stream: "-" for stream in self.streams}
        self._claim_from = {stream: "0-0" for stream in self.streams}

    async def _create(self, key: str) -> None:
        try:
            await self._redis.xgroup_create(key, self.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def close(self) -> None:
        clients = [c for c in (self._redis, self._reader) if c is not None]
        self._redis = self._reader = None
        await asyncio.shield(asyncio.gather(*(c.aclose() for c in clients)))

    async def read(self, count: int = 100) -> list[Delivery]:
        if self._redis is None:
            raise RuntimeError("GroupConsumer.read() called before start()")
        raw: list[_Raw] = []
        while self._history and not raw:
            raw = await self._read_history(count)
        if not raw and time.monotonic() >= self._next_claim:
            raw = await self._claim(count)
        if not raw:
            raw = await self._read_new(count)
        return await self._accept(raw)

    async def ack(self, deliveries: list[Delivery]) -> None:
        await self._ack([(d.stream, d.entry_id) for d in deliveries])

    async def fail(self, delivery: Delivery, reason: str) -> None:
        """Processing failed: retry after claim_idle_ms, or dead-letter once out of deliveries."""
        if delivery.deliveries >= self.max_deliveries:
            await self.dead_letter(delivery, f"failed {delivery.deliveries} times, last: {reason}")
        else:
            self._failures[delivery.entry_id] = reason
            self._handed.discard(delivery.entry_id)

    async def dead_letter(self, delivery: Delivery, reason: str) -> None:
        await self._dead(delivery.stream, delivery.entry_id, encode(delivery.event), reason)

    async def _read_history(self, count: int) -> list[_Raw]:
        """Our own pending entries, skipping those this process holds already.

        XPENDING + XRANGE rather than XREADGROUP from 0: Redis counts the latter as one more
        delivery, and a trainer restarted five times would dead-letter a healthy pending group."""
        streams = list(self._history)
        replies = await self._pipelined(
            f"XPENDING (own) on {', '.join(self._key[s] for s in streams)}",
            lambda pipe: [pipe.xpending_range(self._key[stream], self.group, min=self._history[stream], max="+",
                                              count=count, consumername=self.consumer) for stream in streams])
        pending = []
        for stream, reply in zip(streams, replies):
            if not reply:
                del self._history[stream]
                continue
            self._history[stream] = "(" + as_str(reply[-1]["message_id"])
            pending += [(stream, as_str(p["message_id"]), p["times_delivered"]) for p in reply
                        if as_str(p["message_id"]) not in self._handed]
        if not pending:
            return []
        bodies = await self._pipelined(
            f"XRANGE (own pending) on {', '.join(self._key[s] for s in streams)}",
            lambda pipe: [pipe.xrange(self._key[stream], min=entry_id, max=entry_id, count=1)
                          for stream, entry_id, _ in pending])
        # An entry deleted while pending has no body: None, acked by _accept.
        return [(stream, entry_id, body[0][1] if body else None, n)
                for (stream, entry_id, n), body in zip(pending, bodies)]

    async def _claim(self, count: int) -> list[_Raw]:
        self._next_claim = time.monotonic() + self.claim_idle_ms / 2000
        replies = await self._pipelined(
            f"XAUTOCLAIM on {', '.join(self._key.values())}",
            lambda pipe: [pipe.xautoclaim(self._key[stream], self.group, self.consumer, self.claim_idle_ms,
                                          start_id=self._claim_from[stream], count=count) for stream in self.streams])
        got = []
        for stream, reply in zip(self.streams, replies):
            # Redis 7 replies [cursor, entries, deleted ids] and drops deleted entries from the
            # pending list; 6.2 replies [cursor, entries] with None for a deleted entry.
            self._claim_from[stream] = as_str(reply[0])
            got += [(stream, as_str(entry_id), fields) for entry_id, fields in reply[1] if entry_id is not None]
        return [(*item, n) for item, n in zip(got, await self._delivery_counts(got))]

    async def _read_new(self, count: int) -> list[_Raw]:
        ids = {key: ">" for key in self._key.values()}
        try:
            with boundary(self._reader, f"XREADGROUP on {', '.join(ids)}"):
                reply = await self._slots.read(
                    lambda some, block: self._reader.xreadgroup(self.group, self.consumer, some, count=count,
                                                                block=block),
                    ids, self.block_ms or None)
        except BusError as exc:
            if not no_answer(exc):
                raise
            # Redis may have delivered entries whose reply we lost: they are in our pending list now.
            log.warning("%s; reading our pending entries again", exc)
            self._history = {stream: "-" for stream in self.streams}
            return []
        return [(self._name[key], as_str(entry_id), fields, 1)
                for key, entries in by_stream(reply) for entry_id, fields in entries]

    async def _delivery_counts(self, items: list[tuple[str, str, dict | None]]) -> list[int]:
        if not items:
            return []
        replies = await self._pipelined(
            f"XPENDING on {', '.join(self._key.values())}",
            lambda pipe: [pipe.xpending_range(self._key[stream], self.group, min=entry_id, max=entry_id, count=1,
                                              consumername=self.consumer) for stream, entry_id, _ in items])
        return [reply[0]["times_delivered"] if reply else 1 for reply in replies]

    async def _accept(self, raw: list[_Raw]) -> list[Delivery]:
        out: list[Delivery] = []
        skip: list[tuple[str, str]] = []  # duplicates and entries deleted while pending
        decoded: list[tuple[str, str, bytes, AnyEvent, int]] = []
        for stream, entry_id, fields, deliveries in raw:
            if not fields:
                skip.append((stream, entry_id))
                continue
            data = fields.get(FIELD)
            try:
                if data is None:
                    raise MalformedEvent(f"entry has no '{FIELD.decode()}' field")
                decoded.append((stream, entry_id, data, decode(data), deliveries))
            except MalformedEvent as exc:
                raw_bytes = data or msgspec.msgpack.encode(fields)
                await self._dead(stream, entry_id, raw_bytes, f"undecodable: {exc}")
        await self._refresh_marks(decoded)
        for stream, entry_id, data, event, deliveries in decoded:
            if deliveries > self.max_deliveries:
                last = self._failures.get(entry_id)
                await self._dead(stream, entry_id, data, f"delivered {deliveries} times (max_deliveries="
                                 f"{self.max_deliveries})" + (f", last failure: {last}" if last else ""))
                continue
            key = event_key(event)
            seen_id, seen_digest = self._seen.get(key, (entry_id, hash(data)))
            untrusted = wrong_producer(event, self.run) or self._marks.problem(event)
            if untrusted is None and seen_digest != hash(data):
                untrusted = f"seq {event.seq} of {event.producer} was already used by entry {seen_id}, with other bytes"
            if untrusted is not None:
                await self._dead(stream, entry_id, data, f"untrusted: {untrusted}")
                continue
            if seen_id != entry_id:
                skip.append((stream, entry_id))
                continue
            self._seen[key] = (entry_id, hash(data))
            self._seen.move_to_end(key)
            self._handed.add(entry_id)
            if len(self._seen) > _DEDUPE_KEYS:
                self._seen.popitem(last=False)
            out.append(Delivery(stream, entry_id, event, deliveries))
        await self._ack(skip)
        return out

    async def _refresh_marks(self, decoded: list[tuple[str, str, bytes, AnyEvent, int]]) -> None:
        await self._marks.refresh(self._redis, ((e.producer, e.seq) for _, _, _, e, _ in decoded))

    async def _ack(self, items: list[tuple[str, str]]) -> None:
        if not items:
            return
        by_stream: dict[str, list[str]] = {}
        for stream, entry_id in items:
            by_stream.setdefault(stream, []).append(entry_id)
            self._failures.pop(entry_id, None)
            self._handed.discard(entry_id)
        await self._pipelined(f"XACK on {', '.join(self._key[s] for s in by_stream)}",
                              lambda pipe: [pipe.xack(self._key[stream], self.group, *entry_ids)
                                            for stream, entry_ids in by_stream.items()])

    async def _dead(self, stream: str, entry_id: str, raw: bytes, reason: str) -> None:
        """Move an entry to the dead-letter stream and ack it, atomically (the lane's slot)."""
        key = self._key[stream]

        def queue(pipe: redis.asyncio.client.Pipeline) -> None:
            queue_dead_letter(pipe, key, run=self.run, stream=stream, entry_id=entry_id, raw=raw, reason=reason,
                              group=self.group, consumer=self.consumer)
            pipe.xack(key, self.group, entry_id)

        await self._pipelined(f"dead-lettering {entry_id} of {key} to {dead_letter_key(key)}", queue,
                              transaction=True)
        self._failures.pop(entry_id, None)
        self._handed.discard(entry_id)

    async def _pipelined(self, what: str, queue: Callable[[redis.asyncio.client.Pipeline], object], *,
                         transaction: bool = False) -> list:
        """One pipeline of the commands `queue` adds, riding out a Redis pause (built afresh each try)."""

        async def attempt() -> list:
            pipe = self._redis.pipeline(transaction=transaction)
            queue(pipe)
            return await pipe.execute()

        return await ride_out(self._redis, what, attempt)
