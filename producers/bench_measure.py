"""How `reel bench swap` measures: best-of-N seconds, a page cache dropped first, a process's peak RSS."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from reel.bus.blob_backends.file import BlobStore
from reel.bus.events import BlobRef

__all__ = ["RssPeak", "rss", "best", "best_cold", "evict", "secs", "gb", "rate"]



class RssPeak:
    """Peak rise of this process's resident memory over its level at `with` entry, across uses (MB)."""

    def __init__(self) -> None:
        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> RssPeak:
        self._base = rss()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak_mb = max(self.peak_mb, round((rss() - self._base) / 1e6, 1))


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def best(rounds: int, run: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def secs(seconds: float) -> float:
    return round(seconds, 4)


def gb(nbytes: int) -> float:
    return round(nbytes / 1e9, 3)


def rate(nbytes: int, seconds: float) -> float:
    return round(nbytes / 1e9 / seconds, 2)


def evict(blobs: BlobStore, refs: list[BlobRef]) -> None:
    """Drops the files from the page cache (they were fsynced when stored, so their pages are clean)."""
    for ref in refs:
        fd = os.open(blobs.path(ref), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def best_cold(rounds: int, blobs: BlobStore, refs: list[BlobRef], run: Callable[[], object]) -> float:
    """Best seconds of `run` over `rounds`, the files dropped from the page cache before each."""
    best = float("inf")
    for _ in range(rounds):
        evict(blobs, refs)
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best
