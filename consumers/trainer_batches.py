"""The trainer's wait: read the `trainer` group on trajectories + routing until a batch is ready.

A group is complete when both its Trajectory and its RoutingTrace are here (joined by group id).
A complete group is checked before it may be trained: one that is invalid (bad tokens), older than
max_off_policy_steps or whose routing trace does not fit its tokens is set aside as dropped, with its
reason, and recorded in the next StepCommitted (never silent). Drops are also announced at once
(GroupsDropped, before the next wait and before the batch goes to compute): their workers replace
them, and a synchronous worker would otherwise wait for the commit that waits for the replacement
(producers/async_gate.py). The announcement changes nothing the step trains. Complete groups beyond
the batch wait for the next step; a group a commit already lists (re-delivered after a crash) is acked,
not trained. The commit protocol that follows is consumers/trainer.py's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from reel.bus.blobs import BlobBackend
from reel.bus.errors import ReelError
from reel.bus.events import DroppedGroup, RoutingTrace, Trajectory
from reel.bus.streams import Delivery, GroupConsumer
from reel.runtime.config.sections import Config
from reel.runtime.model.config import MoEConfig
from reel.runtime.train.batch import Group, decode_routing, routing_problem
from reel.runtime.train.group_checks import group_problem
from reel.runtime.heartbeat import Heartbeat


@dataclass
class PendingGroup:
    trajectory: Delivery | None = None
    routing: Delivery | None = None
    resolved: Group | None = None  # routing decoded and checked, once both parts are here

    def deliveries(self) -> list[Delivery]:
        return [d for d in (self.trajectory, self.routing) if d is not None]


@dataclass
class Collected:
    groups: list[tuple[str, PendingGroup]] = field(default_factory=list)
    dropped: list[tuple[DroppedGroup, PendingGroup]] = field(default_factory=list)

    def deliveries(self) -> list[Delivery]:
        """Every entry this step consumed: acked once its commit is durable."""
        return [d for _, part in self.groups + self.dropped for d in part.deliveries()]


class BatchGatherer:
    """Joins the trainer group's deliveries into complete groups and picks the next batch."""

    config: Config
    blobs: BlobBackend
    consumer: GroupConsumer
    committed_groups: set[str]  # trained or dropped by a commit (the trainer adds each commit's)
    pending: dict[str, PendingGroup]  # groups read and not yet in a batch
    heartbeat: Heartbeat  # the trainer's: says what it waits for
    announce: Callable[[int, list[DroppedGroup]], Awaitable[None]]  # publishes GroupsDropped(step, dropped)

    def __init__(self, config: Config, blobs: BlobBackend, consumer: GroupConsumer, heartbeat: Heartbeat,
                 announce: Callable[[int, list[DroppedGroup]], Awaitable[None]]):
        self.config = config
        self.heartbeat = heartbeat
        self.announce = announce
        self.blobs = blobs
        self.consumer = consumer
        self.committed_groups = set()
        self.pending = {}

    async def collect(self, stop: asyncio.Event, step: int, model: MoEConfig) -> Collected:
        """Read until batch_groups fresh groups are complete for the step after `step` (the policy version
        the trainer holds); stale or invalid ones are set aside as dropped, and announced before each wait."""
        out = Collected()
        want = self.config.trainer.batch_groups
        for group_id, part in list(self.pending.items()):  # complete groups left over from the last step
            self._offer(group_id, part, out, step, model)
        announced = 0  # of out.dropped
        while True:
            if len(out.dropped) > announced:
                await self.announce(step + 1, [d for d, _ in out.dropped[announced:]])
                announced = len(out.dropped)
            if len(out.groups) >= want or stop.is_set():
                return out
            self.heartbeat.alive("waiting for groups", f"{len(out.groups)} of {want} for step {step + 1}", waiting=True)
            for delivery in await self.consumer.read(count=2 * want):
                event = delivery.event
                if not isinstance(event, (Trajectory, RoutingTrace)):
                    await self.consumer.dead_letter(delivery, f"unexpected {type(event).__name__} on {delivery.stream}")
                    continue
                if event.group_id in self.committed_groups:
                    await self.consumer.ack([delivery])  # re-delivered after a crash; already trained
                    continue
                part = self.pending.setdefault(event.group_id, PendingGroup())
                if isinstance(event, Trajectory):
                    part.trajectory = delivery
                else:
                    part.routing = delivery
                self._offer(event.group_id, part, out, step, model)

    def _offer(self, group_id: str, part: PendingGroup, out: Collected, step: int, model: MoEConfig) -> None:
        """Move a complete group into this step's batch or its dropped list; beyond the batch it waits."""
        if part.trajectory is None or part.routing is None:
            return
        assert isinstance(part.trajectory.event, Trajectory)
        trajectory = part.trajectory.event
        reason = (_invalid_reason(trajectory, model) or self._stale_reason(trajectory, step)
                  or self._resolve(part, model))
        if reason is not None:
            out.dropped.append((DroppedGroup(group_id, reason), part))
        elif len(out.groups) < self.config.trainer.batch_groups:
            out.groups.append((group_id, part))
        else:
            return
        del self.pending[group_id]

    def _stale_reason(self, trajectory: Trajectory, step: int) -> str | None:
        oldest = min((v for s in trajectory.samples for _, v in s.spans), default=step)
        behind = step - oldest
        limit = self.config.trainer.max_off_policy_steps
        return f"stale: {behind} versions behind > max_off_policy_steps = {limit}" if behind > limit else None

    def _resolve(self, part: PendingGroup, model: MoEConfig) -> str | None:
        """Decode and check the group's routing into part.resolved; why it cannot be trained, if so.

        A trace that does not match its tokens is dropped with its group (recorded in the commit):
        training it without router replay would turn R3 off for the whole step."""
        assert part.trajectory is not None and part.routing is not None
        trace = part.routing.event
        assert isinstance(trace, RoutingTrace) and isinstance(part.trajectory.event, Trajectory)
        try:
            blob = self.blobs.get(trace.blob) if trace.blob else None
            group = Group(part.trajectory.event, decode_routing(trace, blob))
            # Without router replay a trace is not used: an engine that cannot capture routing (vLLM on a
            # CPU) sends empty ones, which must not drop every group.
            problem = (routing_problem(group, len(model.moe_layers), model.num_experts_per_tok, model.num_experts)
                       if self.config.trainer.router_replay else None)
        except (ReelError, ValueError) as exc:  # a missing or corrupted blob, bytes that do not fit the shape
            problem = f"routing trace unreadable: {exc}"
        if problem is not None:
            return f"bad_routing: {problem}"
        part.resolved = group
        return None


def _invalid_reason(trajectory: Trajectory, model: MoEConfig) -> str | None:
    problem = group_problem(trajectory, model.vocab_size)
    return f"invalid: {problem}" if problem else None
