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

from reel.bus.blobs import BlobBackend, BlobError
from reel.bus.errors import ReelError
from reel.bus.events import StepCommitted
from reel.runtime.checkpoint import single as checkpoint
from reel.runtime.train import environment
from reel.runtime.checkpoint import sharded as sharded_checkpoint
from reel.runtime.train.batch import build_batch
from reel.runtime.config.sections import Config
from reel.runtime.config.run import config_hash
from reel.runtime.train.distributed import LOCAL, World
from reel.runtime.train.groups import GroupLookup
from reel.runtime.train.initial_policy import code_version, load_initial_model
from reel.runtime.model.parallelize import parallelize
from reel.runtime.model.weights import load
from reel.runtime.train.step import StepResult, TrainState, make_optimizer, train_step
from reel.runtime.weights.digest import scheme_of

StepFn = Callable[..., tuple[TrainState, StepResult]]  # (state, batch, *, digest) like TrainerGroup.step


class ReplayMismatch(ReelError):
    """A re-executed step did not reproduce its commit."""


class CheckpointUnusable(ReelError):
    """The checkpoint a re-execution starts from is missing or corrupt; the message names it and the
    nearest earlier checkpoint that reads back."""


def initial_state(run_dir: Path, config: Config, world: World = LOCAL, init: Path | None = None) -> TrainState:
    """Version 0 (the run's init/, or `init`), sharded over `world`, with a fresh optimizer."""
    model = load(init) if init is not None else load_initial_model(run_dir)
    model = parallelize(model, world, config.trainer.expert_parallel, config.trainer.context_parallel)
    return TrainState(model, make_optimizer(model, config.trainer), 0)


def restore_checkpoint(data: bytes, state: TrainState, config: Config, world: World, run_dir: Path, *,
                       source: str) -> TrainState:
    """Load a checkpoint blob into `state`: a DCP manifest on any world size, a one-process file on one."""
    if sharded_checkpoint.is_manifest(data):
        return sharded_checkpoint.load(data, state, world, run_dir, source=source)
    if world.distributed:
        raise checkpoint.CheckpointError(
            f"{source} was written by a one-process trainer; continue this run with trainer.ranks = 1")
    return checkpoint.restore(data, state.model, config.trainer, source=source)


def save_checkpoint(state: TrainState, world: World, run_dir: Path) -> bytes:
    """The checkpoint blob of `state`: one safetensors file on one process, a DCP manifest on N ranks."""
    if world.distributed:
        return sharded_checkpoint.save(state, world, run_dir)
    return checkpoint.checkpoint_bytes(state)


def newest_checkpoint(commits: dict[int, StepCommitted], at_or_before: int) -> StepCommitted | None:
    candidates = [c for s, c in commits.items() if s <= at_or_before and c.checkpoint is not None]
    return max(candidates, key=lambda c: c.step) if candidates else None


def checkpoint_before(commits: dict[int, StepCommitted], upto: int, blobs: BlobBackend) -> tuple[bytes, str]:
    """(the newest checkpoint blob at or before `upto`, its name); b"" = start from version 0."""
    base = newest_checkpoint(commits, upto)
    if base is None or base.checkpoint is None:
        return b"", "the initial policy"
    try:
        data = blobs.get(base.checkpoint)
    except BlobError as exc:
        raise CheckpointUnusable(f"the checkpoint of step {base.step} cannot be read ({exc}); "
                                 f"{_nearest_usable(commits, base.step - 1, blobs)}") from exc
    # The commit, not the blob, says which reader may touch it: only an N-rank commit's checkpoint is
    # a DCP manifest, whose .metadata is a pickle (runtime/checkpoint/dcp_metadata.py).
    if sharded_checkpoint.is_manifest(data) != (base.world_size > 1):
        raise checkpoint.CheckpointError(
            f"the checkpoint of step {base.step} is {'a DCP manifest' if base.world_size == 1 else 'a one-process file'}"
            f" but its commit says the trainer had {base.world_size} rank(s); the run directory was tampered with")
    return data, f"checkpoint of step {base.step}"


def _nearest_usable(commits: dict[int, StepCommitted], upto: int, blobs: BlobBackend) -> str:
    while (base := newest_checkpoint(commits, upto)) is not None:
        try:
            blobs.get(base.checkpoint)
        except BlobError:
            upto = base.step - 1
            continue
        return f"restore that file; the nearest usable checkpoint is step {base.step}'s ({base.checkpoint.uri})"
    return "restore that file; no earlier checkpoint reads back, the nearest usable state is the initial policy (init/)"


def restored_state(run_dir: Path, config: Config, world: World, data: bytes, source: str) -> TrainState:
    """Version 0 sharded over `world` with the checkpoint blob `data` loaded (b"": version 0 itself)."""
    state = initial_state(run_dir, config, world)
    return restore_checkpoint(data, state, config, world, run_dir, source=source) if data else state


def run_committed_step(state: TrainState, commit: StepCommitted, lookup: GroupLookup, config: Config,
                       step_fn: StepFn | None = None) -> tuple[TrainState, StepResult, float]:
    """Execute `commit`'s step again on its logged groups; returns the result and compute seconds."""
    batch = build_batch(lookup.groups_of(commit))
    started = time.perf_counter()
    digest = scheme_of(commit.weights_sha256)  # the digest the log holds, computed the same way
    state, result = step_fn(state, batch, digest=digest) if step_fn else train_step(state, batch, config, digest=digest)
    return state, result, time.perf_counter() - started


def check_reproduced(commit: StepCommitted, result: StepResult, config: Config) -> None:
    if result.weights_sha256 == commit.weights_sha256:
        return
    reasons = []
    if commit.config_hash and commit.config_hash != config_hash(config):
        reasons.append(f"config hash {config_hash(config)} differs from the run's {commit.config_hash}")
    if commit.code_version and commit.code_version != code_version():
        reasons.append(f"code version {code_version()} differs from the run's {commit.code_version}")
    reasons += environment.differences(commit, config)
    why = "; ".join(reasons) or "same config and code: the step is not deterministic on this machine"
    raise ReplayMismatch(f"step {commit.step} re-executed to different weights ({why})")


def catch_up(state: TrainState, commits: dict[int, StepCommitted], upto: int, lookup: GroupLookup,
             config: Config, on_step: Callable[[int], None] | None = None, *, step_fn: StepFn | None = None,
             check: bool = True) -> TrainState:
    """Re-execute committed steps state.step+1 .. upto, checking each against its commit (unless
    `check` is off: a re-execution on another world size lands close, not on the same bits)."""
    for step in range(state.step + 1, upto + 1):
        commit = commits[step]
        state, result, _ = run_committed_step(state, commit, lookup, config, step_fn)
        if check:
            check_reproduced(commit, result, config)
        if on_step is not None:
            on_step(step)
    return state
