"""Where a rollout worker's wall time goes: the engine decoding, waiting on tools, or idle.

    busy_s       the engine decoding (its own counter, EngineStats.busy_s)
    tool_wait_s  no engine request outstanding while at least one episode waits on its env or tool
    idle_s       no engine request outstanding and no episode at its env: nothing admitted (the async
                 gate holds the worker, or no weights yet)

The worker counts outstanding engine requests and env calls as its episodes make them; the three
add up to the wall time since the worker started, up to the engine's own overhead between decode
bursts (a weight swap, admitting a request), which has requests outstanding but no burst running.
It also keeps WorkerStats.idle_share: the share of each stats interval with no group in flight.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


class TimeSplit:
    started: float  # time.monotonic() when the worker started
    tool_wait_s: float  # settled up to _since
    idle_s: float
    _engine: int  # engine requests outstanding
    _env: int  # episodes waiting on their env's answer
    _since: float  # last time the counts changed (or were read)
    _groups: int  # groups in flight
    _no_group_s: float  # seconds with no group in flight since the last idle_share, settled up to _since
    _interval_from: float  # when the last idle_share was read

    def __init__(self) -> None:
        self.started = self._since = time.monotonic()
        self.tool_wait_s = self.idle_s = 0.0
        self._engine = self._env = self._groups = 0
        self._no_group_s = 0.0
        self._interval_from = self.started

    @contextlib.contextmanager
    def engine_turn(self) -> Iterator[None]:
        """Around one engine request of an episode."""
        self._settle()
        self._engine += 1
        try:
            yield
        finally:
            self._settle()
            self._engine -= 1

    @contextlib.contextmanager
    def env_turn(self) -> Iterator[None]:
        """Around one env.respond of an episode."""
        self._settle()
        self._env += 1
        try:
            yield
        finally:
            self._settle()
            self._env -= 1

    def groups_in_flight(self, count: int) -> None:
        self._settle()
        self._groups = count

    def idle_share(self) -> float:
        """Share of the time since the last call (or the start) with no group in flight."""
        self._settle()
        share = min(1.0, self._no_group_s / max(self._since - self._interval_from, 1e-9))
        self._no_group_s, self._interval_from = 0.0, self._since
        return share

    def totals(self) -> tuple[float, float, float]:
        """(wall, tool_wait, idle) seconds since the worker started."""
        self._settle()
        return self._since - self.started, self.tool_wait_s, self.idle_s

    def _settle(self) -> None:
        now = time.monotonic()
        if self._groups == 0:
            self._no_group_s += now - self._since
        if self._engine == 0:
            if self._env:
                self.tool_wait_s += now - self._since
            else:
                self.idle_s += now - self._since
        self._since = now
