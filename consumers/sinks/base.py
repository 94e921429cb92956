"""The contract of a metric sink, and the one line a missing tracking library gets."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec

from reel.bus.errors import ReelError

__all__ = ["RunMeta", "Sink", "SinkError", "require_library"]

EXTRA = "tracking"  # pyproject's optional extra that installs every sink's library


class SinkError(ReelError):
    """A sink that cannot start or write: a missing library, an unusable directory or URI."""


def require_library(module: str, sink: str) -> ModuleType:
    """Import a tracking library, or say in one line which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise SinkError(f"the {sink} sink needs {module.split('.')[0]} ({exc}); install it with "
                        f"pip install 'reel-rl[{EXTRA}]'") from None


class RunMeta(msgspec.Struct, frozen=True):
    """What every sink records once: the run, its config and the code that ran it."""

    run: str
    run_dir: Path
    config_toml: str
    config: dict[str, Any]  # the resolved config, by section
    code_version: str = ""  # RunStarted.code_version; "" until the log or the bus shows it


class Sink(ABC):
    """One tracker. `written()` says what it already holds, so the feed (consumers/sinks/feed.py)
    writes each point once however often the sink restarts."""

    name: str  # as in `reel metrics NAME` and `[metrics] sinks`

    @abstractmethod
    def written(self) -> dict[str, int]:
        """Name -> the highest step the tracker already holds for it (eval names: the eval's step)."""

    @abstractmethod
    def describe(self, meta: RunMeta) -> None:
        """Record the config as run config and the code version (idempotent)."""

    @abstractmethod
    def write(self, step: int, points: dict[str, float]) -> None:
        """A committed step's figures, at its step."""

    @abstractmethod
    def write_eval(self, step: int, points: dict[str, float]) -> None:
        """An eval result's scores, at the trainer step of the version it scored."""

    def write_split(self, step: int, points: dict[str, float]) -> None:
        """The mismatch role's split of step `step` (mismatch/*), which arrives behind the steps already
        written; trackers that take points at any step write it with the step's figures."""
        self.write(step, points)

    @abstractmethod
    def flush(self) -> None:
        """Make everything written so far durable (a killed sink loses nothing flushed)."""

    @abstractmethod
    def close(self) -> None:
        """Flush and let go of the tracker."""
