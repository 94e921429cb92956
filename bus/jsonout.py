"""The one JSON encoder of Reel's machine-readable output: `--json`, `log cat`, `metrics export`
and `reel bench` lines all go through `json_line`, so they agree on the format: compact UTF-8,
one object per line, integer dict keys as strings, msgspec Structs and numpy values as their
JSON forms, NaN and infinities as null (orjson's choice; JSON has no spelling for them).
"""

from __future__ import annotations

import sys
from typing import Any, BinaryIO

import msgspec
import orjson

_OPTIONS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE


def _fallback(value: Any) -> Any:
    """Structs (and what orjson does not know) become builtins msgspec knows how to produce."""
    return msgspec.to_builtins(value)


def json_line(value: Any) -> bytes:
    """`value` as one line of JSON, newline included."""
    return orjson.dumps(value, default=_fallback, option=_OPTIONS)


def print_json(value: Any, out: BinaryIO | None = None) -> None:
    """Write `value` as one JSON line to `out` (default stdout) and flush it."""
    stream = out if out is not None else sys.stdout.buffer
    sys.stdout.flush()  # text printed before stays before
    stream.write(json_line(value))
    stream.flush()
