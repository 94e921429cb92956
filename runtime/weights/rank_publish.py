"""Publishing a policy version from every trainer rank: each writes its own shards, rank 0 names them.

    write    every rank writes the shards of the rows it holds (weight_publish.local_pieces: its FSDP2
             pieces, whole experts), and, with trainer.weight_delta, the delta of those pieces against
             its own shards of the previous version
    gather   the shards' descriptions (msgpack, a few hundred bytes per shard) to rank 0 over the
             process group's own collectives (distributed.gather_bytes: no pickle)
    name     rank 0 writes the manifest (and the delta's, where it is smaller) and returns its ref

No rank gathers the model: the publish moves only shard descriptions between ranks. On one process
this is the same code with a gather of one.
"""

from __future__ import annotations

import msgspec

from reel.bus.blobs import BlobBackend
from reel.bus.events import BlobRef
from reel.bus.weight_manifest import WeightManifest, WeightShard, encode_manifest
from reel.runtime.config.sections import Config
from reel.runtime.train.distributed import World, gather_bytes
from reel.runtime.model.model import MoEModel
from reel.runtime.weights.shard_hash import WRITE_HASH
from reel.runtime.weights.delta import delta_manifest, delta_shards
from reel.runtime.weights.publish import local_pieces, served_dtype, write_pieces

__all__ = ["RankShards", "RankPublisher"]


class RankShards(msgspec.Struct, frozen=True):
    """What one rank wrote for a version (what it sends rank 0)."""

    full: list[WeightShard]
    delta: list[WeightShard] | None  # None: no delta from this rank (off, no base, or another layout)


class RankPublisher:
    """One rank's side of `TrainerGroup.publish` (a collective: every rank calls `publish` together)."""

    world: World
    config: Config
    previous: tuple[int, list[WeightShard]] | None  # (version, this rank's shards of it): a delta's base

    def __init__(self, world: World, config: Config):
        self.world = world
        self.config = config
        self.previous = None

    def publish(self, model: MoEModel, version: int, blobs: BlobBackend) -> tuple[BlobRef, WeightManifest] | None:
        """Writes this rank's shards of `version`; on rank 0 -> the ref and manifest to publish, else None."""
        t, rank = self.config.trainer, self.world.rank
        dtype, shard_bytes = served_dtype(self.config), t.weight_shard_mb << 20
        pieces = list(local_pieces(model, model.config, rank))
        full = write_pieces(blobs, pieces, dtype, shard_bytes=shard_bytes, rank=rank)
        delta = None
        if t.weight_delta and self.previous is not None and self.previous[0] == version - 1:
            delta = delta_shards(blobs, pieces, self.previous[1], dtype, shard_bytes=shard_bytes, rank=rank)
        self.previous = (version, full)
        sent = gather_bytes(self.world, msgspec.msgpack.encode(RankShards(full, delta)))
        if rank != 0:
            return None
        every = [msgspec.msgpack.decode(data, type=RankShards) for data in sent]
        manifest = WeightManifest(version=version, step=version, dtype=dtype, hash=WRITE_HASH,
                                  shards=[shard for mine in every for shard in mine.full])
        ref = blobs.put(encode_manifest(manifest))
        if all(mine.delta is not None for mine in every):
            smaller = delta_manifest(manifest, version - 1, [shard for mine in every for shard in mine.delta or ()])
            if smaller is not None:
                return blobs.put(encode_manifest(smaller)), smaller
        return ref, manifest
