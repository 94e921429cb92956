"""`reel log repair --run DIR`: keep the longest valid prefix of each stream of a damaged log.

A record that fails its CRC check in the middle of a stream (a flipped byte on disk) makes the
archiver refuse to open the log, so the run can be neither resumed nor fully replayed. Repair:

    1. takes each stream's writer lock (a live archiver holds it: the run must be stopped);
    2. copies the whole log to RUN_DIR/log.before-repair-<time>/ (nothing is lost);
    3. for each damaged stream, truncates the segment at its first damaged record and deletes the
       later segments and every sparse index of the stream (rebuilt on the next open);
    4. says, per stream, how many records it kept and how many bytes it dropped.

Records after the damage are gone from the repaired log (they stay in the copy). A run resumed on
a repaired log re-reads from the bus what it still holds; events neither holds are lost.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import time
from contextlib import ExitStack
from pathlib import Path

from reel.bus.errors import ReelError
from reel.bus.log import LogCorrupted
from reel.bus.run_log import RunLog

__all__ = ["main", "repair"]


class RepairError(ReelError):
    """A log that cannot be repaired as asked."""


def main(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    report = repair(run_dir)
    if not report:
        print(f"reel: every stream of {run_dir / 'log'} is valid; nothing to repair")
        return 0
    for line in report:
        print(line)
    print(f"reel: repaired {len(report) - 1} streams; `reel log verify --run {run_dir}` checks the result")
    return 0


def repair(run_dir: Path) -> list[str]:
    """Cut every damaged stream back to its valid records; the report's lines (empty: nothing to do)."""
    root = run_dir / "log"
    with RunLog(run_dir, readonly=True, valid_prefix=True) as run_log:
        kept = {name: sum(1 for _ in run_log.stream(name).records()) for name in run_log.names()}
        damage = run_log.damage()
    if not damage:
        return []
    with ExitStack() as locks:
        for name in damage:
            locks.enter_context(_writer_lock(root / name))
        backup = run_dir / f"log.before-repair-{time.strftime('%Y%m%d-%H%M%S')}"
        shutil.copytree(root, backup)
        lines = [f"copied the log to {backup}"]
        for name, exc in sorted(damage.items()):
            dropped = _cut(root / name, exc)
            lines.append(f"{name}: kept {kept[name]} records, dropped {dropped} bytes from byte {exc.offset} of "
                         f"{exc.segment.name} on ({exc})")
    return lines


def _cut(directory: Path, damage: LogCorrupted) -> int:
    """Truncate the damaged segment at the damage, delete the later ones and every index; bytes dropped."""
    assert damage.segment is not None
    dropped = 0
    for segment in sorted(directory.glob("*.seg")):
        if segment.name < damage.segment.name:
            continue
        size = segment.stat().st_size
        if segment == damage.segment and damage.offset > 0:
            with open(segment, "r+b") as f:
                f.truncate(damage.offset)
                os.fsync(f.fileno())
            dropped += size - damage.offset
        else:
            segment.unlink()
            dropped += size
    for index in directory.glob("*.idx"):
        index.unlink()  # rebuilt from the segments on the next open
    return dropped


class _writer_lock:
    """The stream's writer flock, as the archiver takes it: held while repairing, so no archiver writes."""

    def __init__(self, directory: Path):
        self.directory = directory

    def __enter__(self) -> None:
        self.fd = os.open(self.directory, os.O_RDONLY)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise RepairError(f"the log of stream {self.directory.name!r} is open for writing (is the run "
                              f"still running?); stop the run, then repair") from None

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)
