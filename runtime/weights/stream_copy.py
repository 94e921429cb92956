"""`copy_into(dst, src)`: dst.copy_(src) for the large copies of a weight swap, written with
non-temporal stores (stream_copy.c) where the C build is there (runtime/cbuild.py).

Measured on this 2-core machine (547M bf16 parameters into fp32, 2 threads): 0.17 s against
0.27 s for torch's copy_, which reads every destination line into the cache before writing it.
The C path takes contiguous CPU tensors, bf16 into fp32 or one dtype into the same; anything else,
or a tensor under `_SMALL` bytes, is torch's copy_. Both give the same bits.
"""

from __future__ import annotations

import ctypes

import torch

from reel.runtime import cbuild
from reel.runtime.package_files import package_file

__all__ = ["copy_into"]

_SOURCE = package_file(__package__, "stream_copy.c")
_SMALL = 1 << 16  # below this, a call's overhead outweighs the stores it saves


def _library() -> ctypes.CDLL | None:
    return cbuild.load(_SOURCE) if cbuild.enabled() else None


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src), bit for bit; shapes must match (no broadcasting)."""
    if dst.shape != src.shape:
        raise ValueError(f"copy_into: shape {tuple(src.shape)} into {tuple(dst.shape)}")
    lib = _native(dst, src)
    if lib is None:
        dst.copy_(src)
    elif src.dtype == dst.dtype:
        lib.reel_stream_bytes(ctypes.c_void_p(src.data_ptr()), ctypes.c_void_p(dst.data_ptr()),
                              ctypes.c_int64(dst.numel() * dst.element_size()))
    else:
        lib.reel_widen_bf16(ctypes.c_void_p(src.data_ptr()), ctypes.c_void_p(dst.data_ptr()),
                            ctypes.c_int64(dst.numel()))


def _native(dst: torch.Tensor, src: torch.Tensor) -> ctypes.CDLL | None:
    same = src.dtype == dst.dtype
    if not (same or (src.dtype == torch.bfloat16 and dst.dtype == torch.float32)):
        return None
    if dst.device.type != "cpu" or src.device.type != "cpu" or not (dst.is_contiguous() and src.is_contiguous()):
        return None
    if dst.numel() * dst.element_size() < _SMALL:
        return None
    return _library()
