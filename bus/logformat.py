"""The record format of bus/log.py, and the low-level disk calls it needs.

Record (little-endian):  [len u32][crc32c u32][payload: len bytes],  payload = msgpack [entry id, event]

The CRC covers the length bytes as well as the payload, so a damaged length cannot pass for a shorter
record and a zero-filled tail (a file extended without its data) never checks. The payload's msgpack
prefix is written by hand so the event bytes go to the kernel with `writev` uncopied.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import crc32c
import msgspec
import numpy as np

__all__ = ["HEADER", "BadRecord", "entry_order", "frame", "check", "good_record_after", "write_all", "fsync_dir"]

HEADER = struct.Struct("<II")
_IOV_MAX = 1024
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


def write_all(fd: int, buffers: list[bytes]) -> None:
    views = [memoryview(b) for b in buffers]
    i = 0
    while i < len(views):
        written = os.writev(fd, views[i : i + _IOV_MAX])
        while i < len(views) and written >= len(views[i]):
            written -= len(views[i])
            i += 1
        if written:
            views[i] = views[i][written:]


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
