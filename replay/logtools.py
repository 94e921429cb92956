"""`reel log verify` and `reel log cat`: read a run's on-disk log without touching it.

Both open the log read-only: a torn tail left by a crashed archiver is reported, not repaired
(the archiver repairs it when it next opens the log), so they are safe on a live run.
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from bus.events import Tensor
from bus.jsonout import json_line
from bus.log import RunLog

# Tensors up to this many elements are printed whole; bigger ones as a summary and a head.
_FULL_TENSOR = 256
_HEAD = 8


def verify(args: argparse.Namespace) -> int:
    """Check every record's framing and CRC; one line per stream. Corruption -> exit 1 (via cli)."""
    with RunLog(Path(args.run_dir), readonly=True) as run_log:
        total = 0
        for name in run_log.names():
            count = sum(1 for _ in run_log.stream(name).records())
            torn = run_log.stream(name).torn_bytes
            note = f"  (torn tail of {torn} bytes; repaired when the archiver next opens it)" if torn else ""
            print(f"{name:<14}{count:>10} records{note}")
            total += count
        print(f"ok: {total} records in {len(run_log.names())} streams, every CRC checked")
    return 0


def cat(args: argparse.Namespace) -> int:
    """Print a stream's events as JSON lines: {"entry_id": ..., "type": ..., fields...}."""
    out = sys.stdout.buffer
    with RunLog(Path(args.run_dir), readonly=True) as run_log:
        try:
            for entry_id, event in run_log.events(args.stream):
                line = {"entry_id": entry_id, "type": type(event).__struct_config__.tag, **_readable(event)}
                out.write(json_line(line))
            out.flush()
        except BrokenPipeError:
            # The reader (e.g. `| head`) has gone; silence the flush Python would retry at exit.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _readable(value: Any) -> Any:
    """JSON-ready form: tensors as values (small) or dtype/shape and a head (big), bytes as base64."""
    if isinstance(value, Tensor):
        array = value.numpy()
        if value.dtype == "bfloat16":  # travels as raw 16-bit patterns: widen to float32 to print
            array = (array.astype(np.uint32) << 16).view(np.float32)
        summary = f"{value.dtype}{list(value.shape)}"
        if array.size <= _FULL_TENSOR:
            return {"tensor": summary, "values": array.tolist()}
        return {"tensor": summary, "nbytes": len(value.data), "head": array.reshape(-1)[:_HEAD].tolist()}
    if isinstance(value, msgspec.Struct):
        return {field: _readable(getattr(value, field)) for field in value.__struct_fields__}
    if isinstance(value, (list, tuple)):
        return [_readable(v) for v in value]
    if isinstance(value, dict):
        return {k: _readable(v) for k, v in value.items()}
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    return value
