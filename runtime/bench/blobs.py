"""`reel bench blobs`: put and get MB/s of the Mooncake backend against the file backend.

Both through BlobBackend, so a get includes the sha256 check either way. File: a put writes a temp
file, fsyncs it and renames it into place; a get reads it back (from the page cache: the same host).
Mooncake: a local master and holder over TCP (mooncake_service.py), a pure client puts (upsert) and
gets. Fresh random bytes per round; each figure is the best of the rounds. ratio = Mooncake get MB/s
/ file get MB/s. On one host the store pays for a TCP hop the page cache does not, so expect < 1:
Mooncake is there for nodes that share no filesystem (and RDMA between them).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from reel.bus.blob_backends.file import BlobStore
from reel.bus.blob_backends.mooncake import MooncakeBlobs
from reel.bus.blob_backends.mooncake_service import MooncakeService
from reel.bus.blobs import BlobBackend
from reel.bus.jsonout import print_json

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
    nbytes, rounds = (8 << 20, 2) if args.quick else (64 << 20, 4)
    with tempfile.TemporaryDirectory(prefix="reel-bench-blobs-", dir=os.environ.get("REEL_BENCH_DIR")) as tmp:
        files = _rates(BlobStore(Path(tmp) / "blobs"), nbytes, rounds)
        with MooncakeService(Path(tmp) / "mooncake", segment_bytes=4 * nbytes) as service:
            store = MooncakeBlobs(service.address, buffer_bytes=2 * nbytes)
            try:
                mooncake = _rates(store, nbytes, rounds)
            finally:
                store.close()
    print_json({
        "bench": "blobs", "blob_bytes": nbytes, "rounds": rounds, "protocol": "tcp",
        "file_put_mb_per_s": files[0], "file_get_mb_per_s": files[1],
        "mooncake_put_mb_per_s": mooncake[0], "mooncake_get_mb_per_s": mooncake[1],
        "ratio": round(mooncake[1] / files[1], 3),
    })
    return 0


def _rates(store: BlobBackend, nbytes: int, rounds: int) -> tuple[float, float]:
    """(best put MB/s, best get MB/s) over `rounds` fresh blobs."""
    puts, gets = [], []
    for _ in range(rounds):
        data = os.urandom(nbytes)
        start = time.perf_counter()
        ref = store.put(data)
        puts.append(nbytes / (time.perf_counter() - start))
        start = time.perf_counter()
        store.get(ref)
        gets.append(nbytes / (time.perf_counter() - start))
    return round(max(puts) / 1e6, 1), round(max(gets) / 1e6, 1)
