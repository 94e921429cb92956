"""bus/jsonout.py: the one encoder behind `--json`, `log cat`, `metrics export` and bench lines."""

from __future__ import annotations

import io
import math

import msgspec
import numpy as np
import orjson

from reel.bus.jsonout import json_line, print_json


class _Row(msgspec.Struct):
    step: int
    staleness: dict[int, int]
    kl: float | None


def test_structs_int_keys_numpy_and_nan_become_one_json_line():
    line = json_line({"rows": [_Row(3, {0: 10, 2: 5}, None)], "mean": np.float32(0.5), "bad": math.nan,
                      "text": "two\nlines"})
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert orjson.loads(line) == {"rows": [{"step": 3, "staleness": {"0": 10, "2": 5}, "kl": None}],
                                  "mean": 0.5, "bad": None, "text": "two\nlines"}


def test_print_json_writes_and_flushes():
    out = io.BytesIO()
    print_json({"bench": "x", "ratio": 1.25}, out)
    assert out.getvalue() == b'{"bench":"x","ratio":1.25}\n'
