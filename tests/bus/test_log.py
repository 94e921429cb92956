"""bus/log.py and `reel log verify|cat`: framing, torn-tail repair, corruption detection, seeks."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import msgspec
import numpy as np
import orjson
import pytest

from reel.bus.events import BlobRef, RoutingTrace, Sample, Tensor, Trajectory, WorkerStats, encode
from reel.bus.log import INDEX_EVERY, LogCorrupted, LogError, StreamLog
from reel.bus.run_log import RunLog
from reel.bus.logcodec import HEAD_BYTES, PACKED, pack, unpacked_size
from reel.bus.logformat import Appender, check
from reel.runtime.train.batch import decode_routing
from reel.runtime.launch import cli


def _event(seq: int, producer: str = "rollout:0") -> bytes:
    return encode(WorkerStats(run="r", producer=producer, seq=seq, worker="w0", tokens_per_s=1.5 * seq,
                              running=seq % 7, waiting=0, policy_version=seq // 10, groups_published=seq))


def _records(n: int, start: int = 0) -> list[tuple[str, bytes]]:
    return [(f"1700000000{i:03d}-{i % 3}", _event(i)) for i in range(start, start + n)]


def _write(directory: Path, n: int, batch: int = 10, **kw) -> list[tuple[str, bytes]]:
    records = _records(n)
    with StreamLog(directory, **kw) as log:
        for i in range(0, n, batch):
            log.append_batch(records[i : i + batch])
    return records


def _read(directory: Path, **kw) -> list[tuple[str, bytes]]:
    with StreamLog(directory, **kw) as log:
        return [(r.entry_id, r.data) for r in log.records()]


def _segments(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.seg"))


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def test_roundtrip_reopen_and_last_id(tmp_path: Path):
    records = _write(tmp_path / "s", 25)
    with StreamLog(tmp_path / "s") as log:
        assert len(log) == 25 and log.last_entry_id() == records[-1][0]
        assert [(r.entry_id, r.data) for r in log.records()] == records
        log.append_batch(_records(5, start=25))
    assert _read(tmp_path / "s") == records + _records(5, start=25)


def test_entry_ids_must_increase_and_a_bad_batch_writes_nothing(tmp_path: Path):
    records = _write(tmp_path / "s", 3)
    with StreamLog(tmp_path / "s") as log:
        with pytest.raises(ValueError, match="is not after"):
            log.append_batch(_records(2, start=3) + [records[0]])
    assert _read(tmp_path / "s") == records


def test_segment_roll_sidecars_and_rebuild(tmp_path: Path):
    records = _write(tmp_path / "s", 200, batch=7, segment_bytes=2000)
    segs = _segments(tmp_path / "s")
    assert len(segs) > 5 and all(s.stat().st_size <= 2000 for s in segs)
    assert all(s.with_suffix(".idx").exists() for s in segs[:-1])  # sealed ones only
    assert _read(tmp_path / "s", segment_bytes=2000) == records
    # Sidecars are a cache: lost or stale ones are rebuilt from the segments.
    segs[0].with_suffix(".idx").unlink()
    segs[1].with_suffix(".idx").write_bytes(b"garbage")
    assert _read(tmp_path / "s", segment_bytes=2000) == records
    assert segs[0].with_suffix(".idx").exists()


@pytest.mark.parametrize("direct", [True, False])
def test_appender_writes_exactly_the_bytes_given(tmp_path: Path, direct: bool):
    """Whole blocks go with O_DIRECT (where the filesystem allows it) from a staging buffer, the
    partial last block through the page cache; appends of every size, across reopens, and a reopen
    below the file's end (a failed append's bytes are cut off) leave exactly the appended bytes."""
    rng = np.random.default_rng(0)
    path = tmp_path / "f"
    path.write_bytes(b"")
    expected = bytearray()
    appender = Appender(path, 0, direct=direct)
    try:
        for i in range(60):
            if i % 9 == 8:  # reopen, sometimes after bytes that were never made part of the file
                appender.close()
                with open(path, "ab") as f:
                    f.write(b"unacknowledged" * (i % 2))
                appender = Appender(path, len(expected), direct=direct)
            sizes = rng.choice([1, 7, 4095, 4096, 4097, 67_000, (4 << 20) + 3], size=int(rng.integers(0, 4)))
            buffers = [rng.bytes(int(n)) for n in sizes]
            appender.append(buffers)
            expected += b"".join(buffers)
            assert appender.size == len(expected)
        assert path.read_bytes() == expected
    finally:
        appender.close()


def test_a_record_bigger_than_a_segment_gets_its_own(tmp_path: Path):
    big = ("1800000000000-0", os.urandom(5000))
    with StreamLog(tmp_path / "s", segment_bytes=1000) as log:
        log.append_batch(_records(3) + [big] + [("1800000000001-0", b"x")])
    assert _read(tmp_path / "s")[3] == big


def test_iteration_from_entry_id_and_index(tmp_path: Path):
    n = 3 * INDEX_EVERY + 17
    records = _write(tmp_path / "s", n, batch=100, segment_bytes=30_000)
    with StreamLog(tmp_path / "s", segment_bytes=30_000) as log:
        for k in (0, 1, INDEX_EVERY - 1, INDEX_EVERY, 2 * INDEX_EVERY + 5, n - 1):
            assert [r.entry_id for r in log.records(after_entry_id=records[k][0])] == [i for i, _ in records[k + 1 :]]
            assert [r.entry_id for r in log.records(start=k)] == [i for i, _ in records[k:]]
        assert list(log.records(after_entry_id="1")) and not list(log.records(after_entry_id="9999999999999-0"))
        # an id between two logged ones
        assert next(log.records(after_entry_id="1700000000005-99")).entry_id == records[6][0]


def _trace(seq: int) -> bytes:
    """A RoutingTrace like a group's: 4 samples that share their prompt's routing."""
    rng = np.random.default_rng(seq)
    prompt = rng.integers(0, 8, (12, 4, 2), dtype=np.uint8)
    experts = [Tensor.from_numpy(np.concatenate([prompt, rng.integers(0, 8, (9, 4, 2), dtype=np.uint8)]))
               for _ in range(4)]
    return encode(RoutingTrace(run="r", producer="rollout:0", seq=seq, group_id=f"g{seq}", experts=experts))


def _stored(directory: Path) -> list[bytes]:
    """The event bytes of each record as they are on disk (packed or not)."""
    return [check(memoryview(seg.read_bytes()), off)[1] for seg in _segments(directory)
            for off in _offsets(seg)]


def _offsets(seg: Path) -> list[int]:
    buf, offsets, off = memoryview(seg.read_bytes()), [], 0
    while off < len(buf):
        offsets.append(off)
        off = check(buf, off)[2]
    return offsets


def test_packed_records_read_back_exactly_and_an_old_logs_raw_records_still_read(tmp_path: Path):
    records = [(f"{i + 1}-0", _trace(i)) for i in range(30)]
    with StreamLog(tmp_path / "s") as log:  # a log written before packing: raw records
        log.append_batch(records[:10])
    with StreamLog(tmp_path / "s", packed=True, segment_bytes=4000) as log:  # then packed, across segments
        log.append_batch(records[10:])
    stored = _stored(tmp_path / "s")
    assert stored[:10] == [data for _, data in records[:10]]
    assert all(s.startswith(PACKED) and len(s) < len(d) / 2 for s, (_, d) in zip(stored[10:], records[10:]))
    with StreamLog(tmp_path / "s", readonly=True) as log:
        read = list(log.records())
        assert [(r.entry_id, r.data) for r in read] == records
        assert [log.read_at(r.segment, r.offset).data for r in read[8:12]] == [d for _, d in records[8:12]]
        assert [r.entry_id for r in log.records(start=25)] == [i for i, _ in records[25:]]
    with RunLog(tmp_path / "run") as run_log:  # a run's routing stream is packed, other streams are not
        run_log.stream("routing").append_batch(records[:2])
        run_log.stream("control").append_batch(records[:2])
        assert [e.group_id for _, e in run_log.events("routing")] == ["g0", "g1"]
    assert all(s.startswith(PACKED) for s in _stored(tmp_path / "run" / "log" / "routing"))
    assert _stored(tmp_path / "run" / "log" / "control") == [d for _, d in records[:2]]


def test_a_trace_blob_reads_packed_or_raw_and_a_bad_one_is_named():
    ids = [np.tile(np.arange(8, dtype=np.uint8).reshape(1, 4, 2), (30, 1, 1)) for _ in range(4)]
    raw = msgspec.msgpack.encode([Tensor.from_numpy(a) for a in ids])  # a blob as the rollout worker wrote it before
    packed = pack(raw)
    assert packed.startswith(PACKED) and len(packed) < len(raw) / 4
    assert unpacked_size(packed[:HEAD_BYTES], len(packed)) == len(raw) and unpacked_size(raw[:HEAD_BYTES], 9) == 9
    trace = RoutingTrace(run="r", producer="rollout:0", seq=0, group_id="g0", blob=BlobRef("blob:x", "ab12", len(raw)))
    for blob in (raw, packed):
        assert [a.tolist() for a in decode_routing(trace, blob)] == [a.tolist() for a in ids]
    with pytest.raises(ValueError, match="routing blob ab12 of group g0 holds packed bytes that do not unpack"):
        decode_routing(trace, PACKED + b"junk")


def test_a_packed_record_that_does_not_unpack_is_named(tmp_path: Path):
    with StreamLog(tmp_path / "s") as log:  # CRC-valid, but not a zstd frame
        log.append_batch(_records(3) + [("1800000000000-0", PACKED + b"not zstd")])
        with pytest.raises(LogCorrupted, match="packed bytes that do not unpack .* at byte .* of segment"):
            list(log.records())


@pytest.mark.parametrize("shape", ["partial header", "partial payload", "zero fill", "whole torn batch"])
def test_torn_tail_is_repaired_and_logged(tmp_path: Path, shape: str, caplog: pytest.LogCaptureFixture):
    records = _write(tmp_path / "s", 20)
    seg = _segments(tmp_path / "s")[-1]
    size = seg.stat().st_size
    with StreamLog(tmp_path / "s") as log:
        last = list(log.records())[-1]
        last_offset = last.offset
    keep = records
    with open(seg, "r+b") as f:
        if shape == "partial header":
            f.truncate(last_offset + 5)
            keep = records[:-1]
        elif shape == "partial payload":
            f.truncate(size - 7)
            keep = records[:-1]
        elif shape == "zero fill":
            f.seek(size)
            f.write(b"\0" * 4096)
        else:  # a batch of three records, the last one cut short
            with StreamLog(tmp_path / "extra") as other:
                other.append_batch(_records(3, start=20))
            tail = _segments(tmp_path / "extra")[0].read_bytes()
            f.seek(size)
            f.write(tail[:-10])
            keep = records + _records(2, start=20)
    with caplog.at_level(logging.WARNING, logger="reel.bus.log"):
        assert _read(tmp_path / "s") == keep
    assert "torn tail" in caplog.text and "truncated" in caplog.text
    caplog.clear()
    with StreamLog(tmp_path / "s") as log:  # repaired for good, and appendable
        log.append_batch([("1900000000000-0", b"after")])
    assert _read(tmp_path / "s")[-1] == ("1900000000000-0", b"after") and not caplog.text


@pytest.mark.parametrize("where", ["payload", "crc", "length"])
def test_flipped_byte_in_a_middle_record_names_segment_and_offset(tmp_path: Path, where: str):
    _write(tmp_path / "s", 20)
    seg = _segments(tmp_path / "s")[-1]
    with StreamLog(tmp_path / "s") as log:
        victim = list(log.records())[10]
    _flip(seg, victim.offset + {"length": 1, "crc": 5, "payload": 30}[where])
    with pytest.raises(LogCorrupted) as info:
        StreamLog(tmp_path / "s")
    message = str(info.value)
    assert f"byte {victim.offset} of segment {seg}" in message and "'s'" in message
    with pytest.raises(LogCorrupted):  # the read-only path agrees and repairs nothing
        StreamLog(tmp_path / "s", readonly=True)
    assert seg.stat().st_size > victim.offset + 100


def test_corruption_in_a_sealed_segment_is_found_on_read_and_verify(tmp_path: Path):
    _write(tmp_path / "log" / "control", 100, segment_bytes=2000)
    first = _segments(tmp_path / "log" / "control")[0]
    _flip(first, 300)
    with RunLog(tmp_path, segment_bytes=2000, readonly=True) as run_log:  # sidecar trusted on open
        with pytest.raises(LogCorrupted, match=f"segment {first}"):
            run_log.verify()


def test_one_writer_and_readonly_never_repairs(tmp_path: Path):
    _write(tmp_path / "s", 5)
    with StreamLog(tmp_path / "s"):
        with pytest.raises(LogError, match="already open for writing"):
            StreamLog(tmp_path / "s")
        assert len(StreamLog(tmp_path / "s", readonly=True)) == 5
    seg = _segments(tmp_path / "s")[0]
    with open(seg, "ab") as f:
        f.write(b"\x10\x00")
    size = seg.stat().st_size
    reader = StreamLog(tmp_path / "s", readonly=True)
    assert len(reader) == 5 and reader.torn_bytes == 2 and seg.stat().st_size == size
    with pytest.raises(LogError, match="read-only"):
        reader.append_batch(_records(1, start=5))


def _trajectory(seq: int) -> Trajectory:
    tokens = Tensor.from_numpy(np.arange(300, dtype=np.int32))
    sample = Sample(tokens=tokens, logprobs=Tensor.from_numpy(np.zeros(4, np.float32)), reward=1.0,
                    finish_reason="stop", seed=seq, spans=[(0, 3)])
    return Trajectory(run="r", producer="rollout:1", seq=seq, group_id=f"g{seq}", env="reverse_text",
                      prompt=Tensor.from_numpy(np.array([1, 2, 3], np.int32)), samples=[sample], worker="w1")


def test_run_log_and_cli_verify_cat(tmp_path: Path, capsys: pytest.CaptureFixture):
    with RunLog(tmp_path) as run_log:
        run_log.stream("trajectories").append_batch([(f"{i + 1}-0", encode(_trajectory(i))) for i in range(3)])
        run_log.stream("control").append_batch(_records(4))
        assert [e.seq for _, e in run_log.events("trajectories")] == [0, 1, 2]
        with pytest.raises(LogError, match="not a stream name"):
            run_log.stream("../x")
    assert cli.main(["log", "verify", "--run", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "control" in out and "trajectories" in out and "7 records in 2 streams" in out

    assert cli.main(["log", "cat", "--run", str(tmp_path), "--stream", "trajectories"]) == 0
    lines = [orjson.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(x["entry_id"], x["type"], x["seq"]) for x in lines] == [("1-0", "trajectory", 0), ("2-0", "trajectory", 1),
                                                                    ("3-0", "trajectory", 2)]
    sample = lines[0]["samples"][0]
    assert sample["tokens"] == {"tensor": "int32[300]", "nbytes": 1200, "head": list(range(8))}
    assert sample["logprobs"] == {"tensor": "float32[4]", "values": [0.0] * 4}

    assert cli.main(["log", "cat", "--run", str(tmp_path), "--stream", "steps"]) == 1
    assert "no log" in capsys.readouterr().err

    seg = _segments(tmp_path / "log" / "control")[0]
    _flip(seg, 40)
    assert cli.main(["log", "verify", "--run", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "corrupted" in err and str(seg) in err
    assert cli.main(["log", "verify", "--run", str(tmp_path / "nothing")]) == 1
