"""The launcher's liveness check: a role whose heartbeat (runtime/heartbeat.py) stops moving is named,
in one line, once: which role, since when, what it was doing.

A role is stalled when its loop has not come round, or (unless it waits for another role) it has
made no progress, for longer than its bound: max(run.stall_s, 5 x the longest gap between two of
its progress beats so far), so a run whose steps are slow learns that a slow step is not a stall.
The line for a stalled role also says what the roles waiting on it are waiting for. A role that
moves again gets one line saying so. What a launcher does then is decided here, once, by
`Liveness.decide` (`reel run`'s supervisor, runtime/launch/supervisor.py, and the watchers of a Slurm
job's pools, runtime/launch/pool_watch.py, act on it): a stalled rollout worker or vLLM server
(whose beat a probe writes, runtime/launch/server_probe.py) is killed and started again; a trainer
or archiver stalled for HUNG_FACTOR bounds stops the run as if it had died, with the resume command.
A launcher that watches only some roles (one pool's) names `only` those: the others' beats are
left alone.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from pathlib import Path
from typing import NamedTuple

from reel.runtime.heartbeat import BEAT_SUFFIX, Beat, read_beats

__all__ = ["Liveness", "Verdict", "GAP_FACTOR", "HUNG_FACTOR", "restartable"]

GAP_FACTOR = 5.0  # a role's bound is at least this many times its longest gap between progress so far
HUNG_FACTOR = 3.0  # stalled this many bounds, a trainer or archiver is hung: the launcher stops the run
STOPS_THE_RUN = ("trainer", "archiver")  # hung, these stop the run (the resume is exact); nothing else does


def restartable(role: str) -> bool:
    """A role a launcher kills and starts again once stalled: a rollout worker (its in-flight groups are
    lost as after kill -9) or a vLLM server ("vllm", a Slurm pool's "vllm-POOL-NODE")."""
    return role.startswith("rollout-") or role == "vllm" or role.startswith("vllm-")


class Verdict(NamedTuple):
    lines: list[str]  # to print now: roles newly stalled, and stalled roles that move again
    restart: list[str]  # newly stalled restartable roles: kill each and start it again
    stop: str | None  # a trainer or archiver hung for HUNG_FACTOR bounds: stop the run, with the resume command


class Liveness:
    def __init__(self, roles_dir: Path, stall_s: float, only: Collection[str] | None = None, *,
                 drop_stale: bool = True):
        self.roles_dir = roles_dir
        self.stall_s = stall_s  # run.stall_s: the least bound
        self.only = None if only is None else frozenset(only)  # the roles this launcher watches (None: all)
        self._progress: dict[str, Beat] = {}  # role -> its last beat seen
        self._longest: dict[str, float] = {}  # role -> longest gap between two progress beats seen
        self._stalled: dict[str, float] = {}  # role -> since when, for the roles named stalled
        self.newly_stalled: list[str] = []  # the roles the last check() named
        for stale in roles_dir.glob(f"*{BEAT_SUFFIX}") if drop_stale else ():  # an earlier launch's (a --resume)
            if self._watches(stale.name[:-len(BEAT_SUFFIX)]):
                stale.unlink(missing_ok=True)

    def _watches(self, role: str) -> bool:
        return self.only is None or role in self.only

    def bound(self, role: str) -> float:
        return max(self.stall_s, GAP_FACTOR * self._longest.get(role, 0.0))

    def check(self, now: float | None = None) -> list[str]:
        """Lines to print now: roles newly stalled, and stalled roles that move again."""
        now = time.time() if now is None else now
        beats = read_beats(self.roles_dir)  # all of them: a stalled role's line says who waits on it
        for role, beat in beats.items():
            if not self._watches(role):
                continue
            seen = self._progress.get(role)
            if seen is not None and seen.progress_count > 0 and beat.progress_count > seen.progress_count:
                gap = (beat.progress_at - seen.progress_at) / (beat.progress_count - seen.progress_count)
                self._longest[role] = max(self._longest.get(role, 0.0), gap)
            self._progress[role] = beat
        lines = []
        self.newly_stalled = []
        for role, beat in sorted(beats.items()):
            if not self._watches(role):
                continue
            since = beat.at if beat.waiting else beat.progress_at
            stalled = now - since > self.bound(role)
            if stalled and role not in self._stalled:
                self._stalled[role] = since
                self.newly_stalled.append(role)
                lines.append(self._line(role, beat, since, now, beats))
            elif not stalled and role in self._stalled:
                lines.append(f"reel: {role} moves again after {now - self._stalled.pop(role):.0f} s "
                             f"({_doing(beat)})")
        return lines

    def decide(self, now: float | None = None) -> Verdict:
        """What a launcher does now: the one rule of every launcher (`reel run`, a Slurm job's watchers)."""
        now = time.time() if now is None else now
        lines = self.check(now)
        stop = next((role for role in STOPS_THE_RUN if self._watches(role) and self.hung(role, now)), None)
        return Verdict(lines, [role for role in self.newly_stalled if restartable(role)], stop)

    def hung(self, role: str, now: float | None = None) -> bool:
        """Whether `role` has been stalled for HUNG_FACTOR bounds (a trainer or archiver that will not
        come back: the launcher stops the run, with the resume command)."""
        since = self._stalled.get(role)
        return since is not None and (time.time() if now is None else now) - since > HUNG_FACTOR * self.bound(role)

    def forget(self, role: str) -> None:
        """`role` was restarted: its old beat and what was learnt from it go."""
        (self.roles_dir / f"{role}{BEAT_SUFFIX}").unlink(missing_ok=True)
        for known in (self._progress, self._longest, self._stalled):
            known.pop(role, None)

    def _line(self, role: str, beat: Beat, since: float, now: float, beats: dict[str, Beat]) -> str:
        waiters = [f"{other}: {_doing(b)}" for other, b in sorted(beats.items()) if other != role and b.waiting]
        waiting = f"; waiting meanwhile: {'; '.join(waiters)}" if waiters else ""
        return (f"reel: {role} has made no progress for {now - since:.0f} s (since "
                f"{time.strftime('%H:%M:%S', time.localtime(since))}, last: {_doing(beat)}; bound "
                f"{self.bound(role):.0f} s, run.stall_s = {self.stall_s:g}){waiting}")


def _doing(beat: Beat) -> str:
    return f"{beat.phase}, {beat.detail}" if beat.detail else beat.phase
