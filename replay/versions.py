"""Policy weights by version for replay, whether or not retention kept them in the blob store.

A version the store still holds is read from it (hash-checked). One that retention deleted
(bus/retention.py) is re-derived: the nearest checkpoint at or before it is restored and the
committed steps up to it are re-executed, each checked against the weight hash its StepCommitted
names, exactly as `reel replay step` rebuilds the state before a step. Re-derived versions are kept
(the last `keep`), and so is the state the last derivation reached: asking for versions in order,
as `replay range` and `bisect` do, re-executes each step once, not once per request. On N ranks
nothing is re-derived (the followers hold one state), nor on another number of ranks than the run
trained on (not bitwise), nor before the oldest checkpoint retention kept (replay/pruned.py): those
tokens are left out of the split.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

import torch

from reel.bus.blobs import BlobBackend
from reel.bus.events import AnyEvent, StepCommitted
from reel.runtime.config.sections import Config
from reel.runtime.train.groups import GroupLookup
from reel.runtime.train.mismatch_split import WeightHistory
from reel.runtime.train.reexecute import catch_up, checkpoint_before, newest_checkpoint
from reel.runtime.train.step import TrainState
from reel.runtime.train.trainer_group import TrainerGroup

__all__ = ["Versions"]


class Versions:
    """`get(version)` -> weights bytes (None for a version the run never committed)."""

    stored: WeightHistory  # what the blob store still holds
    reexecuted: int  # steps re-executed to re-derive versions, over this object's life
    _derived: OrderedDict[int, bytes]
    _cursor: TrainState | None  # the state the last derivation reached

    def __init__(self, events: Iterable[AnyEvent], blobs: BlobBackend, commits: dict[int, StepCommitted],
                 lookup: Callable[[], GroupLookup], config: Config, group: Callable[[], TrainerGroup],
                 keep: int = 4, pruned: set[int] | None = None):
        self.stored = WeightHistory.from_events(events, blobs, keep)
        self.blobs = blobs
        self.commits = commits
        self.lookup = lookup  # called when a derivation needs the groups (the lookup may be built lazily)
        self.config = config
        self.group = group  # the ranks that re-execute (replay may start more after this object exists)
        self.keep = keep
        self.pruned = pruned or set()  # checkpoint steps retention deleted (`commits` are without them)
        self.reexecuted = 0
        self._derived = OrderedDict()
        self._cursor = None

    @property
    def refs(self):
        return self.stored.refs

    def get(self, version: int) -> bytes | None:
        data = self.stored.get(version)
        if data is not None or version not in self.stored.refs:
            return data
        if version in self._derived:
            self._derived.move_to_end(version)
            return self._derived[version]
        group = self.group()
        # Followers of a multi-rank group hold one state: a second one (the cursor) is not theirs to keep.
        # Steps trained on another number of ranks cannot be re-derived bit for bit here either.
        if version != 0 and version not in self.commits or group.world.distributed:
            return None
        if version != 0 and self.commits[version].world_size != group.world.size:
            return None
        # Nor a version whose every earlier checkpoint retention deleted: that would re-train the run up to it.
        if newest_checkpoint(self.commits, version) is None and any(s <= version for s in self.pruned):
            return None
        data = group.weights(self._state_at(version, group))
        self._derived[version] = data
        while len(self._derived) > self.keep:
            self._derived.popitem(last=False)
        return data

    def _state_at(self, version: int, group: TrainerGroup) -> TrainState:
        base = newest_checkpoint(self.commits, version)
        start = base.step if base is not None else 0
        cursor = self._cursor
        if cursor is None or not start <= cursor.step <= version:
            cursor = group.restore(*checkpoint_before(self.commits, version, self.blobs))
        self.reexecuted += version - cursor.step
        with torch.enable_grad():  # callers score batches under no_grad; these are training steps
            self._cursor = catch_up(cursor, self.commits, version, self.lookup(), self.config, step_fn=group.step)
        return self._cursor
