"""Weights & Biases, offline: run files under DIR/wandb/offline-run-*-ID, synced by the user
(`wandb sync DIR/wandb/offline-run-*`); no network is touched.

The W&B run id is derived from the Reel run name, so every restart of the sink writes another
offline segment of the same W&B run. W&B steps only go forward, and evals run behind the trainer:
eval scores are logged at the latest step written, with their own axis eval/step (define_metric),
one eval per W&B row (a second eval before the next step waits for that step's row); the mismatch
role's split (mismatch/*), which lags too, the same way on its axis mismatch/step.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from reel.consumers.sinks.base import RunMeta, Sink, SinkError, require_library
from reel.consumers.sinks.points import EVAL_PREFIX, EVAL_STEP_KEY, SPLIT_PREFIX, SPLIT_STEP_KEY
from reel.consumers.sinks.wandb_records import history_rows

__all__ = ["WandbSink", "run_files", "wandb_id"]


def wandb_id(run: str) -> str:
    """A W&B run id for Reel run `run`: its name (letters, digits, '-') and a hash, stable across restarts."""
    return f"{re.sub(r'[^a-z0-9-]', '-', run.lower())[:48]}-{hashlib.sha256(run.encode()).hexdigest()[:8]}"


def run_files(directory: Path, run: str) -> list[Path]:
    """The offline run files of Reel run `run` under DIR, oldest segment first."""
    run_id = wandb_id(run)
    return sorted((directory / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))


def _held(files: list[Path]) -> dict[str, int]:
    held: dict[str, int] = {}
    for path in files:
        for step, row in history_rows(path):
            for key in row:
                if key in (EVAL_STEP_KEY, SPLIT_STEP_KEY):
                    continue
                axis = EVAL_STEP_KEY if key.startswith(EVAL_PREFIX) else SPLIT_STEP_KEY \
                    if key.startswith(SPLIT_PREFIX) else None
                at = int(row[axis]) if axis in row else step
                held[key] = max(held.get(key, -1), at)
    return held


class _Lagging:
    """Figures that arrive behind the steps (evals, the mismatch split), on their own axis: one per W&B row."""

    def __init__(self, axis: str):
        self.axis = axis
        self.row: int | None = None  # the W&B step whose row holds one already
        self.waiting: list[dict[str, float]] = []  # for the next rows


class WandbSink(Sink):
    name = "wandb"

    def __init__(self, directory: Path, project: str, run: str):
        wandb = require_library("wandb", "wandb")
        self._held = _held(run_files(directory, run))
        self._step = max((s for k, s in self._held.items() if not k.startswith((EVAL_PREFIX, SPLIT_PREFIX))),
                         default=0)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self.run = wandb.init(project=project, name=run, id=wandb_id(run), dir=str(directory), mode="offline",
                                  settings=wandb.Settings(silent=True, console="off", x_disable_stats=True))
        except Exception as exc:  # wandb raises its own and its service's errors
            raise SinkError(f"W&B could not start an offline run in {directory}: {exc}; "
                            "check metrics.wandb_dir") from exc
        self._evals, self._splits = _Lagging(EVAL_STEP_KEY), _Lagging(SPLIT_STEP_KEY)
        for prefix, axis in ((EVAL_PREFIX, EVAL_STEP_KEY), (SPLIT_PREFIX, SPLIT_STEP_KEY)):
            self.run.define_metric(axis)
            self.run.define_metric(f"{prefix}*", step_metric=axis)

    def written(self) -> dict[str, int]:
        return dict(self._held)

    def describe(self, meta: RunMeta) -> None:
        self.run.config.update({**meta.config, "code_version": meta.code_version or "unknown"}, allow_val_change=True)

    def write(self, step: int, points: dict[str, float]) -> None:
        self.run.log(points, step=step)
        self._step = step
        for lane in (self._evals, self._splits):
            lane.row = None
            if lane.waiting:
                self._log(lane, lane.waiting.pop(0))

    def write_eval(self, step: int, points: dict[str, float]) -> None:
        self._lagging(self._evals, step, points)

    def write_split(self, step: int, points: dict[str, float]) -> None:
        self._lagging(self._splits, step, points)

    def _lagging(self, lane: _Lagging, step: int, points: dict[str, float]) -> None:
        row = {**points, lane.axis: step}
        if lane.row == self._step:
            lane.waiting.append(row)
        else:
            self._log(lane, row)

    def _log(self, lane: _Lagging, row: dict[str, float]) -> None:
        self.run.log(row, step=self._step)
        lane.row = self._step

    def flush(self) -> None:
        pass  # W&B writes a row when the next step starts and at finish(); a killed sink's last row is rewritten

    def close(self) -> None:
        while self._evals.waiting or self._splits.waiting:  # no step follows: the waiting rows take the next ones
            self._step += 1
            for lane in (self._evals, self._splits):
                if lane.waiting:
                    self._log(lane, lane.waiting.pop(0))
        self.run.finish()
