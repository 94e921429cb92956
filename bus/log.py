"""Append-only event log on disk: one directory per stream, segment files of CRC-checked records.

    run_dir/log/<stream>/<first record index, 20 digits>.seg    records
                         <same>.idx                             sparse index of a sealed segment

Records are `[len u32][crc32c u32][msgpack [entry id, event bytes]]` (bus/logformat.py). A stream
opened with `packed=True` (RunLog: the routing traces) stores each event's bytes zstd-packed
(bus/logcodec.py); every read gives back the bytes as they were appended, whichever way they are stored.

Durability: `append_batch` writes a whole batch and fdatasyncs once (group commit); a segment is
fdatasync'd before the next one is created, and the directory is fsync'd when a segment is created.
So only the last segment can end in a torn write. Opening the log for writing truncates that tail to
the last good record and logs how many bytes went; a bad record anywhere else, or one followed by a
good record (a damaged record, not a torn write), raises LogCorrupted naming stream, segment and byte
offset. Nothing is skipped silently.

A reader that can use part of a damaged log opens it with `valid_prefix=True` (read-only): each
stream then holds the records before its first damaged one, and `damage` says where that is, so
a replay of steps before the damage still works and `reel log repair` knows what to cut.

Sparse index: each segment's first record and every INDEX_EVERY-th record -> (index, entry id, offset).
A sealed segment keeps its index in a sidecar `.idx` (msgpack), rebuilt from the segment when missing
or stale; the last segment is scanned on open.

    ReelError
     └── LogError           the log cannot be opened or written (I/O error, a second writer)
          └── LogCorrupted  a record failed its framing or CRC check
"""

from __future__ import annotations

import fcntl
import logging
import os
from bisect import bisect_right
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import msgspec

from reel.bus.errors import ReelError
from reel.bus.logcodec import pack, unpack
from reel.bus.logformat import HEADER, Appender, BadRecord, check, entry_order, frame, fsync_dir, good_record_after

__all__ = ["LogError", "LogCorrupted", "LogRecord", "StreamLog", "INDEX_EVERY"]

log = logging.getLogger(__name__)

INDEX_EVERY = 256  # records between sparse-index marks: a seek reads at most this many records


class LogError(ReelError):
    """The on-disk log cannot be opened or written; the message names the stream or file."""


class LogCorrupted(LogError):
    """A record failed its framing or CRC check; the message names stream, segment and byte offset."""

    segment: Path | None = None  # where the damage starts: the valid prefix ends here
    offset: int = 0


class LogRecord(NamedTuple):
    entry_id: str
    data: bytes  # the event's msgpack bytes, as delivered by the bus
    segment: Path
    offset: int  # byte offset of the record's header in `segment`


class _Segment(msgspec.Struct):
    """What is known about one segment file (the sidecar of a sealed segment holds exactly this)."""

    first: int  # stream index of its first record (also its file name)
    size: int = 0  # bytes of good records
    count: int = 0
    last_id: str | None = None
    marks: list[tuple[int, str, int]] = []  # (record index, entry id, byte offset)


_sidecar_decoder = msgspec.msgpack.Decoder(_Segment)


