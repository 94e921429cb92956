"""Which published weight versions and checkpoints the blob store keeps; the rest are deleted.

A weight version is transient: the log keeps its WeightsPublished (version, hash, size) forever, and
replay re-derives the weights by re-execution from the nearest checkpoint (replay/versions.py). The
store keeps a version while someone can still need its bytes:

    window      the newest `window` versions, window = max(max_off_policy_steps, async_level) + 1 + lag:
                a rollout worker is at most async_level versions ahead of the last commit, and the
                trainer trains no token older than max_off_policy_steps, so no worker, in-flight group
                or trainer step reads an older one; `lag` (mismatch.max_lag_steps while the mismatch
                role runs) more, so that role, behind the trainer by up to that many steps, still
                finds the versions a step's tokens were sampled by
    every K-th  versions divisible by log.keep_weights_every (0 = none), for analysis by hand
    delta base  the base_version of a kept delta version (transitively), or the delta cannot apply

Checkpoints (how replay and a resume rebuild everything else) are kept by their own policy,
CheckpointPolicy (log.keep_checkpoints, log.keep_checkpoints_every; by default every one):

    newest K    the newest K checkpoints, so the newest is never deleted (a resume starts from it)
    every M     checkpoints of steps divisible by M, for replay of older steps

A step N stays replayable bit for bit while a kept checkpoint lies at or before N-1 (or no checkpoint
was written before N: it replays from init/): every step after the oldest kept checkpoint, the
others re-executing from the nearest kept one before them. Older steps are not: replay says which
checkpoint they would need (replay/pruned.py). Every event stays in the log, so `reel retrain`
still trains on all of their trajectories. The owner publishes CheckpointsPruned for `doomed_checkpoints()`
before `collect` deletes them, so the log tells a pruned checkpoint from a lost one (`reel log verify`),
and only a committed checkpoint is ever doomed: one being written belongs to no commit yet.
init/ (not in the store) is never deleted, nor any blob that a kept version or kept checkpoint
shares (blobs are content-addressed).

A version is a unit: for `format = "manifest"` its manifest blob and every shard
(bus/weight_manifest.py `blob_refs`), for `"safetensors"` its one blob. Shards are deleted before
their manifest, so a deletion cut short leaves a manifest that names what is left, and the next
pass finishes it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import msgspec

from reel.bus.blobs import BlobBackend, BlobMissing
from reel.bus.events import AnyEvent, BlobRef, CheckpointsPruned, StepCommitted, WeightsPublished
from reel.bus.weight_manifest import blob_refs, decode_manifest

__all__ = ["RetentionPolicy", "CheckpointPolicy", "StoredVersion", "Retention"]

log = logging.getLogger(__name__)


class RetentionPolicy(msgspec.Struct, frozen=True):
    window: int  # the newest versions always kept (>= 1)
    keep_every: int = 0  # also every version divisible by this (0 = none)

    @classmethod
    def of(cls, async_level: int, max_off_policy_steps: int, keep_every: int = 0, lag: int = 0) -> RetentionPolicy:
        return cls(window=max(async_level, max_off_policy_steps) + 1 + lag, keep_every=keep_every)

    def keeps(self, version: int, newest: int) -> bool:
        return version > newest - self.window or (self.keep_every > 0 and version % self.keep_every == 0)


class CheckpointPolicy(msgspec.Struct, frozen=True):
    keep_last: int = 0  # the newest checkpoints kept; 0 = every checkpoint (no pruning)
    keep_every: int = 0  # also those of steps divisible by this (0 = none)

    def kept(self, steps: Iterable[int]) -> set[int]:
        """Which of the checkpoint `steps` the policy keeps."""
        ordered = sorted(steps)
        if self.keep_last <= 0:
            return set(ordered)
        return set(ordered[-self.keep_last:]) | {s for s in ordered if self.keep_every and s % self.keep_every == 0}


class StoredVersion(msgspec.Struct):
    """What one published version occupies in the store."""

    version: int
    refs: list[BlobRef]  # shards first, the manifest (or the one safetensors blob) last
    base_version: int = -1  # a delta's base; -1 for a full version


class Retention:
    """The versions a run has published and the checkpoints it wrote; `collect` deletes what the
    policy lets go. The trainer feeds it as it commits; `reel log gc` feeds it a whole log."""

    policy: RetentionPolicy
    checkpoint_policy: CheckpointPolicy
    blobs: BlobBackend
    versions: dict[int, StoredVersion]  # published and not yet deleted
    checkpoints: dict[int, StepCommitted]  # step -> its commit, for every committed checkpoint
    pruned: set[int]  # checkpoint steps a CheckpointsPruned names (deleted, or about to be)
    delete_files: Callable[[int], int] | None  # deletes the files of step N's N-rank checkpoint; bytes freed

    def __init__(self, policy: RetentionPolicy, blobs: BlobBackend,
                 checkpoint_policy: CheckpointPolicy = CheckpointPolicy(),
                 delete_files: Callable[[int], int] | None = None):
        self.policy = policy
        self.checkpoint_policy = checkpoint_policy
        self.blobs = blobs
        self.versions = {}
        self.checkpoints = {}
        self.pruned = set()
        self.delete_files = delete_files

    @property
    def protected(self) -> set[str]:
        """sha256 of every checkpoint blob not pruned."""
        return {c.checkpoint.sha256 for step, c in self.checkpoints.items() if step not in self.pruned}

    def add(self, events: list[AnyEvent]) -> None:
        """Take note of WeightsPublished, StepCommitted (its checkpoint) and CheckpointsPruned; other
        events are ignored."""
        for event in events:
            if isinstance(event, WeightsPublished):
                self.versions[event.version] = self._stored(event)
            elif isinstance(event, StepCommitted) and event.checkpoint is not None:
                self.checkpoints[event.step] = event
            elif isinstance(event, CheckpointsPruned):
                self.pruned.update(event.steps)

    def doomed_checkpoints(self) -> list[int]:
        """Checkpoint steps the policy lets go and no CheckpointsPruned names yet, oldest first."""
        kept = self.checkpoint_policy.kept(self.checkpoints)
        return sorted(set(self.checkpoints) - kept - self.pruned)

    def doomed(self) -> list[StoredVersion]:
        """The versions the policy lets go now, oldest first."""
        if not self.versions:
            return []
        newest = max(self.versions)
        kept = {v for v in self.versions if self.policy.keeps(v, newest)}
        stack = list(kept)
        while stack:  # a kept delta keeps its base, and that base's base
            base = self.versions[stack.pop()].base_version
            if base in self.versions and base not in kept:
                kept.add(base)
                stack.append(base)
        return [self.versions[v] for v in sorted(self.versions) if v not in kept]

    def collect(self) -> tuple[list[int], int]:
        """Delete the weight versions the policy lets go, and the checkpoints a CheckpointsPruned named;
        (versions deleted, bytes freed)."""
        doomed = self.doomed()
        gone = {v.version for v in doomed}
        kept = [v for v in self.versions.values() if v.version not in gone]
        shared = self.protected | {ref.sha256 for v in kept for ref in v.refs}
        freed = 0
        for stored in doomed:
            for ref in stored.refs:
                if ref.sha256 not in shared:
                    freed += self.blobs.delete(ref)
            del self.versions[stored.version]
        if doomed:
            log.debug("retention: deleted weight versions %s (%d bytes)", sorted(gone), freed)
        for step in sorted(self.pruned & self.checkpoints.keys()):
            commit = self.checkpoints.pop(step)
            if commit.checkpoint.sha256 in shared:
                continue
            # An N-rank checkpoint's files go before its manifest: a deletion cut short is finished next time.
            if commit.world_size > 1 and self.delete_files is not None:
                freed += self.delete_files(step)
            freed += self.blobs.delete(commit.checkpoint)
            log.info("retention: deleted the checkpoint of step %d (log.keep_checkpoints)", step)
        return sorted(gone), freed

    def _stored(self, event: WeightsPublished) -> StoredVersion:
        if event.format != "manifest":
            return StoredVersion(event.version, [event.weights])
        try:
            manifest = decode_manifest(self.blobs.get(event.weights))
        except BlobMissing:  # deleted already (by an earlier pass): nothing of it is left to delete
            return StoredVersion(event.version, [event.weights])
        refs = blob_refs(event.weights, manifest)
        return StoredVersion(event.version, refs[1:] + refs[:1], manifest.base_version)
