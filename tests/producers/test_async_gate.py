"""The async gate's count of dropped groups: each replaced once, however often the trainer names it."""

from __future__ import annotations

from reel.bus.events import DroppedGroup, GroupsDropped, StepCommitted, StepTiming
from reel.producers.async_gate import AsyncGate

META = dict(run="r", producer="trainer:0")


def _announced(seq: int, step: int, *group_ids: str) -> GroupsDropped:
    return GroupsDropped(**META, seq=seq, step=step, dropped=[DroppedGroup(g, "invalid: test") for g in group_ids])


def _commit(seq: int, step: int, *group_ids: str) -> StepCommitted:
    return StepCommitted(**META, seq=seq, step=step, version=step, groups=[], loss=0.0, grad_norm=0.0,
                         dropped=[DroppedGroup(g, "invalid: test") for g in group_ids], weights_sha256="0" * 64,
                         timing=StepTiming(0.0, 0.0, 0.0))


def test_an_announced_drop_counts_once_when_its_commit_names_it_again() -> None:
    gate = AsyncGate(batch_groups=2, workers=1, async_level=0)
    assert gate.allows(1, 0) and not gate.allows(2, 0)  # round 0 is groups 0 and 1
    gate.learn(_announced(0, 1, "0-0-1", "1-0-0"))  # another worker's drop is that worker's to replace
    assert gate.allows(2, 0) and not gate.allows(3, 0)  # the replacement, before commit 1
    gate.learn(_commit(1, 1, "0-0-1", "1-0-0"))
    gate.learn(_announced(2, 1, "0-0-1"))  # again, from a trainer restarted before commit 1
    assert gate.allows(2, 0) and not gate.allows(3, 0)
    assert gate.allows(4, 1) and not gate.allows(5, 1)  # round 1 after commit 1: two groups, not three


def test_a_restarted_worker_replaces_only_drops_after_its_first_round() -> None:
    """Drops of steps up to c0 are already left out of q (producers/outstanding.py)."""
    gate = AsyncGate(batch_groups=2, workers=1, async_level=0)
    gate.first_round, gate.queued = 1, 1  # commit 1 is in; one group of an earlier process is still queued
    gate.learn(_commit(0, 1, "0-0-3"))
    assert gate.allows(0, 1) and not gate.allows(1, 1)
    gate.learn(_announced(1, 2, "0-0-4"))  # the queued group, set aside from batch 2
    assert gate.allows(1, 1) and not gate.allows(2, 1)
