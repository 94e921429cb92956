"""How `reel bench swap` measures: best-of-N seconds, a page cache dropped first, a process's peak RSS."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from reel.bus.blob_backends.file import BlobStore
from reel.bus.events import BlobRef

__all__ = ["RssPeak", "rss", "best", "best_cold", "evict", "secs", "gb", "rate"]



class RssPeak:
    """Peak rise of this process's resident memory over its level at `with` entry, across uses (MB).

    The kernel keeps the peak (VmHWM in /proc/self/status, reset through /proc/self/clear_refs), so
    the measured code runs undisturbed: a thread sampling RSS every 2 ms slowed a 0.2 s weight copy
    by about a fifth here (each sample takes the memory map's lock that page faults and madvise
    take). A `with` resets that mark: uses do not nest."""

    def __init__(self) -> None:
        self.peak_mb = 0.0
        self._base = 0

    def __enter__(self) -> RssPeak:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
        except OSError as exc:
            raise RuntimeError(f"peak memory is read from the kernel's high-water mark, which this system does "
                               f"not let the process reset ({exc})") from exc
        self._base = rss()
        return self

    def __exit__(self, *exc: object) -> None:
        self.since_entry_mb()

    def since_entry_mb(self) -> float:
        """The peak rise since the `with` entry so far (also kept in peak_mb)."""
        with open("/proc/self/status") as f:
            hwm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        mb = round((hwm_kb * 1024 - self._base) / 1e6, 1)
        self.peak_mb = max(self.peak_mb, mb)
        return mb


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
