"""The benches' baselines do the work the way Reel does it, so a ratio measures Reel, not a handicap."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import redis

from reel.bus import bench


def test_raw_bus_writer_overlaps_its_fdatasync_with_the_next_read(redis_url: str, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch):
    # 300 events wait; the writer reads at most 256 a round. On a slow disk (the first fdatasync
    # takes 0.5 s) the overlapped writer (the archiver's way) has read the other 44 before it returns.
    key, client = "raw:overlap", redis.Redis.from_url(redis_url)
    for _ in range(300):
        client.xadd(key, {b"e": b"x" * 10})
    real_fdatasync, pending_during_sync = os.fdatasync, []

    def slow_fdatasync(fd: int) -> None:
        if not pending_during_sync:
            time.sleep(0.5)
            pending_during_sync.append(client.xpending(key, "writer")["pending"])
        real_fdatasync(fd)

    monkeypatch.setattr(os, "fdatasync", slow_fdatasync)
    assert bench.raw_read(redis_url, key, "writer", "300", str(tmp_path / "events.bin")) == 0
    assert (tmp_path / "events.bin").stat().st_size == 3000
    assert pending_during_sync == [300]  # in line, the next read would wait: 256
    assert client.xpending(key, "writer")["pending"] == 0
