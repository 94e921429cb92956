"""Find a run's GRPO groups by id: the Trajectory and RoutingTrace events joined, routing resolved.

Re-executing a committed step (trainer resume, `reel replay`, `reel retrain`) needs the exact groups
that step consumed, in the order of its StepCommitted. They are in the run's log (and, for the live
trainer, possibly still only on the bus). The log is read through its index (bus/logindex.py), one
group at a time as a step asks for it, so memory and time do not grow with the log; events that are
not in the log (the bus) are added event by event.
"""

from __future__ import annotations

from collections.abc import Iterable

from reel.bus.blobs import BlobBackend
from reel.bus.errors import ReelError
from reel.bus.events import AnyEvent, RoutingTrace, StepCommitted, Trajectory, decode
from reel.bus.run_log import RunLog
from reel.bus.logindex import LogIndex
from reel.runtime.train.batch import Group, decode_routing


class MissingGroup(ReelError):
    """A committed step names a group that no source holds."""


class GroupLookup:
    trajectories: dict[str, Trajectory]
    routing: dict[str, RoutingTrace]
    blobs: BlobBackend
    index: LogIndex | None  # the run's log, read a group at a time
    why_missing: str  # the end of a MissingGroup message

    def __init__(self, blobs: BlobBackend, index: LogIndex | None = None):
        self.trajectories = {}
        self.routing = {}
        self.blobs = blobs
        self.index = index
        self.why_missing = "the log is incomplete"  # a reader that knows better says so (a damaged log)

    @classmethod
    def from_log(cls, log: RunLog, blobs: BlobBackend) -> GroupLookup:
        index = LogIndex(log, log.root.parent)
        index.sync()
        return cls(blobs, index)

    def add(self, events: Iterable[AnyEvent]) -> None:
        for event in events:
            if isinstance(event, Trajectory):
                self.trajectories.setdefault(event.group_id, event)
            elif isinstance(event, RoutingTrace):
                self.routing.setdefault(event.group_id, event)

    def trajectory(self, group_id: str) -> Trajectory | None:
        return self.trajectories.get(group_id) or self._logged("trajectories", group_id)

    def trace(self, group_id: str) -> RoutingTrace | None:
        return self.routing.get(group_id) or self._logged("routing", group_id)

    def _logged(self, stream: str, group_id: str) -> AnyEvent | None:
        record = self.index.group(stream, group_id) if self.index is not None else None
        return None if record is None else decode(record.data)

    def group(self, group_id: str, *, where: str) -> Group:
        trajectory = self.trajectory(group_id)
        if trajectory is None:
            raise MissingGroup(f"group {group_id} used by {where} is not in the run's log; {self.why_missing}")
        trace = self.trace(group_id)
        if trace is None:  # every trained group had its trace: without it the step cannot be re-executed
            raise MissingGroup(f"the routing trace of group {group_id} used by {where} is not in the run's log; "
                               f"{self.why_missing}")
        return Group(trajectory, decode_routing(trace, self.blobs.get(trace.blob) if trace.blob else None))

    def groups_of(self, commit: StepCommitted) -> list[Group]:
        return [self.group(g, where=f"step {commit.step}") for g in commit.groups]
