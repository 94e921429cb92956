"""Weights & Biases, offline: run files under DIR/wandb/offline-run-*-ID, synced by the user
(`wandb sync DIR/wandb/offline-run-*`); no network is touched.

The W&B run id is derived from the Reel run name, so every restart of the sink writes another
offline segment of the same W&B run. W&B steps only go forward, and evals run behind the trainer:
eval scores (and the mismatch role's split, mismatch/*) are logged at the latest step written, with their own axis eval/step (define_metric),
one eval per W&B row (a second eval before the next step waits for that step's row).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from reel.consumers.sinks.base import RunMeta, Sink, SinkError, require_library
from reel.consumers.sinks.points import EVAL_PREFIX, EVAL_STEP_KEY, SPLIT_PREFIX
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
            at = int(row[EVAL_STEP_KEY]) if EVAL_STEP_KEY in row else step
            for key in row:
                if key != EVAL_STEP_KEY:
                    held[key] = max(held.get(key, -1), at)
    return held


class WandbSink(Sink):
    name = "wandb"

    def __init__(self, directory: Path, project: str, run: str):
        wandb = require_library("wandb", "wandb")
        self._held = _held(run_files(directory, run))
        self._step = max((s for k, s in self._held.items() if not k.startswith(EVAL_PREFIX)), default=0)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self.run = wandb.init(project=project, name=run, id=wandb_id(run), dir=str(directory), mode="offline",
                                  settings=wandb.Settings(silent=True, console="off", x_disable_stats=True))
        except Exception as exc:  # wandb raises its own and its service's errors
            raise SinkError(f"W&B could not start an offline run in {directory}: {exc}; "
                            "check metrics.wandb_dir") from exc
        self._eval_row: int | None = None  # the W&B step whose row holds an eval already
        self._waiting: list[dict[str, float]] = []  # evals for the next rows
        self.run.define_metric(EVAL_STEP_KEY)
        self.run.define_metric(f"{EVAL_PREFIX}*", step_metric=EVAL_STEP_KEY)
        self.run.define_metric(f"{SPLIT_PREFIX}*", step_metric=EVAL_STEP_KEY)  # lags the trainer like an eval

    def written(self) -> dict[str, int]:
        return dict(self._held)

    def describe(self, meta: RunMeta) -> None:
        self.run.config.update({**meta.config, "code_version": meta.code_version or "unknown"}, allow_val_change=True)

    def write(self, step: int, points: dict[str, float]) -> None:
        self.run.log(points, step=step)
        self._step, self._eval_row = step, None
        if self._waiting:
            self._log_eval(self._waiting.pop(0))

    def write_eval(self, step: int, points: dict[str, float]) -> None:
        row = {**points, EVAL_STEP_KEY: step}
        if self._eval_row == self._step:
            self._waiting.append(row)
        else:
            self._log_eval(row)

    def _log_eval(self, row: dict[str, float]) -> None:
        self.run.log(row, step=self._step)
        self._eval_row = self._step

    def flush(self) -> None:
        pass  # W&B writes a row when the next step starts and at finish(); a killed sink's last row is rewritten

    def close(self) -> None:
        while self._waiting:  # no step follows: the waiting evals take the next rows
            self._step += 1
            self._log_eval(self._waiting.pop(0))
        self.run.finish()
