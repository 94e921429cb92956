"""Peak memory of a stretch of code, measured rather than counted.

    mark = PeakMemory.start(device)   ...work...   mark.peak_bytes()

CPU: the process's peak resident set (VmHWM) above its resident set at `start`, after resetting
the peak (`/proc/self/clear_refs` 5): everything the work touched, activations, communication
buffers and the allocator's slack included. CUDA: torch.cuda.max_memory_allocated above the
allocated bytes at `start` (the caching allocator's reserve is not counted). Linux only on CPU.

On CPU, run the measured process with MALLOC_ENV and call release_free_memory() before start: with
glibc's adaptive mmap threshold, memory freed before the baseline stays in the heap and is reused
unseen, and the peak would come out too low.

Where the peak goes: `held_bytes` counts a model's parameters, gradients and optimizer state (the
local shards under FSDP); `SavedForBackward` measures activations, the most bytes autograd holds
for backward at once, with the gradients alive then; the rest of a peak is transient (logits,
gathered layers, gradients of activations, communication buffers, allocator slack).
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable, Iterable
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


class Held(msgspec.Struct):
    """Counted bytes of one process's (one rank's) training state."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def held_bytes(params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer) -> Held:
    """This process's bytes of parameters, gradients and optimizer state (local shards of DTensors)."""
    def nbytes(t: torch.Tensor | None) -> int:
        return 0 if t is None else _local(t).numel() * t.element_size()

    held = Held()
    for p in params:
        held.params += nbytes(p)
        held.grads += nbytes(p.grad)
        held.optimizer += sum(nbytes(v) for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor))
    return held


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank; any other tensor itself."""
    return getattr(t, "_local_tensor", t)


class SavedForBackward:
    """Activations, measured: the most bytes of tensors autograd saved for backward at once (each
    storage once; parameters, which `params()` lists as they are at that moment, e.g. a gathered
    FSDP layer, not counted), and the bytes of gradients that existed alongside them (a step sets
    gradients to None before its first forward). A backward's first unpack starts the next count."""

    def __init__(self, params: Callable[[], Iterable[torch.Tensor]]):
        self.params = params
        self.peak = 0
        self.grads_at_peak = 0
        self._seen: set[int] = set()
        self._total = 0
        self._grads = 0
        self._unpacked = True

    def __enter__(self) -> SavedForBackward:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if self._unpacked:  # a new forward: its gradients so far are constant until its backward
            self._seen, self._total, self._unpacked = set(), 0, False
            self._grads = sum(_local(p.grad).numel() * p.grad.element_size() for p in self.params() if p.grad is not None)
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._seen and ptr not in {_local(p).untyped_storage().data_ptr() for p in self.params()}:
            self._seen.add(ptr)
            self._total += storage.nbytes()
            if self._total + self._grads > self.peak + self.grads_at_peak:
                self.peak, self.grads_at_peak = self._total, self._grads
        return t

    def _unpack(self, t: torch.Tensor) -> torch.Tensor:
        self._unpacked = True
        return t


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
