"""The record format of bus/log.py, and the low-level disk calls it needs.

Record (little-endian):  [len u32][crc32c u32][payload: len bytes],  payload = msgpack [entry id, event]

The CRC covers the length bytes as well as the payload, so a damaged length cannot pass for a shorter
record and a zero-filled tail (a file extended without its data) never checks. The payload's msgpack
prefix is written by hand so the event bytes need no join before they go to the kernel.

Appender writes a segment's whole blocks with O_DIRECT where the filesystem allows it: the log is
written once and read back rarely, and copying each batch into page-cache pages was up to half of
the archiver's CPU. Only the last partial block goes through the page cache; the next append
rewrites that block, with the same bytes in front, as part of its aligned write.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import struct
from pathlib import Path

import crc32c
import msgspec
import numpy as np

__all__ = ["HEADER", "BadRecord", "Appender", "entry_order", "frame", "check", "good_record_after", "write_all",
           "fsync_dir"]

HEADER = struct.Struct("<II")
_IOV_MAX = 1024
_BLOCK = 4096  # O_DIRECT alignment of offsets, lengths and memory (a multiple of any usual sector size)
_STAGE = 4 << 20  # bytes of the aligned staging buffer: one O_DIRECT write each
_payload_decoder = msgspec.msgpack.Decoder(tuple[str, bytes])


class BadRecord(Exception):
    """The bytes at an offset are not a valid record; the message says why. Callers turn it into
    LogCorrupted (with stream, segment and offset) or treat it as a torn tail."""


def entry_order(entry_id: str) -> tuple[int, int]:
    """Redis stream ids "ms-seq" compare as integer pairs."""
    ms, _, seq = entry_id.partition("-")
    try:
        return int(ms), int(seq or 0)
    except ValueError:
        raise ValueError(f"{entry_id!r} is not a stream entry id (ms-seq)") from None


def frame(entry_id: str, data: bytes) -> bytes:
    """Everything of a record that precedes the event bytes: header and msgpack prefix."""
    n = len(data)
    if n < 1 << 8:
        bin_header = b"\xc4" + n.to_bytes(1, "big")
    elif n < 1 << 16:
        bin_header = b"\xc5" + n.to_bytes(2, "big")
    else:
        bin_header = b"\xc6" + n.to_bytes(4, "big")
    prefix = b"\x92" + msgspec.msgpack.encode(entry_id) + bin_header
    length = (len(prefix) + n).to_bytes(4, "little")
    crc = crc32c.crc32c(data, value=crc32c.crc32c(length + prefix))
    return length + crc.to_bytes(4, "little") + prefix


def check(buf: memoryview, off: int) -> tuple[str, bytes, int]:
    """(entry id, event bytes, end offset) of the record at `off`; BadRecord if it is not one."""
    if len(buf) - off < HEADER.size:
        raise BadRecord("a partial record header")
    length, crc = HEADER.unpack_from(buf, off)
    end = off + HEADER.size + length
    if end > len(buf):
        raise BadRecord(f"a {length}-byte record running past the end of the file")
    if crc32c.crc32c(buf[off + HEADER.size : end], value=crc32c.crc32c(buf[off : off + 4])) != crc:
        raise BadRecord("a CRC mismatch")
    try:
        entry_id, data = _payload_decoder.decode(buf[off + HEADER.size : end])
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise BadRecord("a payload that is not msgpack [entry id, bytes]") from None
    return entry_id, data, end


def good_record_after(buf: memoryview, start: int) -> int | None:
    """Offset of the first valid record at or after `start`, if any.

    Tells a torn tail (nothing valid follows) from a damaged record (something does). Candidates are
    offsets whose payload would start with msgpack [str, ...] (0x92 then a str header); only those pay
    for a CRC."""
    b = np.frombuffer(buf, dtype=np.uint8)
    first, second = b[start + 8 : -1], b[start + 9 :]
    candidates = np.flatnonzero((first == 0x92) & (((second & 0xE0) == 0xA0) | (second == 0xD9)))
    for offset in (candidates + start).tolist():
        try:
            check(buf, offset)
            return offset
        except BadRecord:
            continue
    return None


def write_all(fd: int, buffers: list[bytes], offset: int | None = None) -> None:
    """All of `buffers`, at `offset` (pwritev) or at the file position (writev)."""
    views = [memoryview(b) for b in buffers]
    i = 0
    while i < len(views):
        if offset is None:
            written = os.writev(fd, views[i : i + _IOV_MAX])
        else:
            written = os.pwritev(fd, views[i : i + _IOV_MAX], offset)
            offset += written
        while i < len(views) and written >= len(views[i]):
            written -= len(views[i])
            i += 1
        if written:
            views[i] = views[i][written:]


class Appender:
    """Appends to one file from byte `size` on (anything after it is cut off); `append` returns once
    the bytes are durable (fdatasync). O_DIRECT for whole blocks where the filesystem takes it
    (`direct=False`: the page cache only)."""

    def __init__(self, path: Path, size: int, *, direct: bool = True):
        self.size = size
        self._fd = os.open(path, os.O_RDWR)  # page-cache writes: the partial last block, or everything
        self._direct: int | None = None  # O_DIRECT fd: whole blocks from _stage
        self._stage: mmap.mmap | None = None  # page-aligned, reused: O_DIRECT reads it in place
        self._tail = b""  # the file's bytes from the start of its last partial block to `size`
        try:
            if os.fstat(self._fd).st_size > size:  # bytes of a failed append, never acknowledged
                os.ftruncate(self._fd, size)
            self._tail = os.pread(self._fd, size % _BLOCK, size - size % _BLOCK)
            if direct and hasattr(os, "O_DIRECT"):
                try:
                    self._direct = os.open(path, os.O_WRONLY | os.O_DIRECT)
                except OSError:  # e.g. tmpfs, some network filesystems: page cache only
                    pass
        except BaseException:
            self.close()
            raise

    def append(self, buffers: list[bytes]) -> None:
        end = self.size + sum(map(len, buffers))
        if self._direct is None:
            write_all(self._fd, buffers, self.size)
        elif end - end % _BLOCK <= self.size - self.size % _BLOCK:  # still within the partial block
            write_all(self._fd, buffers, self.size)
            self._tail += b"".join(buffers)
        else:
            try:
                self._append_direct(buffers)
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: this file system's alignment rules differ
                    raise
                os.close(self._direct)
                self._direct = None
                write_all(self._fd, buffers, self.size)
        os.fdatasync(self._fd)
        self.size = end

    def _append_direct(self, buffers: list[bytes]) -> None:
        if self._stage is None:
            self._stage = mmap.mmap(-1, _STAGE, flags=mmap.MAP_PRIVATE)  # private: O_DIRECT pins it cheaply
        stage = memoryview(self._stage)
        try:
            at = self.size - len(self._tail)  # file offset of stage[0]: block-aligned
            fill = len(self._tail)
            stage[:fill] = self._tail
            for buffer in buffers:
                view = memoryview(buffer)
                while view:
                    n = min(_STAGE - fill, len(view))
                    stage[fill : fill + n] = view[:n]
                    fill, view = fill + n, view[n:]
                    if fill == _STAGE:
                        _pwrite_exactly(self._direct, stage, at)
                        at, fill = at + _STAGE, 0
            whole = fill - fill % _BLOCK
            if whole:
                _pwrite_exactly(self._direct, stage[:whole], at)
            tail = bytes(stage[whole:fill])
            write_all(self._fd, [tail], at + whole)
            self._tail = tail
        finally:
            stage.release()

    def close(self) -> None:
        for fd in (self._fd, self._direct):
            if fd is not None:
                os.close(fd)
        self._fd = self._direct = None
        if self._stage is not None:
            # After a failed write (a full disk) the exception being raised still holds a view of
            # the stage; the mapping is freed with it, and closing it here would hide that error.
            with contextlib.suppress(BufferError):
                self._stage.close()
            self._stage = None


def _pwrite_exactly(fd: int, data: memoryview, offset: int) -> None:
    # A short O_DIRECT write cannot be resumed at an unaligned offset: the append fails instead, and
    # reopening the segment cuts off whatever it left. A write cut short without an error means the
    # disk had no room for the rest: ENOSPC, so callers can wait for space like after a failed write.
    written = os.pwrite(fd, data, offset)
    if written != len(data):
        raise OSError(errno.ENOSPC, f"short O_DIRECT write: {written} of {len(data)} bytes at byte {offset} "
                                    "(no space left on the device?)")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
