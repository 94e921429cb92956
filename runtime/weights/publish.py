"""Publishing a policy version as a manifest of shards (bus/weight_manifest.py), written in place.

    pieces   the tensors this rank holds, under their Hub names, in model order (`local_pieces`): on one
             process every tensor whole; on N ranks each rank's own FSDP2 rows (DTensor.to_local(),
             Shard(0)), stacked experts as whole per-expert tensors, other parameters as row ranges
    bucket   the tensors (Hub names, in model order) into shards of about `shard_bytes`
    write    each shard on its own thread: cast to the served dtype, then header and tensor memory
             straight into the blob store, which hashes each part (sha256, its key) as it writes
             it; the shard's BLAKE3 digest (runtime/weights/shard_hash.py) is taken in the same pass
    name     the manifest (shard refs, tensor names) as one more small blob

Nothing holds the whole state in one buffer: a shard thread holds at most its bucket's cast tensors
(none when the dtype already matches), so the extra memory is about `threads` shards. On N ranks
every rank writes its own shards (runtime/weights/rank_publish.py gathers their descriptions on rank 0, which
names the version): no rank gathers the model.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, TypeVar

import torch
from torch import nn

from reel.bus.blobs import BlobBackend
from reel.bus.events import BlobRef
from reel.bus.weight_manifest import Rows, WeightManifest, WeightShard, encode_manifest
from reel.runtime.config.sections import Config
from reel.runtime.model.config import MoEConfig
from reel.runtime.model.state_dict_adapter import hub_rows
from reel.runtime.weights.shard_hash import WRITE_HASH, hashed, new_digest
from reel.runtime.weights.shards import shard_parts

__all__ = ["DTYPES", "Piece", "buckets", "local_pieces", "publish_version", "put_shard", "served_dtype",
           "write_pieces", "write_shard"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # manifest.dtype -> torch dtype


def served_dtype(config: Config) -> str:
    """The dtype the engine serves: bf16 shards for a bf16 vLLM (it would cast fp32 to the same bits on
    load), fp32 for the built-in engine, whose fp32 weights are the trainer's own."""
    serves_bf16 = config.engine.kind == "vllm" and config.trainer.precision in ("bf16", "fp8")
    return "bfloat16" if serves_bf16 else "float32"


class Piece(NamedTuple):
    """A Hub tensor, or the rows of it that one rank holds."""

    name: str
    tensor: torch.Tensor  # CPU fp32
    rows: Rows | None  # None: the whole tensor


Item = TypeVar("Item", bound=Sequence)


def buckets(items: Iterable[Item], shard_bytes: int, itemsize: int) -> list[list[Item]]:
    """Consecutive (name, tensor, ...) items grouped until a group reaches `shard_bytes` (a bigger tensor
    is a shard alone)."""
    out: list[list[Item]] = [[]]
    size = 0
    for item in items:
        nbytes = item[1].numel() * itemsize
        if out[-1] and size + nbytes > shard_bytes:
            out.append([])
            size = 0
        out[-1].append(item)
        size += nbytes
    return [b for b in out if b]


def local_pieces(model: nn.Module, config: MoEConfig, rank: int = 0) -> Iterator[Piece]:
    """The Hub tensors, or rows of them, that this rank holds, in model order. A sharded model's
    parameters are DTensors sharded on dim 0 only (FSDP2 and expert parallelism, runtime/model/
    parallelize.py): a rank with no rows of one (dim 0 < ranks) gives nothing for it, and where a mesh
    dim replicates, the rank at coordinate 0 on it gives the rows. A plain tensor is rank 0's."""
    from torch.distributed.tensor import DTensor

    for name, t in model.state_dict().items():
        if isinstance(t, DTensor):
            start, local = _local_rows(name, t)
        else:
            start, local = 0, (t if rank == 0 else None)
        if local is None:
            continue
        for hub, piece, first in hub_rows(name, local.detach(), start, config):
            piece = piece.to("cpu", torch.float32).contiguous()
            whole = first is None or piece.dim() == 0 or (first == 0 and piece.shape[0] == t.shape[0])
            yield Piece(hub, piece, None if whole else (first, first + piece.shape[0], t.shape[0]))


def _local_rows(name: str, t: torch.Tensor) -> tuple[int, torch.Tensor | None]:
    """(first row of the whole tensor, this rank's rows), or (0, None) when this rank gives none."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    coordinate = t.device_mesh.get_coordinate()
    if coordinate is None or any(isinstance(p, Replicate) and c for p, c in zip(t.placements, coordinate)):
        return 0, None
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    local = t.to_local()
    if tuple(local.shape) != tuple(shape) or any(offset[1:]) or tuple(shape[1:]) != tuple(t.shape[1:]):
        raise ValueError(f"{name} is sharded as {t.placements}; a rank can publish only dim-0 rows")
    return (offset[0] if local.dim() else 0), (local if local.dim() == 0 or local.shape[0] else None)


def write_shard(blobs: BlobBackend, tensors: Sequence[Sequence], dtype: torch.dtype) -> tuple[BlobRef, str]:
    """(the shard's ref, its WRITE_HASH digest) for (name, tensor, ...) items."""
    cast = [(item[0], item[1].detach().to("cpu", dtype)) for item in tensors]
    return put_shard(blobs, cast)


def put_shard(blobs: BlobBackend, tensors: list[tuple[str, torch.Tensor]]) -> tuple[BlobRef, str]:
    """Writes `tensors` as one safetensors shard: (its ref, its WRITE_HASH digest, taken as it is written)."""
    digest = new_digest(WRITE_HASH)
    ref = blobs.put_parts(hashed(shard_parts(tensors), digest))
    return ref, digest.hexdigest()


def write_pieces(blobs: BlobBackend, pieces: Iterable[Piece], dtype: str, *, shard_bytes: int, rank: int = 0,
                 threads: int = 2) -> list[WeightShard]:
    """This rank's shards of a version (one per bucket of its pieces), written in parallel."""
    torch_dtype = DTYPES[dtype]
    groups = buckets(pieces, shard_bytes, torch.empty(0, dtype=torch_dtype).element_size())
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="reel-publish") as pool:
        written = list(pool.map(lambda group: write_shard(blobs, group, torch_dtype), groups))
    return [shard_of(ref, digest, rank, group) for (ref, digest), group in zip(written, groups)]


def shard_of(ref: BlobRef, digest: str, rank: int, pieces: Sequence[Piece], result_sha256: str = "") -> WeightShard:
    """The manifest's entry for a shard of `pieces` (rows listed only where some piece is not whole)."""
    split = any(p.rows is not None for p in pieces)
    rows = [p.rows or (0, p.tensor.shape[0], p.tensor.shape[0]) for p in pieces] if split else []
    return WeightShard(blob=ref, rank=rank, tensors=[p.name for p in pieces], result_sha256=result_sha256,
                       digest=digest, rows=rows)


def publish_version(blobs: BlobBackend, tensors: Iterable[tuple[str, torch.Tensor]], *, version: int, step: int,
                    dtype: str = "float32", shard_bytes: int = 64 << 20, rank: int = 0,
                    threads: int = 2) -> tuple[BlobRef, WeightManifest]:
    """Writes a version held whole in this process (shards and manifest); returns the manifest's ref
    (WeightsPublished.weights) and the manifest."""
    shards = write_pieces(blobs, (Piece(name, t, None) for name, t in tensors), dtype, shard_bytes=shard_bytes,
                          rank=rank, threads=threads)
    manifest = WeightManifest(version=version, step=step, dtype=dtype, shards=shards, hash=WRITE_HASH)
    return blobs.put(encode_manifest(manifest)), manifest
