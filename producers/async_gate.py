"""The async gate: when a rollout worker may start its next group (rollout.async_level = a).

Let c be the newest policy version that is both committed (the `version` of the newest
StepCommitted; 0 before any commit, version 0 being the initial policy) and live in this worker's
engine: a commit counts once its weights are loaded there, so no round is sampled under weights
older than the gate assumes. A worker splits its groups into rounds of R = ceil(trainer.batch_groups
/ rollout.workers) groups, R being its share of one trainer batch (with concurrency below R, a round
takes several waves: were R capped at concurrency, each commit would release fewer groups than the
next step needs, and the run would stall); round r is meant for the step that turns version r into
r + 1. Its g-th group (counting from 0 in this process) belongs to round r(g) = c0 + (q + g) // R, c0
being c when the process started its first group and q the groups of this worker an earlier process
published that the trainer has yet to train (producers/outstanding.py: they fill the next batches
first), and may start only when

    r(g) - c <= a.

So a = 0 is synchronous: one batch share under version c, then nothing until version c + 1 is
committed and loaded; a = 1 lets a worker generate the next round while the trainer computes the
current one. Either way at most `rollout.concurrency` groups are in flight. A restarted worker
continues the rounds its queued groups started, at the current c.

g counts only groups the trainer may train: a group the worker dead-letters is replaced, and so is
one of its groups the trainer drops from the batch of a step after c0 (stale: it finished more
than max_off_policy_steps versions late, or invalid). Were drops counted, each would leave the worker
one group short of the batches to come for the rest of the run: with heavy-tailed tool calls
the slowest groups of a round finish too late, and 14 drops over 40 steps of examples/slow_calc
shrank the 24 groups async_level 2 keeps ahead of the trainer to 10, its wait growing step by step
(and async_level + 1 rounds of drops would stall it).

A drop is learnt from the trainer's GroupsDropped, published as it sets the group aside, and again
from the commit that lists it. The commit alone came too late: a synchronous worker waits for the
commit, and the commit for the batch the dropped group leaves one short, so both waited for ever
(each saying it waits, so no liveness check fired); with a >= 1 the replacement started a round
late. A group counts once however often it is named (the announcement, the commit, an announcement
again after a trainer restart): by group id, at the step of the batch it is missing from. Should a
restarted trainer train a group it had announced as dropped (a routing blob readable again), its
replacement is one group more than the rounds need, trained in a later batch.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import redis.asyncio

from reel.bus.events import GroupsDropped, StepCommitted
from reel.bus.log import LogError
from reel.bus.run_log import RunLog
from reel.producers.outstanding import outstanding_groups

log = logging.getLogger("reel.rollout")


class AsyncGate:
    round_size: int  # R: the worker's share of one trainer batch
    async_level: int  # a
    first_round: int  # c0: c when this process started its first group
    queued: int  # q: groups an earlier process published, not yet trained
    worker: int  # this worker's index: the first part of its group ids
    dropped: dict[str, int]  # this worker's dropped groups -> the step (commit version) they are missing from

    def __init__(self, batch_groups: int, workers: int, async_level: int, worker: int = 0):
        self.round_size = math.ceil(batch_groups / workers)
        self.async_level = async_level
        self.first_round = 0
        self.queued = 0
        self.worker = worker
        self.dropped = {}

    def allows(self, group: int, version: int) -> bool:
        """Whether this process's `group`-th group (from 0, replaced ones not counted) may start at c = `version`."""
        group -= sum(1 for v in self.dropped.values() if v > self.first_round)  # replaced: see the module doc
        return self.first_round + (self.queued + group) // self.round_size - version <= self.async_level

    def learn(self, event: StepCommitted | GroupsDropped) -> None:
        """Note the groups of this worker (any of its processes: a queued one too) that `event` names as dropped."""
        for d in event.dropped:
            if d.group_id.split("-", 1)[0] == str(self.worker):
                self.dropped[d.group_id] = event.step  # a commit's step is its version

    async def recover(self, redis: redis.asyncio.Redis, run_dir: Path, run_name: str, worker: str,
                      partition: int) -> None:
        """c0 and q, from one snapshot of the commits."""
        snapshot = await outstanding_groups(redis, run_dir, run_name, worker, partition)
        self.first_round, self.queued = snapshot.version, snapshot.groups
        if self.queued:
            log.info("%s: %d groups of an earlier run of this worker are still queued for the trainer; "
                     "counted in rounds from version %d", worker, self.queued, self.first_round)


def newest_logged_commit(run_dir: Path) -> int:
    """Version of the newest StepCommitted in the run's log (0 if none)."""
    try:
        with RunLog(run_dir, readonly=True) as run_log:
            if "steps" not in run_log.names():
                return 0
            return max((e.version for _, e in run_log.events("steps") if isinstance(e, StepCommitted)), default=0)
    except LogError:
        return 0  # no log yet
