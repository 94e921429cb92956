"""`reel bench bus|log|blobs|fsdp --quick`: each prints one JSON line with a positive ratio."""

from __future__ import annotations

import orjson
import pytest

from reel.runtime.launch import cli


@pytest.mark.parametrize("name", ["bus", "log", "blobs", "fsdp"])
def test_bench_quick_prints_one_json_line(name: str, capsys: pytest.CaptureFixture):
    assert cli.main(["bench", name, "--quick"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    result = orjson.loads(line)
    assert result["bench"] == name and result["ratio"] > 0


@pytest.mark.slow
def test_bench_bus_partitions_on_a_local_cluster(capsys: pytest.CaptureFixture):
    assert cli.main(["bench", "bus", "--quick", "--partitions", "3"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    result = orjson.loads(line)
    assert set(result["events_per_s"]) == {"1", "3"} and result["masters_used"]["1"] == 1
    assert result["redis_cpu_us_per_event"]["3"] > 0 and result["ratio"] > 0
