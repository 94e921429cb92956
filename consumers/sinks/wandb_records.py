"""W&B offline run files (`run-ID.wandb`) read back with W&B's own record protobuf.

The file is W&B's transaction log: a 7-byte header (":W&B", magic 0xBEE1, version 0), then
LevelDB-log framing in 32 KiB blocks (each record chunk: CRC32, length, type FULL/FIRST/MIDDLE/
LAST), the chunks joined into serialized `wandb_internal_pb2.Record`s. The SDK no longer ships a
Python scanner for it, and the W&B sink must read its own files to resume, so this is one.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from reel.consumers.sinks.base import require_library

__all__ = ["history_rows", "records"]

HEADER = b":W&B"
HEADER_BYTES = 7
BLOCK = 32 * 1024
CHUNK_HEADER = 7  # crc32 (4), length (2), type (1)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _payloads(data: bytes) -> Iterator[bytes]:
    """Each whole record's bytes; a torn tail (a killed writer) ends the file."""
    pos, parts = HEADER_BYTES, []
    while pos + CHUNK_HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < CHUNK_HEADER:  # the block's tail is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack_from("<IHB", data, pos)
        start, pos = pos + CHUNK_HEADER, pos + CHUNK_HEADER + length
        if kind == 0 or pos > len(data):
            return
        parts.append(data[start:pos])
        if kind in (FULL, LAST):
            yield b"".join(parts)
            parts = []


def records(path: Path) -> Iterator[Any]:
    """The Records of one offline run file, in write order."""
    pb = require_library("wandb.proto.wandb_internal_pb2", "wandb")
    data = path.read_bytes()
    if not data.startswith(HEADER):
        raise ValueError(f"{path} is not a W&B run file (no :W&B header)")
    for payload in _payloads(data):
        record = pb.Record()
        record.ParseFromString(payload)
        yield record


def history_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(step, {key: value}) of every history row the file holds (W&B's own _step, _runtime, ... dropped)."""
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            yield record.history.step.num, {k: v for k, v in items.items() if not k.startswith("_")}
