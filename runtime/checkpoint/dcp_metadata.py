"""DCP's `.metadata` file, read without trusting it: the one pickle Reel ever loads.

torch.distributed.checkpoint writes `.metadata` with `pickle.dump` and its FileSystemReader reads it
with `pickle.load`, which runs whatever the file says. Reel loads it only after the checkpoint's
manifest (whose sha256 the StepCommitted names) has vouched for the file's sha256, and then through
an unpickler that resolves only the names DCP's own metadata is made of: its dataclasses, torch
dtypes, torch.Size, the layout lookup and PosixPath. Anything else is refused with the name it
asked for. The storage files the metadata points to must be the manifest's own files.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from reel.runtime.checkpoint.single import CheckpointError

__all__ = ["read_metadata", "CheckedReader", "ADMITTED"]

# (module, name) pairs a DCP metadata pickle refers to besides torch.distributed.checkpoint.metadata's
# own classes (dataclasses and an enum: data, no behaviour on load).
ADMITTED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a dict lookup of torch.strided etc. by name
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == dcp_metadata.__name__ and isinstance(getattr(dcp_metadata, name, None), type):
            return getattr(dcp_metadata, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in ADMITTED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refers to {module}.{name}, which is not part of DCP's metadata")


def read_metadata(data: bytes, source: str, files: set[str]) -> Metadata:
    """DCP metadata from `data` (already hash-checked), refusing any other object and any storage file
    outside `files` (the manifest's names)."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # noqa: BLE001 - a crafted pickle can raise anything; all of it means "refused"
        raise CheckpointError(f"{source}: its .metadata is not DCP metadata ({exc}); the checkpoint was "
                              "tampered with, delete it and the run's checkpoints after it") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{source}: its .metadata holds a {type(metadata).__name__}, not DCP metadata")
    for info in (metadata.storage_data or {}).values():
        relative = getattr(info, "relative_path", None)
        if relative not in files:
            raise CheckpointError(f"{source}: its .metadata points at {relative!r}, which is not one of the "
                                  "checkpoint's files")
    return metadata


class CheckedReader(FileSystemReader):
    """FileSystemReader that returns metadata read by `read_metadata` instead of unpickling the file."""

    def __init__(self, path: Path, metadata: Metadata):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata
