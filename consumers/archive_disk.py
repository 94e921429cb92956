"""The archiver's disk side (consumers/archiver.py): a round of records made durable in the run's
log, with a copy of every blob its events name when the run's store is not blobs/ (Mooncake), and
the log index brought up to date. A full disk (ENOSPC, EDQUOT, EFBIG) is waited out, never an end."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import sqlite3
from concurrent.futures import ThreadPoolExecutor

import msgspec

from reel.bus import weight_manifest
from reel.bus.blob_backends.file import BlobStore
from reel.bus.blobs import BlobBackend
from reel.bus.events import AnyEvent, BlobRef, RoutingTrace, StepCommitted, WeightsPublished
from reel.bus.log import LogError
from reel.bus.run_log import RunLog
from reel.bus.logindex import LogIndex

__all__ = ["Entry", "Round", "RoundWriter", "blob_refs", "DISK_FULL_RETRY_S"]

log = logging.getLogger("reel.consumers.archiver")  # one role, one logger name in its log

DISK_FULL_RETRY_S = 2.0  # how often a full disk is tried again
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)

Entry = tuple[str, str, dict | None]  # (lane, entry id, fields; None if deleted while pending)


class Round(msgspec.Struct):
    """One read's worth of work."""

    entries: list[Entry]  # all of them are acked once the records are durable
    records: dict[str, list[tuple[str, bytes]]] = {}  # log stream -> (log entry id, event bytes) to log
    dead: list[tuple[str, str, bytes, str]] = []  # (lane, entry id, raw, reason)
    finished: bool = False  # a RunFinished is among the records
    blobs: list[BlobRef] = []  # named by the records' events, to copy into the run's blobs/
    manifests: list[BlobRef] = []  # weight manifests among them: their shards are copied too


class RoundWriter:
    """Appends rounds to `log` on the archiver's disk thread."""

    def __init__(self, run_log: RunLog, index: LogIndex, files: BlobStore, blobs: BlobBackend | None, run_name: str):
        self.log = run_log
        self.index = index  # group id / step / (producer, seq) -> record, synced each round
        self.files = files  # the run dir's blobs/
        self.blobs = blobs  # the run's store when it is not blobs/ (None: it is)
        self.run_name = run_name

    async def write(self, disk: ThreadPoolExecutor, round_: Round, stop: asyncio.Event) -> bool:
        """Append a round on the disk thread; True once durable, False if stopped while the disk is full.

        A full disk stops the archiver acking (entries stay pending on the bus, where the trainer
        and workers go on) until space is freed; it never ends the run."""
        waited = 0.0
        while True:
            try:
                await asyncio.get_running_loop().run_in_executor(disk, self._append, round_)
                if waited:
                    log.warning("log %s is writable again after %.0f s; archiving resumes", self.log.root, waited)
                return True
            except LogError as exc:
                if not isinstance(exc.__cause__, OSError) or exc.__cause__.errno not in _DISK_FULL:
                    raise
                if not waited:
                    log.error("archiver of run %s: %s; not acking anything until space is freed (retrying every "
                              "%.0f s)", self.run_name, exc, DISK_FULL_RETRY_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), DISK_FULL_RETRY_S)
            if stop.is_set():
                return False
            waited += DISK_FULL_RETRY_S

    def _append(self, round_: Round) -> None:
        for ref in round_.blobs:
            if not self.files.path(ref).is_file():
                self.files.put(self.blobs.get(ref))  # get checks the sha256 the event names
        for ref in round_.manifests:
            try:
                manifest = weight_manifest.decode_manifest(self.files.get(ref))
            except msgspec.DecodeError as exc:
                log.warning("weight manifest %s is not a WeightManifest (%s); its shards are not copied", ref.sha256,
                            exc)
                continue
            for shard in weight_manifest.blob_refs(ref, manifest)[1:]:
                if not self.files.path(shard).is_file():
                    self.files.put(self.blobs.get(shard))
        for stream, batch in round_.records.items():
            stream_log = self.log.stream(stream)
            # After a failed append (disk full) some segments of the batch may be durable already.
            stream_log.append_batch([(entry_id, data) for entry_id, data in batch if not stream_log.covers(entry_id)])
        try:
            self.index.sync()
        except (sqlite3.Error, LogError) as exc:  # derived data: readers index what it missed when they open it
            log.warning("archiver of run %s: the log index was not updated (%s); readers catch it up", self.run_name,
                        exc)


def blob_refs(event: AnyEvent) -> list[BlobRef]:
    """The blobs an event names (what a replay of the run reads)."""
    match event:
        case WeightsPublished():
            return [event.weights]
        case RoutingTrace(blob=BlobRef() as ref) | StepCommitted(checkpoint=BlobRef() as ref):
            return [ref]
    return []
