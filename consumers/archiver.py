"""The archiver: every event of a run's five streams into the on-disk log, acked only once durable.

One consumer ("archiver") of group "archiver"; the log's flock keeps it to one process per run
directory, and the fixed consumer name lets a restarted archiver find what its predecessor left
pending. Each round:

    read    this consumer's pending entries (left by a crashed predecessor) until none are left,
            then new ones (blocking up to block_ms); the next read overlaps this round's writing
    skip    entries at or before their stream's last logged entry id: logged by a predecessor that
            died before acking them
    dead    entries that are not Reel events, or that their producer's role, range or order refuses
            (bus/trust.py) -> the dead-letter stream (acked there, not logged)
    blobs   with a blob store other than the run's blobs/ (Mooncake), copy every blob the round's
            events name into blobs/ first: replay never depends on a live store
    log     append per stream: one write + one fdatasync per stream per round (group commit)
    ack     XACK only now: a crash before this re-delivers the entries, and `skip` drops the repeats
    trim    every trim_every_s, safe_trim (never past what any group has not acknowledged)

A full disk (ENOSPC, EDQUOT, EFBIG) stops the archiver before `ack`: it says so once, retries the
same round every DISK_FULL_RETRY_S, and goes on when space is freed; the entries wait on the bus
(consumers/archive_disk.py). A Redis that does not answer is waited for (bus.ride_out_s).

It stops when `stop` is set, or once it has logged a RunFinished and a read finds nothing new.

Partitions (bus.partitions = P > 1, bus/partitions.py): the archiver reads every lane and logs a
split stream's lanes into the one log stream of their event stream, in order of arrival per lane.
Log entry ids must increase within a log stream, and two partitions' ids interleave, so a record
keeps its Redis id unless that is not after the log's last one, in which case it gets the next id
after it. The log therefore cannot say by id whether a re-delivered entry of a split stream is
logged; the log index's (producer, seq) table can (bus/logindex.py, on disk: its memory does not grow
with the log). It is synced up to the last durable record before each such lookup.

Why not GroupConsumer: it hands out decoded events, whose re-encoding would drop fields a newer
producer added; the archiver keeps the bytes exactly as they are on the stream. It skips an entry
by its id (a re-delivery) and by its (producer, seq): the copies of a write retried while riding out
a Redis pause (bus/redis_boundary.py) follow each other within seconds, so a copy repeats either one
this process logged lately (same bytes) or one the log held when it started (the log index).
The log holds each event once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import redis.asyncio
from redis.exceptions import RedisError, ResponseError

from reel.bus.cluster import SlotReader, is_cluster
from reel.bus.blob_backends.file import BlobStore
from reel.bus.blobs import BlobBackend
from reel.bus.events import STREAMS, AnyEvent, MalformedEvent, RunFinished, WeightsPublished, decode
from reel.bus.run_log import RunLog
from reel.bus.logindex import LogIndex
from reel.bus.logformat import entry_order
from reel.bus.partitions import lane_key, lanes, stream_of
from reel.bus.dead_letter import dead_letter_key, queue_dead_letter
from reel.bus.redis_boundary import no_answer, ride_out, ride_out_bound
from reel.bus.streams import FIELD, READ_MARGIN_S, BusError, connect, safe_trim, try_stamp
from reel.bus.trust import Order, SeqMarks, wrong_producer
from reel.runtime.heartbeat import BEAT_SUFFIX, Heartbeat
from reel.runtime.role_loop import serve
from reel.consumers.archive_disk import Entry, Round, RoundWriter, blob_refs

__all__ = ["Archiver", "main", "GROUP", "CONSUMER"]

log = logging.getLogger(__name__)
_RECENT_KEYS = 1 << 16  # (producer, seq) keys logged lately: a retried write's copies follow within seconds

GROUP = "archiver"
CONSUMER = "archiver"

class Archiver:
    """Group `archiver` on all of a run's event streams (every lane of each) -> RunLog(run_dir)."""

    def __init__(self, run_dir: Path, bus_url: str, run: str, *, batch: int = 256, block_ms: int = 500,
                 trim_every_s: float = 10.0, segment_bytes: int = 64 << 20, partitions: int = 1,
                 blobs: BlobBackend | None = None):
        # what to archive, and where
        self.run_dir = Path(run_dir)
        self.bus_url = bus_url
        self.run_name = run
        self.streams = lanes(STREAMS, partitions)
        # knobs
        self.batch = batch  # entries per stream per read
        self.block_ms = block_ms
        self.trim_every_s = trim_every_s
        self.segment_bytes = segment_bytes
        self.blobs = blobs  # the run's store when it is not the run dir's blobs/ (whose copy we keep)
        self.files = BlobStore(self.run_dir / "blobs")
        # set by run()
        self.redis: redis.asyncio.Redis | None = None
        self.log: RunLog | None = None
        self.index: LogIndex | None = None  # group id / step / (producer, seq) -> record, synced each round
        # progress
        self.archived = 0  # events logged by this process
        self.repeats = 0  # re-delivered entries found already logged
        self.finished = False  # a RunFinished has been logged
        self._key = {stream: lane_key(run, stream) for stream in self.streams}
        self._name = {key: stream for stream, key in self._key.items()}
        self._history: dict[str, str] | None = {s: "0" for s in self.streams}  # pending-list cursors
        self._slots: SlotReader | None = None  # set by run(): one XREADGROUP per cluster slot
        self._split = {stream_of(lane) for lane in self.streams if lane != stream_of(lane)}  # log streams of >1 lane
        self._last_id: dict[str, str | None] = {}  # split log stream -> last log entry id given out
        self._marks = SeqMarks(run, partitions)  # what each producer has published (bus/trust.py)
        self._order = Order()  # the trainer's versions and steps so far, from the log on start
        self._recent: OrderedDict[tuple[str, int], int] = OrderedDict()  # (producer, seq) -> hash of the bytes
        self.heartbeat = Heartbeat(self.run_dir / "roles" / f"archiver{BEAT_SUFFIX}")  # runtime/heartbeat.py
        self._indexed: dict[str, int] = {}  # producer -> its highest seq the log held when run() started
        self._writer: RoundWriter | None = None  # set by run()

    async def run(self, stop: asyncio.Event) -> None:
        self.log = RunLog(self.run_dir, self.segment_bytes)
        self.index = LogIndex(self.log, self.run_dir)
        self._writer = RoundWriter(self.log, self.index, self.files, self.blobs, self.run_name)
        # No retries (connect's default): see _read.
        self.redis = connect(self.bus_url, socket_timeout=self.block_ms / 1000 + READ_MARGIN_S)
        self._slots = SlotReader(is_cluster(self.redis))
        disk = ThreadPoolExecutor(1, thread_name_prefix="archiver-disk")  # fdatasync off the event loop
        writing: asyncio.Future | None = None  # the previous round's append, on the disk thread
        written: Round | None = None
        try:
            await self._create_groups()
            self._last_id = {s: self.log.stream(s).last_entry_id() for s in self._split}
            await self._index_split_logs()
            await asyncio.to_thread(self.index.sync)  # what predecessors logged, by (producer, seq)
            self._indexed = self.index.newest_seqs()
            for stream in ("weights", "steps"):
                for _, event in self.log.events(stream):
                    self._order.learn(event)
            log.info("archiving run %s into %s, after %s", self.run_name, self.log.root,
                     {s: self.log.stream(s).last_entry_id() for s in STREAMS})
            next_trim = time.monotonic() + self.trim_every_s
            while not stop.is_set():
                # Rounds overlap: while one is written, the next read takes what is there without blocking.
                blocking = writing is None
                read_at = time.monotonic()
                try:
                    entries = await self._read(blocking)
                except BusError as exc:
                    if not no_answer(exc) or time.monotonic() - read_at >= ride_out_bound():
                        raise
                    if writing is not None and await writing:  # its entries are acked before the re-read
                        await self._done(written)
                    writing = None
                    await self._ride_out(exc, read_at)
                    continue
                if writing is not None:
                    if await writing:
                        await self._done(written)
                    writing = None
                self.heartbeat.alive("archiving" if entries else "waiting for events", f"{self.archived} logged",
                                     waiting=not entries)
                if entries:
                    await self._refresh_marks(entries)
                    written = self._prepare(entries)
                    await self._dead_letter(written.dead)
                    writing = asyncio.ensure_future(self._writer.write(disk, written, stop))
                elif self.finished and blocking:
                    log.info("run %s finished and every stream is drained: %d events logged, %d repeats "
                             "skipped", self.run_name, self.archived, self.repeats)
                    return
                if time.monotonic() >= next_trim:
                    for stream in self.streams:
                        await safe_trim(self.redis, self.run_name, stream)
                    next_trim = time.monotonic() + self.trim_every_s
            if writing is not None and await writing:
                await self._done(written)
        finally:
            if writing is not None:
                writing.cancel()
            disk.shutdown(wait=True)  # even when cancelled, no append may outlive the log's fds
            self.log.close()
            if self.index is not None:
                self.index.close()
            await asyncio.shield(self.redis.aclose())

    async def _create_groups(self) -> None:
        for key in self._key.values():
            with self._bus(f"XGROUP CREATE {GROUP} on {key}"):
                try:
                    await self.redis.xgroup_create(key, GROUP, id="0", mkstream=True)
                except ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):
                        raise

    async def _index_split_logs(self) -> None:
        """Bring the log index up to date when a predecessor left entries of a split stream pending:
        only its (producer, seq) table tells whether they were logged (module docstring). Before any
        append, so the disk thread is idle; a failure ends the archiver (dedupe must be exact)."""
        pending = [lane for lane in self.streams if stream_of(lane) in self._split]
        pipe = self.redis.pipeline(transaction=False)
        for lane in pending:
            pipe.xpending(self._key[lane], GROUP)
        with self._bus(f"XPENDING on {', '.join(self._key[lane] for lane in pending)}"):
            summaries = await pipe.execute() if pending else []
        if any(summary["pending"] for summary in summaries):
            await asyncio.to_thread(self.index.sync)  # a first sync of an old run's log reads all of it

    async def _read(self, block: bool) -> list[Entry]:
        """Our pending entries (left by a predecessor) until there are none, then new ones.

        Entries are logged in stream order, so the log always holds a prefix of what was delivered
        and "at or before the last logged id" means "logged". That is why pending entries must all
        come before any new one, and why reads are never retried: a retried XREADGROUP whose first
        reply was lost would leave delivered entries behind. A Redis that does not answer is waited
        for instead (run(): _ride_out), and the pending list read again from its start; another bus
        error ends the archiver, and the next one finds those entries in its pending list."""
        cursors = self._history or {stream: ">" for stream in self.streams}
        ids = {self._key[stream]: cursor for stream, cursor in cursors.items()}
        with self._bus(f"XREADGROUP on {', '.join(ids)}"):
            reply = await self._slots.read(
                lambda some, block_ms: self.redis.xreadgroup(GROUP, CONSUMER, some, count=self.batch, block=block_ms),
                ids, self.block_ms if block and not self._history else None)
        entries = [(self._name[key.decode()], entry_id.decode(), fields)
                   for key, entries in reply or () for entry_id, fields in entries]
        if self._history:
            for stream, entry_id, _ in entries:
                self._history[stream] = entry_id
            if not entries:
                self._history = None
                return await self._read(block)
        return entries

    async def _ride_out(self, exc: BusError, since: float) -> None:
        """A read Redis did not answer: wait for it (bus.ride_out_s from `since`, bus/redis_boundary.py),
        then read our pending list from the start, where the entries of a lost reply are (a read is never
        retried)."""
        log.warning("%s; waiting for Redis, then re-reading our pending entries", exc)
        await ride_out(self.redis, "PING", self.redis.ping, bound_s=ride_out_bound() - (time.monotonic() - since))
        log.warning("archiver of run %s: Redis answered again after %.1f s; re-reading our pending entries",
                    self.run_name, time.monotonic() - since)
        self._history = {stream: "0" for stream in self.streams}

    def _prepare(self, entries: list[Entry]) -> Round:
        """Sort a read into records to log and entries to dead-letter; drop repeats."""
        round_ = Round(entries)
        repeats = 0
        redelivered = self._history is not None  # this read came from our pending list
        if redelivered and self._split:
            self.index.sync()  # the last round's sync may have failed; the disk thread is idle (run())
        for lane, entry_id, fields in entries:
            stream = stream_of(lane)
            if stream not in self._split and self.log.stream(stream).covers(entry_id):
                repeats += 1
                continue
            if not fields:  # trimmed or deleted by hand while pending: a gap we can only report
                log.error("entry %s of %s was deleted before it was archived", entry_id, self._key[lane])
                continue
            data = fields.get(FIELD)
            try:
                if data is None:
                    raise MalformedEvent(f"entry has no '{FIELD.decode()}' field")
                event = decode(data)
            except MalformedEvent as exc:
                round_.dead.append((lane, entry_id, data or msgspec.msgpack.encode(fields), f"undecodable: {exc}"))
                continue
            if redelivered and stream in self._split and self._logged(stream, event):
                repeats += 1
                continue
            if self._recent.get((event.producer, event.seq)) == hash(data) or self._logged_before(stream, event):
                repeats += 1  # a copy of a retried write (bus/redis_boundary.py), its first copy logged
                continue
            untrusted = wrong_producer(event, self.run_name) or self._marks.problem(event) or self._order.admit(event)
            if untrusted is not None:
                round_.dead.append((lane, entry_id, data, f"untrusted: {untrusted}"))
                continue
            round_.finished |= isinstance(event, RunFinished)
            if self.blobs is not None:
                round_.blobs += blob_refs(event)
                if isinstance(event, WeightsPublished) and event.format == "manifest":
                    round_.manifests.append(event.weights)
            round_.records.setdefault(stream, []).append((entry_id, data))
            self._recent[(event.producer, event.seq)] = hash(data)
            if len(self._recent) > _RECENT_KEYS:
                self._recent.popitem(last=False)
        for stream in self._split & round_.records.keys():
            round_.records[stream] = self._log_ids(stream, round_.records[stream])
        if repeats:  # right after a restart, or a Redis pause
            log.info("%d re-delivered entries or copies of retried writes were already logged; acking them", repeats)
            self.repeats += repeats
        return round_

    def _logged_before(self, stream: str, event: AnyEvent) -> bool:
        """Whether a predecessor logged `event` (the first copy of a retried write may be its last record)."""
        return event.seq <= self._indexed.get(event.producer, -1) and self._logged(stream, event)

    def _logged(self, stream: str, event: AnyEvent) -> bool:
        """Whether the log holds `event` in `stream`, by its (producer, seq): unique per producer."""
        hit = self.index.key(event.producer, event.seq)
        return hit is not None and hit[0] == stream

    async def _refresh_marks(self, entries: list[Entry]) -> None:
        stamps = [stamp for _, _, fields in entries if fields and (stamp := try_stamp(fields)) is not None]
        with self._bus(f"ZMSCORE on {', '.join(self._marks.keys)}"):
            await self._marks.refresh(self.redis, ((s.producer, s.seq) for s in stamps))

    def _log_ids(self, stream: str, records: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
        """A split stream's records in Redis id order, each with an id after the log's last one."""
        out = []
        last = self._last_id[stream]
        for entry_id, data in sorted(records, key=lambda record: entry_order(record[0])):
            if last is not None and entry_order(entry_id) <= entry_order(last):
                ms, seq = entry_order(last)
                entry_id = f"{ms}-{seq + 1}"
            out.append((entry_id, data))
            last = entry_id
        self._last_id[stream] = last
        return out

    async def _done(self, round_: Round) -> None:
        """The round is durable: count it and ack every entry it read."""
        self.archived += sum(map(len, round_.records.values()))
        self.finished |= round_.finished
        self.heartbeat.progress("archiving", f"{self.archived} logged")
        await self._ack(round_.entries)

    async def _ack(self, entries: list[Entry]) -> None:
        by_stream: dict[str, list[str]] = {}
        for stream, entry_id, _ in entries:
            by_stream.setdefault(stream, []).append(entry_id)

        async def attempt() -> list:  # an XACK repeated after a lost reply acks nothing more
            pipe = self.redis.pipeline(transaction=False)
            for stream, entry_ids in by_stream.items():
                pipe.xack(self._key[stream], GROUP, *entry_ids)
            return await pipe.execute()

        await ride_out(self.redis, f"XACK on {', '.join(self._key[s] for s in by_stream)}", attempt)

    async def _dead_letter(self, dead: list[tuple[str, str, bytes, str]]) -> None:
        """Same fields as GroupConsumer's dead letters; XADD and XACK in one MULTI per slot (the
        dead-letter stream next to each lane)."""
        by_slot: dict[str, list[tuple[str, str, bytes, str]]] = {}
        for item in dead:
            by_slot.setdefault(dead_letter_key(self._key[item[0]]), []).append(item)
        for dead_key, items in by_slot.items():
            pipe = self.redis.pipeline(transaction=True)
            for stream, entry_id, raw, reason in items:
                queue_dead_letter(pipe, self._key[stream], run=self.run_name, stream=stream, entry_id=entry_id,
                                  raw=raw, reason=reason, group=GROUP, consumer=CONSUMER)
                pipe.xack(self._key[stream], GROUP, entry_id)
            with self._bus(f"dead-lettering {len(items)} entries to {dead_key}"):
                await pipe.execute()

    @contextlib.contextmanager
    def _bus(self, what: str) -> Iterator[None]:
        try:
            yield
        except (RedisError, OSError) as exc:
            raise BusError(f"archiver of run {self.run_name} at {self.bus_url.rpartition('@')[2]}: {what} failed "
                           f"({type(exc).__name__}: {exc})") from exc


def main(run_dir: Path, bus_url: str, run: str, partitions: int | str = 1, stop: asyncio.Event | None = None) -> int:
    """`reel role archiver`: archive until SIGTERM/SIGINT (or `stop`), or the run finishes."""
    from reel.runtime.blob_store import run_blobs
    from reel.runtime.config.run import load

    path = Path(run_dir) / "config.toml"
    config = load(path) if path.is_file() else None  # None: `reel bench bus`'s archiver
    # Blobs in another store (Mooncake) get a copy in the run's blobs/; file blobs are there already.
    blobs = run_blobs(Path(run_dir), config) if config and config.blobs.backend != "file" else None

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    # Made inside the loop: the archiver's asyncio state belongs to it.
    serve(lambda done: Archiver(run_dir, bus_url, run, partitions=int(partitions), blobs=blobs).run(done), stop)
    return 0
