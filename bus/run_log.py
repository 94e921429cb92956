"""A run's log: run_dir/log/<stream>/, one segment log (bus/log.py) per stream, opened on first use."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from reel.bus.events import AnyEvent, MalformedEvent, decode
from reel.bus.log import LogCorrupted, LogError, StreamLog
from reel.bus.logformat import fsync_dir
from reel.bus.logcodec import PACKED_STREAMS

__all__ = ["RunLog"]

_STREAM_NAME = re.compile(r"[a-z0-9_-]+")  # a stream's directory name


class RunLog:
    """A run's log: run_dir/log/<stream>/. Streams are opened on first use.

    `valid_prefix` (read-only): every stream reads up to its first damaged record (see the module
    docstring); `damage()` lists what was found so far."""

    def __init__(self, run_dir: Path, segment_bytes: int = 64 << 20, *, readonly: bool = False,
                 valid_prefix: bool = False):
        self.root = Path(run_dir) / "log"
        self.segment_bytes = segment_bytes
        self.readonly = readonly
        self.valid_prefix = valid_prefix
        self._streams: dict[str, StreamLog] = {}
        if readonly and not self.root.is_dir():
            raise LogError(f"no event log in {run_dir} (expected the directory {self.root})")
        if not readonly and not self.root.is_dir():
            self.root.mkdir(parents=True)
            fsync_dir(self.root.parent)

    def names(self) -> list[str]:
        """Streams that have a log, sorted."""
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and _STREAM_NAME.fullmatch(p.name))

    def stream(self, name: str) -> StreamLog:
        if name not in self._streams:
            if not _STREAM_NAME.fullmatch(name):
                raise LogError(f"{name!r} is not a stream name (lowercase letters, digits, _ and -)")
            if self.readonly and not (self.root / name).is_dir():
                raise LogError(f"stream {name!r} has no log in {self.root} "
                               f"(logged streams: {', '.join(self.names()) or 'none'})")
            self._streams[name] = StreamLog(self.root / name, self.segment_bytes, readonly=self.readonly,
                                            valid_prefix=self.valid_prefix, packed=name in PACKED_STREAMS)
        return self._streams[name]

    def damage(self) -> dict[str, LogCorrupted]:
        """Stream -> its first damaged record, among the streams opened so far (valid_prefix only)."""
        return {name: s.damage for name, s in self._streams.items() if s.damage is not None}

    def events(self, stream: str) -> Iterator[tuple[str, AnyEvent]]:
        """(entry id, decoded event) in log order."""
        for record in self.stream(stream).records():
            try:
                event = decode(record.data)
            except MalformedEvent as exc:
                raise MalformedEvent(f"record {record.entry_id} at byte {record.offset} of "
                                     f"{record.segment} is not an event: {exc}") from exc
            yield record.entry_id, event

    def verify(self) -> dict[str, int]:
        """Check every record of every stream; stream -> record count. Raises LogCorrupted."""
        return {name: sum(1 for _ in self.stream(name).records()) for name in self.names()}

    def close(self) -> None:
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
