"""Redis Streams: the publisher, producer seq recovery, dead-letter counts, safe trimming.

An entry has one field FIELD (b"e") = reel.bus.events.encode(event), at lane_key(run, lane)
(bus/partitions.py: stream_key(run, name) unless the stream is split into partitions). Needs Redis
>= 6.2 (XAUTOCLAIM, XTRIM MINID, exclusive ranges) and nothing newer. The rest of the bus's Redis
side, re-exported here:

    bus/redis_boundary.py   connect, BusError, riding out a Redis pause (the retry rules)
    bus/group_consumer.py   GroupConsumer, Delivery: the trainer's reader
    bus/tail.py             watchers (plain XREAD)
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
import redis.asyncio

from reel.bus.dead_letter import DEAD, dead_letter_key, queue_dead_letter
from reel.bus.events import STREAM_OF, STREAMS, Event, encode
from reel.bus.group_consumer import Delivery, GroupConsumer
from reel.bus.partitions import lane_key, lane_of, lanes, seq_keys, slot_key
from reel.bus.redis_boundary import FIELD, READ_MARGIN_S, BusError, as_str, boundary, by_stream, connect, ride_out
from reel.bus.trust import SEQ_MARKS

__all__ = ["BusError", "connect", "Publisher", "recover_next_seq", "Delivery", "GroupConsumer", "safe_trim",
           "DEAD", "FIELD", "READ_MARGIN_S", "as_str", "boundary", "by_stream", "dead_letters_added", "try_stamp"]

E = TypeVar("E", bound=Event)

_SEQ = SEQ_MARKS  # sorted set per slot, slot_key(<key>, _SEQ): producer -> highest seq it has published there
_SCAN = 512  # entries per XREVRANGE when recovering a producer's seq
_encoder = msgspec.msgpack.Encoder()  # reel.bus.events.encode's settings, for encode_into


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

        async def attempt() -> None:
            pipe = self.redis.pipeline(transaction=False)
            queue_dead_letter(pipe, key, run=self.run, stream=stream, entry_id="", raw=encode(event), reason=reason,
                              group="", consumer=self.producer)
            await pipe.execute()

        await ride_out(self.redis, f"dead-lettering {stream} event {self.producer}#{event.seq} to "
                                   f"{dead_letter_key(key)}", attempt)

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

        async def attempt() -> list:
            pipe = self.redis.pipeline(transaction=transaction)
            # The seq high-water mark goes first, so a batch cut short makes a restart skip seqs rather
            # than reuse one; GT (Redis 6.2) keeps it monotonic when batches land out of order. It sits
            # in the first event's slot, so a MULTI/EXEC on one partition stays in one cluster slot.
            pipe.zadd(slot_key(keys[0], _SEQ), marks, gt=True)
            for key, start, end in zip(keys, [0, *ends], ends):
                pipe.xadd(key, {FIELD: data[start:end]})
            return await pipe.execute()

        # A retry after a lost reply adds the batch again: readers keep the first of each (producer, seq).
        replies = await ride_out(self.redis, f"XADD of {len(events)} events to {', '.join(sorted(set(keys)))}",
                                 attempt)
        self._spare = buffer
        return [as_str(entry_id) for entry_id in replies[1:]]


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
    return int(await ride_out(redis, f"safe trim of {key}", lambda: redis.eval(_SAFE_TRIM, 1, key)))
