"""Blob backends, one module each (the ABC and the verification are in bus/blobs.py):

    file      blobs as files under a run's blobs/ (local or shared filesystem), file:// URIs
    mooncake  blobs in a Mooncake store, mooncake:// URIs; the run's blobs/ serves what it lost
"""

from __future__ import annotations

from pathlib import Path

from reel.bus.blob_backends.file import BlobStore
from reel.bus.blob_backends.mooncake import MooncakeAddress
from reel.bus.blobs import BlobBackend

__all__ = ["open_blobs"]


def open_blobs(run_dir: Path, mooncake: MooncakeAddress | None = None, **mooncake_options: object) -> BlobBackend:
    """The run's blob store: its blobs/ directory, or a Mooncake store backed by it."""
    files = BlobStore(Path(run_dir) / "blobs")
    if mooncake is None:
        return files
    from reel.bus.blob_backends.mooncake import MooncakeBlobs

    return MooncakeBlobs(mooncake, fallback=files, **mooncake_options)
