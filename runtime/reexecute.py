"""Rebuild the trainer's state after any committed step from the newest checkpoint before it.

Used by the trainer when it restarts, by `reel replay` and by `reel retrain`: restore the newest
checkpoint at or before the target, then run the logged steps again with the same `train_step`
and check each new weight hash against its StepCommitted. A mismatch is an error that says what
differs (config hash, code version), never a silent divergence.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from bus.blobs import BlobBackend
from bus.errors import ReelError
from bus.events import StepCommitted
from runtime import checkpoint
from runtime.batch import build_batch
from runtime.config import Config, config_hash
from runtime.groups import GroupLookup
from runtime.initial_policy import code_version, load_initial_model
from runtime.train_step import StepResult, TrainState, make_optimizer, train_step


class ReplayMismatch(ReelError):
    """A re-executed step did not reproduce its commit."""


def initial_state(run_dir: Path, config: Config) -> TrainState:
    model = load_initial_model(run_dir)
    return TrainState(model, make_optimizer(model, config.trainer), 0)


def newest_checkpoint(commits: dict[int, StepCommitted], at_or_before: int) -> StepCommitted | None:
    candidates = [c for s, c in commits.items() if s <= at_or_before and c.checkpoint is not None]
    return max(candidates, key=lambda c: c.step) if candidates else None


def restore_state(run_dir: Path, config: Config, blobs: BlobBackend, commits: dict[int, StepCommitted],
                  upto: int) -> TrainState:
    """The state after step `upto` (0 = initial), from the newest checkpoint at or before it."""
    state = initial_state(run_dir, config)
    base = newest_checkpoint(commits, upto)
    if base is not None:
        assert base.checkpoint is not None
        state = checkpoint.restore(blobs.get(base.checkpoint), state.model, config.trainer,
                                   source=f"checkpoint of step {base.step}")
    return state


def run_committed_step(state: TrainState, commit: StepCommitted, lookup: GroupLookup,
                       config: Config) -> tuple[TrainState, StepResult, float]:
    """Execute `commit`'s step again on its logged groups; returns the result and compute seconds."""
    batch = build_batch(lookup.groups_of(commit))
    started = time.perf_counter()
    state, result = train_step(state, batch, config)
    return state, result, time.perf_counter() - started


def check_reproduced(commit: StepCommitted, result: StepResult, config: Config) -> None:
    if result.weights_sha256 == commit.weights_sha256:
        return
    reasons = []
    if commit.config_hash and commit.config_hash != config_hash(config):
        reasons.append(f"config hash {config_hash(config)} differs from the run's {commit.config_hash}")
    if commit.code_version and commit.code_version != code_version():
        reasons.append(f"code version {code_version()} differs from the run's {commit.code_version}")
    why = "; ".join(reasons) or "same config and code: the step is not deterministic on this machine"
    raise ReplayMismatch(f"step {commit.step} re-executed to different weights ({why})")


def catch_up(state: TrainState, commits: dict[int, StepCommitted], upto: int, lookup: GroupLookup,
             config: Config, on_step: Callable[[int], None] | None = None) -> TrainState:
    """Re-execute committed steps state.step+1 .. upto, checking each against its commit."""
    for step in range(state.step + 1, upto + 1):
        commit = commits[step]
        state, result, _ = run_committed_step(state, commit, lookup, config)
        check_reproduced(commit, result, config)
        if on_step is not None:
            on_step(step)
    return state
