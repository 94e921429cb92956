"""Reel's C kernels: compiled on first use with the machine's C compiler, loaded with ctypes.

A kernel is one C file next to the Python that calls it. `load(source)` compiles it once
(`cc -O3 -march=native`, about a second) into $REEL_CACHE/native/ under a name that hashes the
source, the flags and the CPU, so an edit or another machine never picks up a stale build, and the
build is renamed into place (processes that race each build their own copy; one wins). Where no
compiler works (or REEL_NATIVE=0, see `enabled`), callers keep their torch implementation.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

from reel.runtime.config.run import cache_dir

__all__ = ["enabled", "load"]

log = logging.getLogger(__name__)

FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c11"]


def enabled() -> bool:
    """Whether C kernels may run: REEL_NATIVE=0 turns them off (to compare against torch)."""
    return os.environ.get("REEL_NATIVE") != "0"


def _cpu() -> str:
    try:
        flags = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")]
        return flags[0] if flags else platform.processor()
    except OSError:
        return platform.processor()


@functools.cache
def load(source: Path) -> ctypes.CDLL | None:
    """The compiled `source`; None (with a warning) where it cannot be built."""
    try:  # a missing source (an install without it) falls back to torch like a missing compiler
        digest = hashlib.sha256(b"\0".join([source.read_bytes(), " ".join(FLAGS).encode(),
                                            _cpu().encode()])).hexdigest()[:16]
        path = cache_dir("native") / f"{source.stem}-{digest}.so"
        if not path.exists():
            _build(source, path)
    except (OSError, subprocess.SubprocessError) as exc:  # no source, no compiler, a failed build, a read-only cache
        detail = getattr(exc, "stderr", b"") or b""
        log.warning("%s did not build (%s %s); running its torch version instead",
                    source.name, exc, detail.decode(errors="replace")[-500:])
        return None
    return ctypes.CDLL(str(path))


def _build(source: Path, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # built aside, renamed in: atomic
        built = Path(tmp) / path.name
        subprocess.run([os.environ.get("CC", "cc"), *FLAGS, "-o", str(built), str(source), "-lm"],
                       check=True, capture_output=True, timeout=120)
        os.replace(built, path)
