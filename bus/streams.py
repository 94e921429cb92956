"""Redis Streams: publisher, consumer groups, recovery, dead letters, safe trimming (watchers: bus/tail.py).

An entry has one field `e` = reel.bus.events.encode(event), at lane_key(run, lane) (bus/partitions.py:
stream_key(run, name) unless the stream is split into partitions). Needs Redis >= 6.2
(XAUTOCLAIM, XTRIM MINID, exclusive ranges) and nothing newer.

    ReelError
     └── BusError    a Redis command failed; the message names the server and the stream

Retries: `connect` turns off redis-py's automatic retries (10 in redis-py 8) because a retried
pipeline re-sends its XADDs after a lost reply. A consumer's blocking `XREADGROUP >` is not retried
either: a lost reply has already moved entries into the consumer's pending list, and a silent retry
would read past them; instead the next read() walks that pending list again (XPENDING + XRANGE,
which Redis does not count as deliveries) and hands out what this process has not. The other
consumer commands keep a few retries (re-reading is harmless). A blocking reader has its own
connection whose socket timeout exceeds BLOCK, so a quiet stream is not a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, TypeVar
from urllib.parse import urlsplit

import msgspec
import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.exceptions import ConnectionError, RedisError, ResponseError, TimeoutError

from reel.bus.cluster import SlotReader, cluster_client, cluster_from_env, is_cluster
from reel.bus.dead_letter import DEAD, dead_letter_key, queue_dead_letter
from reel.bus.errors import ReelError
from reel.bus.events import STREAM_OF, STREAMS, AnyEvent, Event, MalformedEvent, decode, encode, event_key
from reel.bus.partitions import lane_key, lane_of, lanes, seq_keys, slot_key
from reel.bus.trust import SEQ_MARKS, SeqMarks, wrong_producer

__all__ = ["BusError", "connect", "Publisher", "recover_next_seq", "Delivery", "GroupConsumer", "safe_trim",
           "DEAD", "FIELD", "dead_letters_added", "try_stamp"]

log = logging.getLogger(__name__)
E = TypeVar("E", bound=Event)
_Raw = tuple[str, str, "dict | None", int]  # (stream, entry id, fields, deliveries) as read

_SEQ = SEQ_MARKS  # sorted set per slot, slot_key(<key>, _SEQ): producer -> highest seq it has published there
FIELD = b"e"  # the one field of an entry: the encoded event
READ_MARGIN_S = 10.0  # a blocking reader's socket timeout = BLOCK + this
_DEDUPE_KEYS = 1 << 20  # (producer, seq) keys a consumer remembers
_SCAN = 512  # entries per XREVRANGE when recovering a producer's seq
_encoder = msgspec.msgpack.Encoder()  # reel.bus.events.encode's settings, for encode_into


class BusError(ReelError):
    """A Redis command failed; the message names the server and the stream or operation."""


def connect(url: str, *, socket_timeout: float | None = 5.0, retries: int = 0,
            cluster: bool | None = None) -> redis.asyncio.Redis:
    """A client for redis://, rediss:// (TLS), unix:// URLs, with user:password for ACLs.

    No retries by default: see the module docstring. Connecting is lazy; the first command that
    cannot reach the server raises BusError naming it. `cluster` (default: REEL_BUS_CLUSTER=1)
    gives redis-py's cluster client, which follows MOVED; `url` then names any node.
    """
    backoff = ExponentialWithJitterBackoff(base=0.05, cap=1.0) if retries else NoBackoff()
    try:
        if cluster_from_env() if cluster is None else cluster:
            return cluster_client(url, socket_timeout=socket_timeout, retry=Retry(backoff, retries))
        return redis.asyncio.from_url(url, socket_timeout=socket_timeout, socket_connect_timeout=5.0,
                                      retry=Retry(backoff, retries))
    except ValueError as exc:
        raise BusError(f"bad Redis URL {_redact(url)}: {exc}") from exc


def _redact(url: str) -> str:
    parts = urlsplit(url)
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()


def _where(client: redis.asyncio.Redis) -> str:
    if is_cluster(client):
        return f"Redis Cluster via {', '.join(client.nodes_manager.startup_nodes)}"
    kwargs = client.connection_pool.connection_kwargs
    if "path" in kwargs:
        return f"Redis at unix:{kwargs['path']}"
    return f"Redis at {kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"


@contextlib.contextmanager
def boundary(client: redis.asyncio.Redis, what: str) -> Iterator[None]:
    """Turns redis-py and socket errors into BusError; cancellation passes through untouched."""
    try:
        yield
    except (RedisError, OSError) as exc:
        raise BusError(f"{_where(client)}: {what} failed ({type(exc).__name__}: {exc})") from exc


def as_str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def by_stream(reply: list | None) -> Iterator[tuple[str, list]]:
    """(key, entries) from an XREAD/XREADGROUP reply (RESP2, the protocol `connect` speaks)."""
    for key, entries in reply or ():
        yield as_str(key), entries


class Publisher:
    """Stamps events with (run, producer, seq) and XADDs them, one round trip per batch."""

    def __init__(self, redis: redis.asyncio.Redis, run: str, producer: str, next_seq: int = 0,
                 partition: int | None = None):
        self.redis = redis
        self.run = run
        self.producer = producer
        self.next_seq = next_seq  # never reused: recover it with recover_next_seq after a restart
        self.partition = partition  # of the split streams (bus/partitions.py); None: not split
        self._spare: bytearray | None = None  # encoding buffer, back after each successful batch

    def stamp(self, cls: type[E], **fields: Any) -> E:
        event = cls(run=self.run, producer=self.producer, seq=self.next_seq, **fields)
        self.next_seq += 1
        return event

    async def publish(self, events: list[Event]) -> list[str]:
        """XADD each event to its stream in one pipelined round trip; returns the entry ids."""
        return await self._send(events, transaction=False)

    async def publish_atomic(self, events: list[Event]) -> list[str]:
        """Like publish, in MULTI/EXEC: readers see all of the events or none."""
        return await self._send(events, transaction=True)

    async def dead_letter(self, event: Event, reason: str) -> None:
        """File an event this producer refuses to publish in the dead-letter stream beside its lane,
        with why (same fields as GroupConsumer's dead letters; entry_id "": it never reached its stream)."""
        stream = STREAM_OF[type(event)]
        key = lane_key(self.run, lane_of(stream, self.partition))
        pipe = self.redis.pipeline(transaction=False)
        queue_dead_letter(pipe, key, run=self.run, stream=stream, entry_id="", raw=encode(event), reason=reason,
                          group="", consumer=self.producer)
        with boundary(self.redis, f"dead-lettering {stream} event {self.producer}#{event.seq} to "
                                  f"{dead_letter_key(key)}"):
            await pipe.execute()

    async def _send(self, events: list[Event], *, transaction: bool) -> list[str]:
        if not events:
            return []
        marks: dict[str, int] = {}
        for event in events:
            marks[event.producer] = max(marks.get(event.producer, -1), event.seq)
        keys = [lane_key(self.run, lane_of(STREAM_OF[type(event)], self.partition)) for event in events]
        # One buffer, reused from batch to batch: a new bytes object per event would be memory the
        # allocator handed back to the kernel since the last batch, one page fault per 4 KB. It is
        # reused only once Redis has answered every command (so it has read every byte); a batch
        # that fails, or one published while another is in flight, gets a buffer of its own.
        buffer, self._spare = self._spare or bytearray(), None
        try:
            ends = _encode_into(events, buffer)
        except BufferError:  # the transport still holds a view of the last batch (all of it sent)
            buffer = bytearray()
            ends = _encode_into(events, buffer)
        data = memoryview(buffer)
        pipe = self.redis.pipeline(transaction=transaction)
        # The seq high-water mark goes first, so a batch cut short makes a restart skip seqs rather
        # than reuse one; GT (Redis 6.2) keeps it monotonic when batches land out of order. It sits
        # in the first event's slot, so a MULTI/EXEC on one partition stays in one cluster slot.
        pipe.zadd(slot_key(keys[0], _SEQ), marks, gt=True)
        for key, start, end in zip(keys, [0, *ends], ends):
            pipe.xadd(key, {FIELD: data[start:end]})
        with boundary(self.redis, f"XADD of {len(events)} events to {', '.join(sorted(set(keys)))}"):
            ids = [as_str(entry_id) for entry_id in (await pipe.execute())[1:]]
        self._spare = buffer
        return ids


def _encode_into(events: list[Event], buffer: bytearray) -> list[int]:
    """Encode events back to back into `buffer` (which keeps its allocation); their end offsets."""
    ends = []
    for event in events:
        _encoder.encode_into(event, buffer, -1 if ends else 0)
        ends.append(len(buffer))
    return ends


class _Stamp(msgspec.Struct):
    """The idempotency key of an encoded event; decoding skips every other field."""

    producer: str
    seq: int


_stamp_decoder = msgspec.msgpack.Decoder(_Stamp)


async def dead_letters_added(redis: redis.asyncio.Redis, run: str, partitions: int = 1) -> int:
    """Entries ever added to the run's dead-letter streams (one per slot): XINFO's entries-added
    (Redis 7), which trimming does not lower, else XLEN (Reel never trims a dead-letter stream)."""
    total = 0
    for key in seq_keys(run, DEAD, partitions):
        with boundary(redis, f"XINFO STREAM on {key}"):
            if await redis.exists(key):
                info = await redis.xinfo_stream(key)
                total += int(info.get("entries-added", info["length"]))
    return total


async def recover_next_seq(redis: redis.asyncio.Redis, run: str, producer: str, partitions: int = 1) -> int:
    """1 + the highest seq `producer` published in the run (0 if none).

    Publisher records each producer's high-water mark next to the streams (one mark per slot it
    wrote to), so trimming cannot make a seq reusable; for a producer without a mark, each stream
    is scanned back to its latest entry.
    """
    marks = []
    for mark_key in seq_keys(run, _SEQ, partitions):
        with boundary(redis, f"ZSCORE on {mark_key}"):
            marks.append(await redis.zscore(mark_key, producer))
    if any(mark is not None for mark in marks):
        return int(max(mark for mark in marks if mark is not None)) + 1
    best = -1
    for lane in lanes(STREAMS, partitions):
        key = lane_key(run, lane)
        end = "+"
        while True:
            with boundary(redis, f"XREVRANGE on {key}"):
                entries = await redis.xrevrange(key, max=end, min="-", count=_SCAN)
            stamps = (try_stamp(fields) for _, fields in entries)
            seq = next((s.seq for s in stamps if s is not None and s.producer == producer), None)
            if seq is not None or len(entries) < _SCAN:
                best = max(best, -1 if seq is None else seq)
                break
            end = "(" + as_str(entries[-1][0])
    return best + 1


def try_stamp(fields: dict) -> _Stamp | None:
    """(producer, seq) of an entry without decoding the rest; None if it is not an event."""
    try:
        return _stamp_decoder.decode(fields.get(FIELD, b""))
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


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
            with boundary(self._redis, f"XGROUP CREATE {self.group} on {key}"):
                try:
                    await self._redis.xgroup_create(key, self.group, id="0", mkstream=True)
                except ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):
                        raise
        self._history = {stream: "-" for stream in self.streams}
        self._claim_from = {stream: "0-0" for stream in self.streams}

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
        pipe = self._redis.pipeline(transaction=False)
        for stream in streams:
            pipe.xpending_range(self._key[stream], self.group, min=self._history[stream], max="+", count=count,
                                consumername=self.consumer)
        with boundary(self._redis, f"XPENDING (own) on {', '.join(self._key[s] for s in streams)}"):
            replies = await pipe.execute()
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
        pipe = self._redis.pipeline(transaction=False)
        for stream, entry_id, _ in pending:
            pipe.xrange(self._key[stream], min=entry_id, max=entry_id, count=1)
        with boundary(self._redis, f"XRANGE (own pending) on {', '.join(self._key[s] for s in streams)}"):
            bodies = await pipe.execute()
        # An entry deleted while pending has no body: None, acked by _accept.
        return [(stream, entry_id, body[0][1] if body else None, n)
                for (stream, entry_id, n), body in zip(pending, bodies)]

    async def _claim(self, count: int) -> list[_Raw]:
        self._next_claim = time.monotonic() + self.claim_idle_ms / 2000
        pipe = self._redis.pipeline(transaction=False)
        for stream in self.streams:
            pipe.xautoclaim(self._key[stream], self.group, self.consumer, self.claim_idle_ms,
                            start_id=self._claim_from[stream], count=count)
        with boundary(self._redis, f"XAUTOCLAIM on {', '.join(self._key.values())}"):
            replies = await pipe.execute()
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
            if not isinstance(exc.__cause__, (ConnectionError, TimeoutError)):
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
        pipe = self._redis.pipeline(transaction=False)
        for stream, entry_id, _ in items:
            pipe.xpending_range(self._key[stream], self.group, min=entry_id, max=entry_id, count=1,
                                consumername=self.consumer)
        with boundary(self._redis, f"XPENDING on {', '.join(self._key.values())}"):
            replies = await pipe.execute()
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
        with boundary(self._redis, f"ZMSCORE on {', '.join(self._marks.keys)}"):
            await self._marks.refresh(self._redis, ((e.producer, e.seq) for _, _, _, e, _ in decoded))

    async def _ack(self, items: list[tuple[str, str]]) -> None:
        if not items:
            return
        by_stream: dict[str, list[str]] = {}
        for stream, entry_id in items:
            by_stream.setdefault(stream, []).append(entry_id)
            self._failures.pop(entry_id, None)
            self._handed.discard(entry_id)
        pipe = self._redis.pipeline(transaction=False)
        for stream, entry_ids in by_stream.items():
            pipe.xack(self._key[stream], self.group, *entry_ids)
        with boundary(self._redis, f"XACK on {', '.join(self._key[s] for s in by_stream)}"):
            await pipe.execute()

    async def _dead(self, stream: str, entry_id: str, raw: bytes, reason: str) -> None:
        """Move an entry to the dead-letter stream and ack it, atomically (the lane's slot)."""
        key = self._key[stream]
        pipe = self._redis.pipeline(transaction=True)
        queue_dead_letter(pipe, key, run=self.run, stream=stream, entry_id=entry_id, raw=raw, reason=reason,
                          group=self.group, consumer=self.consumer)
        pipe.xack(key, self.group, entry_id)
        with boundary(self._redis, f"dead-lettering {entry_id} of {key} to {dead_letter_key(key)}"):
            await pipe.execute()
        self._failures.pop(entry_id, None)
        self._handed.discard(entry_id)


