"""`reel bench log`: StreamLog.append_batch against the raw disk.

Figures: MB/s of StreamLog.append_batch (framing, CRC, group commit: one fdatasync per batch) over a
raw sequential write + one fdatasync per batch of the same bytes, to the same directory. Both run
alternately (rounds) and each one's best is kept.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from reel.bus.events import encode
from reel.bus.jsonout import print_json
from reel.bus.log import StreamLog
from reel.runtime.bench.common.bus_pipeline import trajectory


def run(args: argparse.Namespace) -> int:
    batches, rounds = (8, 1) if args.quick else (60, 3)
    per_batch = 64  # records per group commit (the archiver's batch is up to 256 per stream)
    data = encode(trajectory())
    raw, logged = [], []
    with tempfile.TemporaryDirectory(prefix="reel-bench-log-", dir=os.environ.get("REEL_BENCH_DIR")) as tmp:
        for r in range(rounds):
            raw.append(_raw_write(Path(tmp) / f"raw{r}", data, per_batch, batches))
            logged.append(_log_append(Path(tmp) / f"log{r}", data, per_batch, batches))
    total = len(data) * per_batch * batches
    print_json({
        "bench": "log", "bytes_per_round": total, "record_bytes": len(data), "records_per_fdatasync": per_batch,
        "rounds": rounds, "raw_mb_per_s": round(max(raw) / 1e6, 1), "log_mb_per_s": round(max(logged) / 1e6, 1),
        "ratio": round(max(logged) / max(raw), 3),
    })
    return 0


def _raw_write(path: Path, data: bytes, per_batch: int, batches: int) -> float:
    block = data * per_batch
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        start = time.perf_counter()
        for _ in range(batches):
            os.write(fd, block)
            os.fdatasync(fd)
        return len(block) * batches / (time.perf_counter() - start)
    finally:
        os.close(fd)
        path.unlink()


def _log_append(directory: Path, data: bytes, per_batch: int, batches: int) -> float:
    try:
        with StreamLog(directory) as log:
            start = time.perf_counter()
            for b in range(batches):
                log.append_batch([(f"{b + 1}-{i}", data) for i in range(per_batch)])
            return len(data) * per_batch * batches / (time.perf_counter() - start)
    finally:
        shutil.rmtree(directory)
