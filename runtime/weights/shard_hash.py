"""The digest a reader checks a weight shard against: BLAKE3, chosen by measurement.

The blob store keys every blob by its sha256 (BlobRef.sha256), computed as it writes. A manifest
also names each shard's BLAKE3 digest (`WeightShard.digest`, `WeightManifest.hash = "blake3"`),
computed in the same pass, and a loader checks that one before any weight changes. Measured on the
2-core development machine (256 MiB in memory, 8 MiB updates): sha256 1.21 GB/s on one thread, 2.58
on two; BLAKE3 5.59 and 11.73. A loader reads a shard from the page cache at about 3 GB/s, so sha256
was most of a swap (docs/weight-sync.md) and BLAKE3 is a small part of one.

Manifests written before say `hash = "sha256"`: their shards are checked against the store key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from typing import Protocol

import blake3

from reel.bus.weight_manifest import WeightShard

__all__ = ["HASHES", "WRITE_HASH", "Digest", "new_digest", "expected_digest", "hashed"]

HASHES = ("blake3", "sha256")  # what a WeightManifest.hash may name
WRITE_HASH = "blake3"  # what publish_version and publish_delta write


class Digest(Protocol):
    def update(self, data: bytes | memoryview, /) -> object: ...
    def hexdigest(self) -> str: ...


def new_digest(algorithm: str) -> Digest:
    """A running digest of `algorithm` (a WeightManifest.hash); ValueError names an unknown one."""
    if algorithm == "blake3":
        return blake3.blake3()  # releases the GIL while hashing: loader threads hash in parallel
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown shard hash {algorithm!r} (this reader knows {', '.join(HASHES)})")


def expected_digest(algorithm: str, shard: WeightShard) -> str:
    """What the shard's bytes must hash to under the manifest's algorithm."""
    return shard.blob.sha256 if algorithm == "sha256" else shard.digest


def hashed(parts: Iterable[bytes | memoryview], digest: Digest) -> Iterator[bytes | memoryview]:
    """`parts`, each fed to `digest` as it passes: a shard is hashed in the pass that writes it."""
    for part in parts:
        digest.update(part)
        yield part