class StreamLog:
    """The log of one stream. One writer at a time (an flock on the directory); any number of
    read-only openers (`readonly=True` never repairs or creates anything). `packed`: appends store
    the event bytes zstd-packed (reads unpack any record, whatever this says)."""

    def __init__(self, directory: Path, segment_bytes: int = 64 << 20, *, readonly: bool = False,
                 valid_prefix: bool = False, packed: bool = False):
        self.directory = Path(directory)
        self.name = self.directory.name
        self.segment_bytes = segment_bytes
        self.readonly = readonly
        self.packed = packed
        self.valid_prefix = valid_prefix and readonly  # stop at the first damaged record instead of raising
        self.torn_bytes = 0  # read-only opens: bytes of torn tail left for the writer to repair
        self.damage: LogCorrupted | None = None  # valid_prefix: the first damaged record (records end before it)
        self._segments: list[_Segment] = []
        self._dir_fd: int | None = None  # writer: holds the flock, fsync'd on segment creation
        self._tail: Appender | None = None  # writer: appends to the last segment
        if readonly:
            if not self.directory.is_dir():
                raise LogError(f"no log of stream {self.name!r} at {self.directory}")
        else:
            self._lock()
        try:
            self._load()
        except BaseException:
            self.close()
            raise

    # -- opening --------------------------------------------------------------------------------

    def _lock(self) -> None:
        created = not self.directory.exists()
        self.directory.mkdir(parents=True, exist_ok=True)
        if created:
            fsync_dir(self.directory.parent)
        self._dir_fd = os.open(self.directory, os.O_RDONLY)
        try:
            fcntl.flock(self._dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._dir_fd)
            self._dir_fd = None
            raise LogError(f"the log of stream {self.name!r} at {self.directory} is already open "
                           "for writing (is another archiver running?)") from None

    def _load(self) -> None:
        paths = sorted(p for p in self.directory.glob("*.seg") if p.stem.isdigit())
        expected = 0
        for i, path in enumerate(paths):
            if int(path.stem) != expected:
                gap = LogCorrupted(f"log stream {self.name!r} is missing records: segment {path} "
                                   f"should start at record {expected}")
                gap.segment = path
                self._stop(gap)
                break
            sealed = i < len(paths) - 1
            seg = (self._read_sidecar(path) if sealed else None) or _Segment(int(path.stem))
            if seg.count == 0:
                try:
                    self._scan(seg, path, tail=not sealed)
                except LogCorrupted as exc:
                    self._stop(exc)  # raises unless valid_prefix
                    if seg.count:
                        self._segments.append(seg)  # its records before the damage
                    break
                if sealed and not self.readonly:
                    self._write_sidecar(seg)
            self._segments.append(seg)
            expected = seg.first + seg.count
        if not self._segments and not self.readonly:
            self._create_segment(0)

    def _read_sidecar(self, path: Path) -> _Segment | None:
        try:
            seg = _sidecar_decoder.decode(path.with_suffix(".idx").read_bytes())
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            return None
        return seg if seg.first == int(path.stem) and seg.size == path.stat().st_size else None

    def _write_sidecar(self, seg: _Segment) -> None:
        # No fsync: a lost or stale sidecar is rebuilt from its segment.
        idx = self._path(seg).with_suffix(".idx")
        tmp = idx.with_suffix(".idx.tmp")
        tmp.write_bytes(msgspec.msgpack.encode(seg))
        os.replace(tmp, idx)

    def _scan(self, seg: _Segment, path: Path, *, tail: bool) -> None:
        buf = memoryview(path.read_bytes())
        off = 0
        while off < len(buf):
            try:
                entry_id, _, end = check(buf, off)
            except BadRecord as bad:
                if tail and good_record_after(buf, off + 1) is None:
                    self._torn(path, off, len(buf) - off)
                    break
                raise self._corrupted(path, off, str(bad)) from None
            self._note(seg, entry_id, off)
            seg.size = off = end

    def _torn(self, path: Path, offset: int, nbytes: int) -> None:
        if self.readonly:  # on a live log this is usually a batch being written: not a warning
            self.torn_bytes = nbytes
            log.info("log stream %s: %d bytes after byte %d of %s are incomplete (a batch being "
                     "written, or a torn tail the writer truncates when it next opens the log)",
                     self.name, nbytes, offset, path)
            return
        fd = os.open(path, os.O_WRONLY)
        try:
            os.ftruncate(fd, offset)
            os.fsync(fd)
        finally:
            os.close(fd)
        log.warning("log stream %s: repaired a torn tail: truncated %d bytes after the last good "
                    "record of %s (byte %d)", self.name, nbytes, path, offset)

    def _corrupted(self, path: Path, offset: int, why: str) -> LogCorrupted:
        exc = LogCorrupted(f"log stream {self.name!r} is corrupted: {why} at byte {offset} of "
                           f"segment {path}")
        exc.segment, exc.offset = path, offset
        return exc

    def _stop(self, exc: LogCorrupted) -> None:
        """Damage found: with valid_prefix, note it (the caller reads no further); else raise it."""
        if not self.valid_prefix:
            raise exc
        self.damage = self.damage or exc

    # -- writing --------------------------------------------------------------------------------

    def append_batch(self, records: list[tuple[str, bytes]]) -> None:
        """Append (entry id, event bytes) records; they are durable (fdatasync) when this returns.

        Entry ids must increase; a ValueError leaves the log untouched."""
        if self.readonly:
            raise LogError(f"the log of stream {self.name!r} was opened read-only")
        if not records:
            return
        last = self.last_entry_id()
        for entry_id, _ in records:
            if last is not None and entry_order(entry_id) <= entry_order(last):
                raise ValueError(f"entry id {entry_id} is not after {last} in log stream {self.name!r}")
            last = entry_id
        seg = self._segments[-1]
        buffers: list[bytes] = []
        staged: list[tuple[str, int]] = []  # (entry id, offset), noted once durable
        end = seg.size
        for entry_id, event in records:
            data = pack(event) if self.packed else event
            head = frame(entry_id, data)
            if (seg.count or staged) and end + len(head) + len(data) > self.segment_bytes:
                self._commit(seg, buffers, staged, end)
                seg = self._roll(seg)
                buffers, staged, end = [], [], 0
            staged.append((entry_id, end))
            buffers += (head, data)
            end += len(head) + len(data)
        self._commit(seg, buffers, staged, end)

    def _commit(self, seg: _Segment, buffers: list[bytes], staged: list[tuple[str, int]], end: int) -> None:
        path = self._path(seg)
        try:
            self._appender(seg).append(buffers)
        except OSError as exc:
            self._close_tail()  # reopening truncates back to the last durable byte
            raise LogError(f"cannot append to log segment {path}: {exc}") from exc
        for entry_id, offset in staged:
            self._note(seg, entry_id, offset)
        seg.size = end

    def _appender(self, seg: _Segment) -> Appender:
        if self._tail is None:
            self._tail = Appender(self._path(seg), seg.size)  # cuts off the bytes of a failed append
        return self._tail

    def _close_tail(self) -> None:
        if self._tail is not None:
            self._tail.close()
            self._tail = None

    def _roll(self, seg: _Segment) -> _Segment:
        self._write_sidecar(seg)
        self._close_tail()
        return self._create_segment(seg.first + seg.count)

    def _create_segment(self, first: int) -> _Segment:
        seg = _Segment(first)
        os.close(os.open(self._path(seg), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        os.fsync(self._dir_fd)
        self._segments.append(seg)
        return seg

    def _note(self, seg: _Segment, entry_id: str, offset: int) -> None:
        index = seg.first + seg.count
        if seg.count == 0 or index % INDEX_EVERY == 0:
            seg.marks.append((index, entry_id, offset))
        seg.count += 1
        seg.last_id = entry_id

    def close(self) -> None:
        self._close_tail()
        if self._dir_fd is not None:
            os.close(self._dir_fd)  # releases the flock
            self._dir_fd = None

    def __enter__(self) -> StreamLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading --------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._segments[-1].first + self._segments[-1].count if self._segments else 0

    def last_entry_id(self) -> str | None:
        for seg in reversed(self._segments):
            if seg.last_id is not None:
                return seg.last_id
        return None

    def covers(self, entry_id: str) -> bool:
        """True if `entry_id` is at or before the last logged entry (ids are appended in order)."""
        last = self.last_entry_id()
        return last is not None and entry_order(entry_id) <= entry_order(last)

    def records(self, after_entry_id: str | None = None, start: int = 0) -> Iterator[LogRecord]:
        """Records in order: those with entry id > `after_entry_id` and stream index >= `start`.
        Every record's CRC is checked; records appended while iterating are included."""
        after = None if after_entry_id is None else entry_order(after_entry_id)
        seg_no, offset, index = self._seek(after, start)
        while seg_no < len(self._segments):
            seg = self._segments[seg_no]
            path = self._path(seg)
            with open(path, "rb") as f:
                f.seek(offset)
                buf = memoryview(f.read(seg.size - offset))
            off = 0
            while off < len(buf):
                try:
                    entry_id, data, end = check(buf, off)
                    wanted = index >= start and (after is None or entry_order(entry_id) > after)
                    if wanted:
                        data = unpack(data)
                except BadRecord as bad:
                    self._stop(self._corrupted(path, offset + off, str(bad)))
                    return
                if wanted:
                    yield LogRecord(entry_id, data, path, offset + off)
                off, index = end, index + 1
            seg_no, offset = seg_no + 1, 0

    def _seek(self, after: tuple[int, int] | None, start: int) -> tuple[int, int, int]:
        """(segment number, byte offset, record index) of the last mark at or before the target."""
        filled = len(self._segments) - (1 if self._segments and not self._segments[-1].count else 0)
        if filled == 0:
            return 0, 0, 0
        if after is not None:
            s = bisect_right(self._segments, after, hi=filled, key=lambda g: entry_order(g.marks[0][1]))
            marks = self._segments[max(s - 1, 0)].marks
            m = bisect_right(marks, after, key=lambda mark: entry_order(mark[1]))
        else:
            s = bisect_right(self._segments, start, hi=filled, key=lambda g: g.first)
            marks = self._segments[max(s - 1, 0)].marks
            m = bisect_right(marks, start, key=lambda mark: mark[0])
        index, _, offset = marks[max(m - 1, 0)]
        return max(s - 1, 0), offset, index

    def read_at(self, segment: Path, offset: int) -> LogRecord:
        with open(segment, "rb") as f:
            f.seek(offset)
            head = f.read(HEADER.size)
            length = HEADER.unpack(head)[0] if len(head) == HEADER.size else 0
            buf = memoryview(head + f.read(length))
        try:
            entry_id, data, _ = check(buf, 0)
            data = unpack(data)
        except BadRecord as bad:
            raise self._corrupted(segment, offset, str(bad)) from None
        return LogRecord(entry_id, data, segment, offset)

    def _path(self, seg: _Segment) -> Path:
        return self.directory / f"{seg.first:020d}.seg"
