"""Progress of long work inside a role (the warm-start), for the launcher's screen.

A role runs in its own process with its output in roles/<role>.log, so the launcher cannot see a
warm-start that takes minutes. The work calls `report(...)`; inside `reporting_to(path)` that
replaces a small JSON file (at most a few times a second), and the launcher's progress view reads
it (`read`) until the first step is committed. Outside `reporting_to` a report does nothing.

A role asked to stop calls `cancel()`: the work's next report raises WorkCancelled, so a stop
does not wait for a warm-start of minutes to finish (its partial result is thrown away).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec

__all__ = ["Work", "WorkCancelled", "reporting_to", "report", "cancel", "read", "describe", "PROGRESS_FILE"]

PROGRESS_FILE = "progress.json"  # in RUN_DIR/roles/
MIN_INTERVAL_S = 0.5  # between two writes of the file


class Work(msgspec.Struct, frozen=True):
    what: str  # "warm-start" (steps), "warm-start evaluation" (episodes)
    done: int
    total: int
    note: str = ""  # where its result goes (the warm-start cache), or that it came from there
    started: float = 0.0  # time.time() when this `what` began


class WorkCancelled(Exception):
    """The process was asked to stop while the work ran."""


_target: Path | None = None
_cancelled = threading.Event()  # set from a signal handler; read by the work's thread
_last_write = 0.0
_began: dict[str, float] = {}
_notes: dict[str, str] = {}  # the last note of each work, kept by later reports that give none


@contextmanager
def reporting_to(path: Path) -> Iterator[None]:
    global _target
    previous, _target = _target, (path if path.parent.is_dir() else None)  # no roles/ dir: nobody watches
    try:
        yield
    finally:
        _target = previous


def report(what: str, done: int, total: int, note: str = "") -> None:
    """The work `what` is at `done` of `total`; written when due, and always at its start and end."""
    global _last_write
    if _cancelled.is_set():
        raise WorkCancelled(f"{what} stopped at {done}/{total}: the process was asked to stop")
    if _target is None:
        return
    now = time.time()
    began = _began.setdefault(what, now)
    note = _notes[what] = note or _notes.get(what, "")
    if 0 < done < total and now - _last_write < MIN_INTERVAL_S:
        return
    _last_write = now
    tmp = _target.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.encode(Work(what, done, total, note, began)))
    os.replace(tmp, _target)


def cancel() -> None:
    """Make the running work (in any thread) stop at its next report."""
    _cancelled.set()


def read(path: Path) -> Work | None:
    try:
        return msgspec.json.decode(path.read_bytes(), type=Work)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None  # not started, or being replaced


def describe(work: Work, now: float | None = None) -> str:
    """One line: "warm-start: 120/300 (40%), 12 s; cached in ..."."""
    share = f" ({work.done / work.total:.0%})" if work.total else ""
    seconds = max(0.0, (now or time.time()) - work.started)
    note = f"; {work.note}" if work.note else ""
    return f"{work.what}: {work.done}/{work.total}{share}, {seconds:.0f} s{note}"
