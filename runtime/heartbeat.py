"""A role's heartbeat: what it is doing and when it last made progress, for the launcher.

Each role process replaces RUN_DIR/roles/<role>.beat (JSON, atomically, at most once a second unless
its phase changes) from its main loop. Two clocks: `at` moves whenever the loop comes round (a
frozen process, or one stuck inside a call, stops it), `progress_at` only when work gets done (a
group published, a step committed, events logged), so a role that loops but gets nothing done (a
wedged inference server) ages too, unless it is `waiting` for another role, whose stall is the one
to name. runtime/launch/liveness.py reads the beats and names the role that stopped moving.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgspec

__all__ = ["Beat", "Heartbeat", "read_beats", "BEAT_SUFFIX"]

BEAT_SUFFIX = ".beat"
MIN_INTERVAL_S = 1.0  # between two writes of the same phase


class Beat(msgspec.Struct, frozen=True):
    phase: str  # "waiting for groups", "training", "generating", "archiving", ...
    detail: str  # the step, the group or the count it is at
    at: float  # time.time() the role's loop last came round
    progress_at: float  # time.time() of its last progress
    waiting: bool = False  # waiting for another role (its own progress is not expected now)
    progress_count: int = 0  # progress beats so far (0: progress_at is when the role started)


class Heartbeat:
    """The writer, in the role's process; `path` None (no run directory): beats go nowhere."""

    def __init__(self, path: Path | None):
        self.path = path
        self._last: Beat | None = None

    def progress(self, phase: str, detail: str = "") -> None:
        """Work got done."""
        now = time.time()
        count = self._last.progress_count + 1 if self._last is not None else 1
        self._write(Beat(phase, detail, now, now, progress_count=count), force=True)

    def alive(self, phase: str, detail: str = "", *, waiting: bool = False) -> None:
        """The loop came round without progress (waiting: for another role)."""
        last = self._last or Beat(phase, detail, time.time(), time.time())
        beat = Beat(phase, detail, time.time(), last.progress_at, waiting, last.progress_count)
        self._write(beat, force=self._last is None or (self._last.phase, self._last.waiting) != (phase, waiting))

    def _write(self, beat: Beat, *, force: bool) -> None:
        if self.path is None or (not force and self._last is not None and beat.at - self._last.at < MIN_INTERVAL_S):
            return
        self._last = beat
        partial = self.path.with_name(self.path.name + ".part")
        try:
            partial.write_bytes(msgspec.json.encode(beat))
            os.replace(partial, self.path)
        except OSError:  # a full or read-only disk must not stop the role: the launcher sees an old beat
            pass


def read_beats(roles_dir: Path) -> dict[str, Beat]:
    """Role name -> its last beat (a file being replaced or unreadable is skipped this time)."""
    beats = {}
    for path in roles_dir.glob(f"*{BEAT_SUFFIX}"):
        try:
            beats[path.name[:-len(BEAT_SUFFIX)]] = msgspec.json.decode(path.read_bytes(), type=Beat)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            continue
    return beats
