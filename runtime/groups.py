"""Find a run's GRPO groups by id: the Trajectory and RoutingTrace events joined, routing resolved.

Re-executing a committed step (trainer resume, `reel replay`, `reel retrain`) needs the exact groups
that step consumed, in the order of its StepCommitted. They are in the run's log (and, for the live
trainer, possibly still only on the bus); sources are added event by event.
"""

from __future__ import annotations

from collections.abc import Iterable

from reel.bus.blobs import BlobBackend
from reel.bus.errors import ReelError
from reel.bus.events import AnyEvent, RoutingTrace, StepCommitted, Trajectory
from reel.bus.log import RunLog
from reel.runtime.batch import Group, decode_routing


class MissingGroup(ReelError):
    """A committed step names a group that no source holds."""


class GroupLookup:
    trajectories: dict[str, Trajectory]
    routing: dict[str, RoutingTrace]
    blobs: BlobBackend
    why_missing: str  # the end of a MissingGroup message

    def __init__(self, blobs: BlobBackend):
        self.trajectories = {}
        self.routing = {}
        self.blobs = blobs
        self.why_missing = "the log is incomplete"  # a reader that knows better says so (a damaged log)

    @classmethod
    def from_log(cls, log: RunLog, blobs: BlobBackend) -> GroupLookup:
        lookup = cls(blobs)
        for stream in ("trajectories", "routing"):
            lookup.add(event for _, event in log.events(stream))
        return lookup

    def add(self, events: Iterable[AnyEvent]) -> None:
        for event in events:
            if isinstance(event, Trajectory):
                self.trajectories.setdefault(event.group_id, event)
            elif isinstance(event, RoutingTrace):
                self.routing.setdefault(event.group_id, event)

    def group(self, group_id: str, *, where: str) -> Group:
        trajectory = self.trajectories.get(group_id)
        if trajectory is None:
            raise MissingGroup(f"group {group_id} used by {where} is not in the run's log; {self.why_missing}")
        trace = self.routing.get(group_id)
        if trace is None:  # every trained group had its trace: without it the step cannot be re-executed
            raise MissingGroup(f"the routing trace of group {group_id} used by {where} is not in the run's log; "
                               f"{self.why_missing}")
        return Group(trajectory, decode_routing(trace, self.blobs.get(trace.blob) if trace.blob else None))

    def groups_of(self, commit: StepCommitted) -> list[Group]:
        return [self.group(g, where=f"step {commit.step}") for g in commit.groups]
