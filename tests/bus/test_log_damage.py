"""One flipped byte no longer makes a run unusable: `log verify` reports every stream and where each
damaged one's valid records end, `log cat` prints the records before the damage, a replay of a step
whose inputs lie before it still reproduces bit for bit, and `log repair` keeps the valid prefix of
each stream (after a copy) and says what it dropped. Bytes are flipped at several places."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from reel.bus.events import StepCommitted, Trajectory
from reel.bus.run_log import RunLog
from reel.bus.logformat import HEADER
from reel.runtime.launch.cli import main
from runbuilder import build_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_run(tmp_path_factory.mktemp("damage") / "run", {"run": {"name": "damaged"}})


def _first_record_after_step_2(run_dir: Path, stream: str) -> int:
    """Index of the first record of `stream` that no replay of steps 1-2 reads."""
    with RunLog(run_dir, readonly=True) as log:
        commits = {e.step: e for _, e in log.events("steps") if isinstance(e, StepCommitted)}
        events = [e for _, e in log.events(stream)]
    if stream == "steps":  # after step 2's commit (the mismatch role's MismatchSplit events lie between commits)
        return max(i for i, e in enumerate(events) if isinstance(e, StepCommitted) and e.step <= 2) + 1
    if stream == "weights":
        return 3  # versions 0, 1, 2 come first
    early = set(commits[1].groups) | set(commits[2].groups)
    return max(i for i, e in enumerate(events) if isinstance(e, Trajectory) and e.group_id in early) + 1


def _flip(run_dir: Path, stream: str, index: int) -> None:
    with RunLog(run_dir, readonly=True) as log:
        record = list(log.stream(stream).records())[index]
    with open(record.segment, "r+b") as f:
        f.seek(record.offset + HEADER.size + 7)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.parametrize("stream", ["steps", "trajectories", "weights"])
def test_damaged_log_reports_every_stream_replays_before_the_damage_and_repairs(
        clean_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], stream: str) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(clean_run, run_dir)
    with RunLog(run_dir, readonly=True) as log:
        names, counts = log.names(), log.verify()
    damaged_at = _first_record_after_step_2(run_dir, stream)
    _flip(run_dir, stream, damaged_at)

    assert main(["log", "verify", "--run", str(run_dir)]) == 1
    out, err = capsys.readouterr()
    assert all(line.split()[0] in names for line in out.splitlines()) and len(out.splitlines()) == len(names)
    assert f"DAMAGED after these records: log stream '{stream}' is corrupted" in out
    assert f"1 of {len(names)} streams are damaged: log stream '{stream}'" in err and "reel log repair" in err

    assert main(["log", "cat", "--run", str(run_dir), "--stream", stream]) == 1
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == damaged_at and "is corrupted" in err

    assert main(["replay", "step", "2", "--run", str(run_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bitwise"] is True
    if stream == "steps":
        assert main(["replay", "step", "4", "--run", str(run_dir)]) == 2
        assert "the log is damaged" in capsys.readouterr().err

    assert main(["log", "repair", "--run", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert f"{stream}: kept {damaged_at} records, dropped" in out
    backups = list(run_dir.glob("log.before-repair-*"))
    assert len(backups) == 1
    assert main(["log", "verify", "--run", str(run_dir)]) == 0
    capsys.readouterr()
    with RunLog(run_dir, readonly=True) as log:
        repaired = log.verify()
    assert repaired == {**counts, stream: damaged_at}
    assert main(["log", "repair", "--run", str(run_dir)]) == 0
    assert "nothing to repair" in capsys.readouterr().out
