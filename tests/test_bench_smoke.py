"""`reel bench bus|log --quick`: each prints one JSON line with a positive ratio."""

from __future__ import annotations

import orjson
import pytest

from runtime import cli


@pytest.mark.parametrize("name", ["bus", "log"])
def test_bench_quick_prints_one_json_line(name: str, capsys: pytest.CaptureFixture):
    assert cli.main(["bench", name, "--quick"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    result = orjson.loads(line)
    assert result["bench"] == name and result["ratio"] > 0
