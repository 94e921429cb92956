"""Safetensors written from tensors in place and read in place: no shard is ever one Python buffer.

Writing yields the header and then each tensor's own memory, so a store can hash and write a shard
part by part. Reading parses the header of a mapped file and gives tensors that view the mapping.
The header follows the safetensors library byte for byte (tensors ordered by dtype size, largest
first, then by name; compact JSON padded with spaces to 8 bytes), so `canonical_sha256` of a model's
tensors equals the sha256 of `state_dict_bytes` (StepCommitted.weights_sha256) without building it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import torch

__all__ = ["ShardFormatError", "DTYPE_NAMES", "ordered", "shard_parts", "canonical_sha256",
           "Entry", "read_header", "tensor_at"]

DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
               torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}
_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}
_METADATA = {"format": "pt"}
_MAX_HEADER = 100 << 20  # the safetensors library's own limit


class ShardFormatError(ValueError):
    """Bytes that are not a safetensors file this module can read (the message says what is wrong)."""


def ordered(tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The safetensors library's order: larger dtypes first, then by name."""
    return sorted(tensors, key=lambda item: (-item[1].element_size(), item[0]))


def _header(tensors: list[tuple[str, torch.Tensor]]) -> bytes:
    entries: dict[str, object] = {"__metadata__": _METADATA}
    offset = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        entries[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _memory(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (a contiguous CPU tensor; others are made so first)."""
    t = t.detach().to("cpu").contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def shard_parts(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[bytes | memoryview]:
    """A safetensors file as pieces: the header, then each tensor's memory, in the library's order."""
    items = ordered(tensors)
    yield _header(items)
    for _, t in items:
        yield _memory(t)


def canonical_sha256(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 of the safetensors file of `tensors`, computed part by part."""
    digest = hashlib.sha256()
    for part in shard_parts(tensors):
        digest.update(part)
    return digest.hexdigest()


class Entry(NamedTuple):
    name: str
    dtype: torch.dtype
    shape: torch.Size
    start: int  # absolute offset of the tensor's bytes in the file
    count: int  # elements


def read_header(data: memoryview) -> list[Entry]:
    """The tensors a safetensors buffer holds, checked to lie inside it."""
    if len(data) < 8:
        raise ShardFormatError(f"{len(data)} bytes is too short for a safetensors header")
    size = int.from_bytes(data[:8], "little")
    if not 2 <= size <= min(_MAX_HEADER, len(data) - 8):
        raise ShardFormatError(f"header length {size} does not fit a file of {len(data)} bytes")
    try:
        header = json.loads(bytes(data[8:8 + size]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ShardFormatError(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ShardFormatError("header is not a JSON object")
    start = 8 + size
    entries = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[entry["dtype"]]
            shape = torch.Size(int(n) for n in entry["shape"])
            begin, end = (int(n) for n in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ShardFormatError(f"tensor {name!r} has a bad header entry: {exc!r}") from None
        count = shape.numel()
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if min(shape, default=0) < 0 or not 0 <= begin <= end <= len(data) - start or end - begin != count * itemsize:
            raise ShardFormatError(f"tensor {name!r} ({entry['dtype']} {list(shape)}) has data offsets "
                                   f"{begin}..{end} that do not fit its shape or the file")
        entries.append(Entry(name, dtype, shape, start + begin, count))
    return entries


def tensor_at(data: memoryview, entry: Entry) -> torch.Tensor:
    """A view of the buffer (keep the buffer open while it is used)."""
    if entry.count == 0:
        return torch.empty(entry.shape, dtype=entry.dtype)
    return torch.frombuffer(data, dtype=entry.dtype, count=entry.count, offset=entry.start).view(entry.shape)
