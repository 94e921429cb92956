"""An on-disk index of a run's log, so locating a step's inputs costs the same at 10^3 and 10^6 events.

    group id        -> its Trajectory and its RoutingTrace record   (trajectories, routing)
    commit step     -> its StepCommitted record                      (steps)
    (producer, seq) -> the first record of that event                (every stream)

A record's location is (stream, segment, byte offset); reading it back checks its CRC like any read
of the log. The index lives in run_dir/index.sqlite (SQLite: B-trees on disk, so neither opening it
nor a lookup reads more than a few pages, and any number of readers share it with one writer). It is
derived data: `sync` indexes the records appended since the last sync (per stream, the index keeps
how many it has seen), so a lost or deleted index is rebuilt from the log, and an old run gets one
the first time a reader opens it. The archiver syncs after each round; readers sync what is left.
Where run_dir cannot be written, the index is built in memory.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import msgspec

from reel.bus.log import LogCorrupted, LogError, LogRecord
from reel.bus.run_log import RunLog
from reel.bus.logcodec import unpack
from reel.bus.logformat import HEADER, BadRecord, check, good_record_after

__all__ = ["LogIndex", "INDEX_FILE"]

INDEX_FILE = "index.sqlite"
_GROUP_STREAMS = ("trajectories", "routing")
_BATCH = 20_000  # records per transaction of a sync
_SCHEMA = """
CREATE TABLE IF NOT EXISTS seen (stream TEXT PRIMARY KEY, records INTEGER, segment INTEGER, end_offset INTEGER);
CREATE TABLE IF NOT EXISTS groups (group_id TEXT, stream TEXT, segment INTEGER, offset INTEGER,
                                   PRIMARY KEY (group_id, stream)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS steps (step INTEGER PRIMARY KEY, segment INTEGER, offset INTEGER);
CREATE TABLE IF NOT EXISTS keys (producer TEXT, seq INTEGER, stream TEXT, segment INTEGER, offset INTEGER,
                                 PRIMARY KEY (producer, seq)) WITHOUT ROWID;
"""


class _Fields(msgspec.Struct):
    """The fields the index needs, decoded without the rest of the event (unknown fields are skipped)."""

    type: str
    producer: str
    seq: int
    group_id: str = ""
    step: int = -1


_fields = msgspec.msgpack.Decoder(_Fields)


class LogIndex:
    """The index of `run_log` (opened read-only or not); `sync()` before lookups that must see the newest."""

    def __init__(self, run_log: RunLog, run_dir: Path):
        self.run_log = run_log
        self.db = _connect(Path(run_dir) / INDEX_FILE)
        self.damage: dict[str, LogCorrupted] = {}  # valid_prefix logs: stream -> its first damaged record

    def sync(self) -> int:
        """Index the records appended since the last sync; how many were new.

        Reads the segment files from where the last sync stopped, so an unchanged stream costs one
        stat; it stops at a partial record (a batch being written, a torn tail) and takes it next time,
        and raises LogCorrupted at a damaged one (a bad record that good ones follow)."""
        new = 0
        for stream in self.run_log.names():
            directory = self.run_log.root / stream
            row = self.db.execute("SELECT records, segment, end_offset FROM seen WHERE stream = ?",
                                  (stream,)).fetchone()
            count, segment, offset = row if row else (0, 0, 0)
            segments = sorted(int(p.stem) for p in directory.glob("*.seg") if p.stem.isdigit())
            later = [first for first in segments if first >= segment]
            if not later or (len(later) == 1 and (directory / f"{segment:020d}.seg").stat().st_size == offset):
                continue
            rows: dict[str, list[tuple]] = {"groups": [], "steps": [], "keys": []}
            start = count
            for first in later:
                if first != segment:
                    segment, offset = first, 0
                with open(directory / f"{segment:020d}.seg", "rb") as f:
                    f.seek(offset)
                    buf = memoryview(f.read())  # only what the last sync has not seen
                at = 0
                while at < len(buf):
                    try:
                        _, data, end = check(buf, at)
                    except BadRecord as bad:
                        if good_record_after(buf, at + 1) is None:  # a batch being written, or a torn tail
                            break
                        self._write(stream, rows, (count, segment, offset + at))  # what is good stays indexed
                        damage = LogCorrupted(f"log stream {stream!r} is corrupted: {bad} at byte {offset + at} of "
                                              f"segment {directory / f'{segment:020d}.seg'}")
                        if not self.run_log.valid_prefix:
                            raise damage from None
                        self.damage[stream] = damage  # the records before it stay readable
                        break
                    self._note(stream, data, (segment, offset + at), rows)
                    at, count = end, count + 1
                    if len(rows["keys"]) >= _BATCH:  # bounded memory on the first sync of a big log
                        self._write(stream, rows, (count, segment, offset + at))
                offset += at
                if at < len(buf):
                    break
            self._write(stream, rows, (count, segment, offset))
            new += count - start
        return new

    @staticmethod
    def _note(stream: str, data: bytes, where: tuple[int, int], rows: dict[str, list[tuple]]) -> None:
        try:
            fields = _fields.decode(unpack(data))
        except (BadRecord, msgspec.DecodeError, msgspec.ValidationError):  # not an event: readers of it say so
            return
        rows["keys"].append((fields.producer, fields.seq, stream, *where))
        if stream in _GROUP_STREAMS and fields.group_id:
            rows["groups"].append((fields.group_id, stream, *where))
        elif stream == "steps" and fields.type == "step_committed":
            rows["steps"].append((fields.step, *where))

    def _write(self, stream: str, rows: dict[str, list[tuple]], seen: tuple[int, int, int]) -> None:
        """One transaction: the rows and how far into the stream they go."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            for table, values in rows.items():
                if values:
                    marks = ", ".join("?" * len(values[0]))
                    self.db.executemany(f"INSERT OR IGNORE INTO {table} VALUES ({marks})", values)
                values.clear()
            # Another process may have synced further meanwhile: never move the mark back.
            self.db.execute("INSERT INTO seen VALUES (?, ?, ?, ?) ON CONFLICT (stream) DO UPDATE SET "
                            "records = excluded.records, segment = excluded.segment, end_offset = excluded.end_offset "
                            "WHERE excluded.records > seen.records", (stream, *seen))
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise

    def group(self, stream: str, group_id: str) -> LogRecord | None:
        """The record of group `group_id`'s Trajectory (stream "trajectories") or RoutingTrace ("routing")."""
        row = self.db.execute("SELECT segment, offset FROM groups WHERE group_id = ? AND stream = ?",
                              (group_id, stream)).fetchone()
        return None if row is None else self._read(stream, *row)

    def commit(self, step: int) -> LogRecord | None:
        """The StepCommitted record of `step`."""
        row = self.db.execute("SELECT segment, offset FROM steps WHERE step = ?", (step,)).fetchone()
        return None if row is None else self._read("steps", *row)

    def key(self, producer: str, seq: int) -> tuple[str, LogRecord] | None:
        """(stream, record) of the event with idempotency key (producer, seq)."""
        row = self.db.execute("SELECT stream, segment, offset FROM keys WHERE producer = ? AND seq = ?",
                              (producer, seq)).fetchone()
        return None if row is None else (row[0], self._read(*row))

    def newest_seqs(self) -> dict[str, int]:
        """Producer -> the highest seq indexed."""
        return dict(self.db.execute("SELECT producer, MAX(seq) FROM keys GROUP BY producer").fetchall())

    def _read(self, stream: str, segment: int, offset: int) -> LogRecord:
        """The record at `offset` of the segment, CRC-checked (without opening the stream's log)."""
        path = self.run_log.root / stream / f"{segment:020d}.seg"
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                head = f.read(HEADER.size)
                length = HEADER.unpack(head)[0] if len(head) == HEADER.size else 0
                buf = memoryview(head + f.read(length))
            entry_id, data, _ = check(buf, 0)
            data = unpack(data)
        except BadRecord as bad:
            raise LogCorrupted(f"log stream {stream!r} is corrupted: {bad} at byte {offset} of segment "
                               f"{path}") from None
        except OSError as exc:
            raise LogError(f"cannot read record at byte {offset} of {path}: {exc}") from exc
        return LogRecord(entry_id, data, path, offset)

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> LogIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _connect(path: Path) -> sqlite3.Connection:
    """The index at `path`; a damaged one is rebuilt (derived data), an unwritable one lives in memory."""
    for _ in range(2):
        try:
            db = sqlite3.connect(path, timeout=60, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode = WAL")  # readers never wait for the archiver's sync
            db.execute("PRAGMA synchronous = NORMAL")  # a lost last sync is redone from the log
            db.executescript(_SCHEMA)
            return db
        except sqlite3.OperationalError:  # e.g. a run directory this process cannot write
            break
        except sqlite3.DatabaseError:  # not a database any more: start it again from the log
            for suffix in ("", "-wal", "-shm"):
                Path(f"{path}{suffix}").unlink(missing_ok=True)
    db = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
    db.executescript(_SCHEMA)
    return db