# Atomic, so no group can be created or read between looking at the groups and trimming.
_SAFE_TRIM = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local function older(a, b)
  local ams, aseq = string.match(a, '^(%d+)-(%d+)$')
  local bms, bseq = string.match(b, '^(%d+)-(%d+)$')
  return tonumber(ams) < tonumber(bms) or (ams == bms and tonumber(aseq) < tonumber(bseq))
end
local floor = nil
for _, group in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local info = {}
  for i = 1, #group, 2 do info[group[i]] = group[i + 1] end
  local point = info['last-delivered-id']
  if tonumber(info['pending']) > 0 then
    point = redis.call('XPENDING', KEYS[1], info['name'])[2]
  end
  if floor == nil or older(point, floor) then floor = point end
end
if floor == nil then return 0 end
return redis.call('XTRIM', KEYS[1], 'MINID', floor)
"""


async def safe_trim(redis: redis.asyncio.Redis, run: str, stream: str) -> int:
    """Drop entries every group has acknowledged; returns how many were dropped.

    `stream` is a lane (bus/partitions.py). Trim point = min over groups of (oldest pending id,
    else last-delivered id); a stream without groups is never trimmed.
    """
    key = lane_key(run, stream)
    with boundary(redis, f"safe trim of {key}"):
        return int(await redis.eval(_SAFE_TRIM, 1, key))
