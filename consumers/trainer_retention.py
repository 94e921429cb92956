"""The trainer's retention pass after each commit (bus/retention.py): the weight versions no worker or
step can need, and the checkpoints log.keep_checkpoints lets go.

Checkpoints go in two moves: a CheckpointsPruned event first (so the log says the checkpoint was
pruned, not lost: `reel log verify`, `reel replay step`), then the deletion. A crash between the two
leaves files the next pass deletes. Only committed checkpoints are candidates and the newest is
always kept, so a resume, which starts from the newest, never misses one.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from reel.bus.blobs import BlobBackend, BlobError
from reel.bus.events import AnyEvent, CheckpointsPruned
from reel.bus.retention import CheckpointPolicy, Retention, RetentionPolicy
from reel.bus.streams import Publisher
from reel.runtime.checkpoint import sharded
from reel.runtime.config.sections import Config

__all__ = ["trainer_retention", "retain"]

log = logging.getLogger("reel.trainer")


def trainer_retention(run_dir: Path, config: Config, blobs: BlobBackend) -> Retention:
    """The run's policies: versions by async_level / max_off_policy_steps / log.keep_weights_every (and
    mismatch.max_lag_steps more for a lagging mismatch role),
    checkpoints by log.keep_checkpoints / log.keep_checkpoints_every."""
    lag = config.mismatch.max_lag_steps if config.mismatch.every > 0 else 0  # the mismatch role's versions
    versions = RetentionPolicy.of(config.rollout.async_level, config.trainer.max_off_policy_steps,
                                  config.log.keep_weights_every, lag)
    checkpoints = CheckpointPolicy(config.log.keep_checkpoints, config.log.keep_checkpoints_every)
    return Retention(versions, blobs, checkpoints, delete_files=lambda step: sharded.delete_files(run_dir, step))


async def retain(retention: Retention, publisher: Publisher, committed: list[AnyEvent], step: int) -> None:
    """After step `step`'s commit (its WeightsPublished and StepCommitted in `committed`)."""
    retention.add(committed)
    if doomed := retention.doomed_checkpoints():
        policy = retention.checkpoint_policy
        pruned = publisher.stamp(CheckpointsPruned, steps=doomed, after_step=step, keep_last=policy.keep_last,
                                 keep_every=policy.keep_every)
        await publisher.publish([pruned])
        retention.add([pruned])
    try:
        await asyncio.to_thread(retention.collect)
    except BlobError as exc:  # what is left stays listed: the next step's pass tries it again
        log.warning("retention after step %d: %s", step, exc)
