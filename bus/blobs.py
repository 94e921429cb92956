"""Content-addressed blob store for payloads too big for a stream entry (weights, big routing traces).

An event carries a `BlobRef(uri, sha256, nbytes)` claim check; `get` verifies the hash and size
before returning anything, so a reader never uses bytes other than the ones the producer named.

Backends subclass `BlobBackend` (put + unverified read + delete + a listing for `reel log gc`;
verification lives in the base class so no backend can skip it), one module each in
bus/blob_backends/: `file` (local or shared filesystem, `file://` URIs; every run directory's
blobs/) and `mooncake` (a Mooncake store, `mooncake://`).
`reel.bus.blob_backends.open_blobs` picks one for a run.

    ReelError
     └── BlobError        missing, corrupted or unwritable blob; bad key
          └── BlobMissing the store does not hold the blob (never written, or deleted by retention)
"""

from __future__ import annotations

import hashlib
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from reel.bus.errors import ReelError
from reel.bus.events import BlobRef

__all__ = ["BlobError", "BlobMissing", "BlobBackend", "check_key"]

_SHA256 = re.compile(r"[0-9a-f]{64}")


class BlobError(ReelError):
    """A blob is missing, fails its hash check, cannot be written, or its key is not a sha256."""


class BlobMissing(BlobError):
    """The store does not hold the blob: never written, or deleted by retention (bus/retention.py)."""


def check_key(sha256: str) -> str:
    # Keys become path components: only 64 lowercase hex chars can never escape the store.
    if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
        raise BlobError(f"blob key {sha256!r} is not a sha256 (64 lowercase hex characters)")
    return sha256


class BlobBackend(ABC):
    """Where blobs live. Subclasses store and fetch bytes; `get` verifies them."""

    @abstractmethod
    def put(self, data: bytes | Path) -> BlobRef:
        """Store bytes (or a file's contents); returns the claim check. Idempotent."""

    @abstractmethod
    def read(self, ref: BlobRef) -> bytes:
        """The stored bytes, unverified, at most ref.nbytes + 1 of them; BlobMissing if absent."""

    @abstractmethod
    def delete(self, ref: BlobRef) -> int:
        """Remove the blob; the bytes freed (0 when it was not there). Idempotent."""

    @abstractmethod
    def keys(self) -> dict[str, int]:
        """sha256 -> stored bytes of every blob the store holds (what `reel log gc` and `log du` see)."""

    def get(self, ref: BlobRef) -> bytes:
        """The blob's bytes after checking size and sha256 against `ref`."""
        check_key(ref.sha256)
        data = self.read(ref)
        if len(data) != ref.nbytes:
            raise BlobError(f"blob {ref.sha256} ({ref.uri}) has {len(data)} bytes, its reference says {ref.nbytes}")
        actual = hashlib.sha256(data).hexdigest()
        if actual != ref.sha256:
            raise BlobError(f"blob {ref.sha256} ({ref.uri}) is corrupted: its bytes hash to {actual}")
        return data

    def put_parts(self, parts: Iterable[bytes | memoryview]) -> BlobRef:
        """Store the concatenation of `parts` (a weight shard, header then tensors). Backends that can
        write as they go hash and write part by part; this default joins them into one put."""
        return self.put(b"".join(parts))

    @contextmanager
    def mapped(self, ref: BlobRef) -> Iterator[memoryview]:
        """The stored bytes, unverified, as a buffer (a map of the file where the backend has files);
        the caller verifies them, as weight loading does shard by shard. Valid inside the block only."""
        check_key(ref.sha256)
        yield memoryview(bytearray(self.read(ref)))  # writable, as tensors viewing it must be
