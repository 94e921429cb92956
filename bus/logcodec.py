"""At-rest encoding of routing traces: zstd-packed log records and trace blobs.

A log record's event bytes are stored either as they came off the bus, or as PACKED followed by a zstd
frame of them. 0xC1 is the one byte msgpack never uses, so no event starts with it: readers tell the
two apart by the first byte, a log written before this encoding (raw records only) reads unchanged,
and one stream may mix both. Unpacking gives back the exact bytes the bus delivered, so everything
downstream (CRC-checked reads, the index, decoding, a newer producer's extra fields) is unaffected.
A RoutingTrace's blob (a group too big to travel inline) is packed the same way by the rollout worker,
and read either way (runtime/train/batch.py decode_routing).

Measured on the example's routing traces (docs/storage.md, "Routing traces at rest"): zstd-3 of a
whole RoutingTrace event is 7x smaller at ~280 MB/s to encode and ~470 MB/s to decode; a group's 16
samples share their prompt's routing, which zstd finds and a bit-pack of the ids cannot.
"""

from __future__ import annotations

import zstandard

from reel.bus.logformat import BadRecord

__all__ = ["PACKED", "PACKED_STREAMS", "LEVEL", "HEAD_BYTES", "pack", "unpack", "unpacked_size"]

PACKED = b"\xc1\x01"  # marker (a byte msgpack never uses) + encoding version 1: one zstd frame
PACKED_STREAMS = frozenset({"routing"})  # streams whose records are packed when written
LEVEL = 3  # zstd-9 is 8% smaller on the example's traces but encodes 5x slower
# Bigger inputs (a real-shape group's trace blob): a 128 MB window and long-distance matching, so a
# sample's prompt routing is found again in the next sample however long the samples are (level 3's own
# window is 2 MB, ~5k tokens at 48 layers x top-8). Readers need no setting: 128 MB is zstd's default limit.
_LONG_FROM = 1 << 21
_LONG = zstandard.ZstdCompressionParameters.from_level(LEVEL, window_log=27, enable_ldm=True)
HEAD_BYTES = len(PACKED) + 18  # marker + the longest zstd frame header: enough for unpacked_size


def pack(data: bytes) -> bytes:
    """The at-rest form of event bytes; the raw bytes when packing would not make them smaller."""
    if len(data) > _LONG_FROM:
        packed = PACKED + zstandard.ZstdCompressor(compression_params=_LONG).compress(data)
    else:
        packed = PACKED + zstandard.compress(data, LEVEL)
    return packed if len(packed) < len(data) else data


def unpack(stored: bytes) -> bytes:
    """The bytes `stored` holds, packed or raw; BadRecord if packed bytes do not unpack."""
    if stored[:1] != PACKED[:1]:
        return stored
    if stored[:2] != PACKED:
        raise BadRecord(f"an unknown at-rest encoding 0x{stored[1:2].hex()} (written by a newer Reel?)")
    try:
        return zstandard.decompress(stored[2:])
    except zstandard.ZstdError as exc:
        raise BadRecord(f"packed bytes that do not unpack ({exc})") from None


def unpacked_size(head: bytes, size: int) -> int:
    """Bytes that `size` stored bytes unpack to, from their first HEAD_BYTES (a zstd frame records it)."""
    if head[:2] != PACKED:
        return size
    try:
        return zstandard.frame_content_size(head[2:])
    except zstandard.ZstdError:
        return size
