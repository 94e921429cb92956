"""StepCommitted.weights_sha256: what a step's new weights hash to, in one of two schemes.

    canonical  64 hex digits: the sha256 of `state_dict_bytes` (the whole fp32 model as one safetensors
               file), streamed tensor by tensor (weight_shards.canonical_sha256). Every one-process
               step, and N-rank steps logged before the pieces scheme (rank 0 gathers the model for it).
    pieces     "pieces:" + 64 hex digits: the sha256 of the sorted list of every rank's pieces
               (weight_publish.local_pieces: Hub name, rows, and the sha256 of the piece's fp32 bytes).
               N-rank steps: each rank hashes only the rows it holds, in place, and rank 0 receives
               about 100 bytes per piece (msgpack over the process group), never the model.

Why not one scheme: sha256 cannot be continued from pieces hashed on other ranks, so the canonical
digest needs the whole model in order on one process; and the pieces digest depends on how the model is
split (world size, expert parallelism), which a one-process step does not have. A step replays on the
world size it was logged on to be bitwise, so each step is re-hashed in the scheme its log entry names
(`scheme_of`): old N-rank logs keep replaying, through the gather, and compare.
"""

from __future__ import annotations

import hashlib

import msgspec
import torch

from reel.runtime.train.distributed import World, full_state_dict, gather_bytes
from reel.runtime.model.model import MoEModel
from reel.runtime.model.weights import hub_tensors
from reel.runtime.weights.publish import Piece, local_pieces
from reel.runtime.weights.shards import canonical_sha256

__all__ = ["CANONICAL", "PIECES", "scheme_of", "weights_digest"]

CANONICAL, PIECES = "canonical", "pieces"
_PREFIX = PIECES + ":"

Leaf = tuple[str, int, int, int, str]  # (Hub name, start, stop, rows of the whole tensor, sha256 of the piece)


def scheme_of(digest: str) -> str:
    """The scheme a logged weights_sha256 was computed in."""
    return PIECES if digest.startswith(_PREFIX) else CANONICAL


def weights_digest(model: MoEModel, world: World, scheme: str = PIECES) -> str:
    """The new weights' digest: canonical on one process; on N ranks `scheme` (a collective: every rank
    calls it; "" on ranks > 0)."""
    if not world.distributed:
        return canonical_sha256(hub_tensors(model.state_dict(), model.config))
    if scheme == CANONICAL:
        full = full_state_dict(model)
        return canonical_sha256(hub_tensors(full, model.config)) if world.rank == 0 else ""
    leaves = [_leaf(piece) for piece in local_pieces(model, model.config, world.rank)]
    every = gather_bytes(world, msgspec.msgpack.encode(leaves))
    if world.rank != 0:
        return ""
    merged = sorted(leaf for data in every for leaf in msgspec.msgpack.decode(data, type=list[Leaf]))
    return _PREFIX + hashlib.sha256(msgspec.msgpack.encode(merged)).hexdigest()


def _leaf(piece: Piece) -> Leaf:
    t = piece.tensor  # contiguous fp32 on the CPU: hashed where it lies
    start, stop, total = piece.rows or (0, t.shape[0], t.shape[0])
    data = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""
    return piece.name, start, stop, total, hashlib.sha256(data).hexdigest()
