"""Publishing a policy version as a manifest of shards (bus/weight_manifest.py), written in place.

    bucket   the tensors (Hub names, in model order) into shards of about `shard_bytes`
    write    each shard on its own thread: cast to the served dtype, then header and tensor memory
             straight into the blob store, which hashes each part (sha256, its key) as it writes
             it; the shard's BLAKE3 digest (runtime/shard_hash.py) is taken in the same pass
    name     the manifest (shard refs, tensor names) as one more small blob

Nothing holds the whole state in one buffer: a shard thread holds at most its bucket's cast tensors
(none when the dtype already matches), so the extra memory is about `threads` shards.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from reel.bus.blobs import BlobBackend
from reel.bus.events import BlobRef
from reel.bus.weight_manifest import WeightManifest, WeightShard, encode_manifest
from reel.runtime.config import Config
from reel.runtime.shard_hash import WRITE_HASH, hashed, new_digest
from reel.runtime.weight_shards import shard_parts

__all__ = ["DTYPES", "buckets", "publish_version", "put_shard", "served_dtype", "write_shard"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # manifest.dtype -> torch dtype


def served_dtype(config: Config) -> str:
    """The dtype the engine serves: bf16 shards for a bf16 vLLM (it would cast fp32 to the same bits on
    load), fp32 for the built-in engine, whose fp32 weights are the trainer's own."""
    serves_bf16 = config.engine.kind == "vllm" and config.trainer.precision in ("bf16", "fp8")
    return "bfloat16" if serves_bf16 else "float32"


def buckets(tensors: Iterable[tuple[str, torch.Tensor]], shard_bytes: int,
            itemsize: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive tensors grouped until a group reaches `shard_bytes` (a bigger tensor is a shard alone)."""
    out: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in tensors:
        nbytes = t.numel() * itemsize
        if out[-1] and size + nbytes > shard_bytes:
            out.append([])
            size = 0
        out[-1].append((name, t))
        size += nbytes
    return [b for b in out if b]


def write_shard(blobs: BlobBackend, tensors: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> tuple[BlobRef, str]:
    """(the shard's ref, its WRITE_HASH digest)."""
    cast = [(name, t.detach().to("cpu", dtype)) for name, t in tensors]
    return put_shard(blobs, cast)


def put_shard(blobs: BlobBackend, tensors: list[tuple[str, torch.Tensor]]) -> tuple[BlobRef, str]:
    """Writes `tensors` as one safetensors shard: (its ref, its WRITE_HASH digest, taken as it is written)."""
    digest = new_digest(WRITE_HASH)
    ref = blobs.put_parts(hashed(shard_parts(tensors), digest))
    return ref, digest.hexdigest()


def publish_version(blobs: BlobBackend, tensors: Iterable[tuple[str, torch.Tensor]], *, version: int, step: int,
                    dtype: str = "float32", shard_bytes: int = 64 << 20, rank: int = 0,
                    threads: int = 2) -> tuple[BlobRef, WeightManifest]:
    """Writes the version's shards and its manifest; returns the manifest's ref (WeightsPublished.weights)."""
    torch_dtype = DTYPES[dtype]
    groups = buckets(tensors, shard_bytes, torch.empty(0, dtype=torch_dtype).element_size())
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="reel-publish") as pool:
        written = list(pool.map(lambda group: write_shard(blobs, group, torch_dtype), groups))
    shards = [WeightShard(blob=ref, rank=rank, tensors=[name for name, _ in group], digest=digest)
              for (ref, digest), group in zip(written, groups)]
    manifest = WeightManifest(version=version, step=step, dtype=dtype, shards=shards, hash=WRITE_HASH)
    return blobs.put(encode_manifest(manifest)), manifest
