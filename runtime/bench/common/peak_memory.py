"""Peak memory of a stretch of code, measured rather than counted.

    mark = PeakMemory.start(device)   ...work...   mark.peak_bytes()

CPU: the process's peak resident set (VmHWM) above its resident set at `start`, after resetting
the peak (`/proc/self/clear_refs` 5): everything the work touched, activations, communication
buffers and the allocator's slack included. CUDA: torch.cuda.max_memory_allocated above the
allocated bytes at `start` (the caching allocator's reserve is not counted). Linux only on CPU.

On CPU, run the measured process with MALLOC_ENV and call release_free_memory() before start: with
glibc's adaptive mmap threshold, memory freed before the baseline stays in the heap and is reused
unseen, and the peak would come out too low.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import msgspec
import torch

_STATUS = Path("/proc/self/status")
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}  # fixed: big buffers are mmapped and unmapped when freed


class PeakMemory(msgspec.Struct, frozen=True):
    device: str  # "cpu" (resident set) or "cuda" (allocator)
    baseline: int  # bytes in use at start

    @classmethod
    def start(cls, device: torch.device) -> PeakMemory:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            return cls("cuda", torch.cuda.memory_allocated(device))
        try:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        except OSError as exc:
            raise RuntimeError(f"cannot reset the peak resident set through /proc/self/clear_refs ({exc}); "
                               "peak memory on CPU needs Linux with a writable /proc") from exc
        return cls("cpu", _status_bytes("VmRSS"))

    def peak_bytes(self) -> int:
        """Peak bytes in use since start, above the baseline."""
        if self.device == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.baseline
        return _status_bytes("VmHWM") - self.baseline


def release_free_memory() -> None:
    """Hand the heap's free pages back to the kernel (glibc malloc_trim; a no-op elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _status_bytes(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{_STATUS} has no {field} line; peak memory is measured on Linux only")
    return int(match.group(1)) * 1024
