"""Replay after checkpoint retention (bus/retention.py, log.keep_checkpoints): which steps still
replay bit for bit, and one sentence for the others.

Step N is rebuilt from the newest checkpoint at or before N-1 (or init/ when none was ever written
there). A CheckpointsPruned event names each checkpoint retention deleted; replay then starts from
the newest checkpoint still kept before N, re-executing the steps in between (bitwise, just more of
them). Only when every checkpoint before N is gone is N no longer replayable: re-executing from
init/ would mean re-training the whole run up to it, so replay names the checkpoint it would need
and the oldest one kept instead. The trajectories of every step stay in the log (`reel retrain`).
"""

from __future__ import annotations

import msgspec

from reel.bus.events import CheckpointsPruned, StepCommitted
from reel.bus.run_log import RunLog
from reel.runtime.train.reexecute import CheckpointUnusable, newest_checkpoint

__all__ = ["CheckpointPruned", "pruned_checkpoints", "without_pruned", "require_replayable"]


class CheckpointPruned(CheckpointUnusable):
    """A step whose every earlier checkpoint retention deleted; the message names the one it needs."""


def pruned_checkpoints(run_log: RunLog) -> dict[int, CheckpointsPruned]:
    """Checkpoint step -> the CheckpointsPruned that named it (none: nothing was pruned)."""
    if "control" not in run_log.names():
        return {}
    return {step: e for _, e in run_log.events("control") if isinstance(e, CheckpointsPruned) for step in e.steps}


def without_pruned(commits: dict[int, StepCommitted], pruned: dict[int, CheckpointsPruned]) -> dict[int, StepCommitted]:
    """`commits` with the checkpoints retention deleted taken out, so the nearest kept one is found."""
    return {step: msgspec.structs.replace(c, checkpoint=None) if step in pruned else c for step, c in commits.items()}


def require_replayable(commits: dict[int, StepCommitted], pruned: dict[int, CheckpointsPruned], step: int) -> None:
    """Nothing when step `step` can be rebuilt from a kept checkpoint (or init/); else CheckpointPruned.
    `commits` are without_pruned's."""
    if newest_checkpoint(commits, step - 1) is not None:
        return
    gone = [s for s in pruned if s <= step - 1]
    if not gone:
        return
    needed = max(gone)
    event = pruned[needed]
    every = f", log.keep_checkpoints_every = {event.keep_every}" if event.keep_every else ""
    kept = sorted(s for s, c in commits.items() if c.checkpoint is not None)
    after = (f"steps after {kept[0]} (the oldest checkpoint kept) still replay" if kept
             else "no checkpoint is kept")
    raise CheckpointPruned(
        f"step {step} is no longer replayable bit for bit: it needs the checkpoint of step {needed} (or an earlier "
        f"one), and retention deleted every checkpoint before step {step} after step {event.after_step} "
        f"(log.keep_checkpoints = {event.keep_last}{every}); {after}; its trajectories are still in the log "
        f"(`reel retrain` trains on them)")
