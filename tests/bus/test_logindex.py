"""The log index (bus/logindex.py): lookups by group, step and (producer, seq); incremental, derived data."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from reel.runtime.bench.log_seek import _write
from reel.bus.events import decode
from reel.bus.log import LogCorrupted
from reel.bus.run_log import RunLog
from reel.bus.logindex import INDEX_FILE, LogIndex
from reel.runtime.launch.cli import main as reel


def _locate(run_dir: Path, step: int) -> list[str]:
    with LogIndex(RunLog(run_dir, readonly=True), run_dir) as index:
        index.sync()
        commit = decode(index.commit(step).data)
        return [decode(index.group(stream, g).data).group_id for g in commit.groups
                for stream in ("trajectories", "routing")]


def test_a_step_and_its_groups_are_found_and_later_appends_are_indexed_next_sync(tmp_path):
    _write(tmp_path, steps=30)
    with LogIndex(RunLog(tmp_path, readonly=True), tmp_path) as index:
        assert index.sync() == 30 * 17
        assert index.sync() == 0
        commit = decode(index.commit(12).data)
        assert commit.step == 12 and commit.groups == [f"g12-{i}" for i in range(8)]
        trace = decode(index.group("routing", "g12-3").data)
        assert type(trace).__name__ == "RoutingTrace" and trace.group_id == "g12-3"
        stream, record = index.key("trainer:0", commit.seq)
        assert stream == "steps" and decode(record.data) == commit
        assert index.group("trajectories", "g99-0") is None and index.commit(31) is None
    segment = sorted((tmp_path / "log" / "steps").glob("*.seg"))[-1]
    with open(segment, "ab") as f:  # half a record, as a batch being written leaves it: indexed once whole
        f.write(segment.read_bytes()[:20])
    with LogIndex(RunLog(tmp_path, readonly=True), tmp_path) as index:
        assert index.sync() == 0 and index.commit(30) is not None


def test_a_lost_or_damaged_index_is_rebuilt_from_the_log(tmp_path):
    _write(tmp_path, steps=5)
    assert _locate(tmp_path, 3)[:2] == ["g3-0", "g3-0"]
    (tmp_path / INDEX_FILE).unlink()
    assert _locate(tmp_path, 4)[-1] == "g4-7"
    for suffix in ("", "-wal", "-shm"):
        Path(f"{tmp_path / INDEX_FILE}{suffix}").unlink(missing_ok=True)
    (tmp_path / INDEX_FILE).write_bytes(b"not sqlite" * 100)
    assert _locate(tmp_path, 5)[0] == "g5-0"


def test_bench_log_seek_quick(capsys):
    assert reel(["bench", "log-seek", "--quick"]) == 0
    out = orjson.loads(capsys.readouterr().out)
    assert [s["events"] for s in out["sizes"]] == [986, 9996] and out["ratio"] > 0


def test_a_damaged_record_is_named_not_taken_for_the_end_of_the_log(tmp_path):
    _write(tmp_path, steps=3)
    with RunLog(tmp_path, readonly=True) as run_log:
        record = list(run_log.stream("trajectories").records())[5]
    with open(record.segment, "r+b") as f:
        f.seek(record.offset + 8 + len(record.data) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    with LogIndex(RunLog(tmp_path, readonly=True), tmp_path) as index:
        with pytest.raises(LogCorrupted, match=f"byte {record.offset} of segment {record.segment}"):
            index.sync()
        assert index.group("trajectories", "g1-4") is not None  # the records before it stay indexed
