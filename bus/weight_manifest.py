"""What a published weight version is made of: a manifest of shards in the blob store.

A `WeightsPublished` with `format = "manifest"` names this manifest (msgpack, itself a blob) in its
`weights` BlobRef; the older `format = "safetensors"` names one whole-model safetensors blob. Each
trainer rank writes its own shards (safetensors, one file per parameter bucket), so no process holds
the whole state; readers stream shard by shard and verify each shard's hash as they go.

On N trainer ranks a tensor may be split by rows (FSDP2 shards every parameter on dim 0): each
rank writes the rows it holds as a piece, and `WeightShard.rows` says which rows of the whole tensor
each entry is. The pieces of a tensor tile its rows exactly once; a reader checks that
(runtime/weights/load.py) and copies a piece into the row range it names.

A version is either full (every tensor in its shards) or a delta against `base_version`: each shard
then holds, per changed tensor, the flat indices and new values (runtime/weights/delta.py), and the
shard's `result_sha256` checks what applying it produced. A delta also lists its version's full
shards (`full_shards`): a reader that does not hold `base_version` takes those.

Retention (bus/retention.py) and `reel log gc` keep or delete a version as a unit: `blob_refs` is
everything a version occupies in the store.
"""

from __future__ import annotations

import msgspec

from reel.bus.events import BlobRef

__all__ = ["Rows", "WeightShard", "shard_rows", "WeightManifest", "encode_manifest", "decode_manifest", "blob_refs"]


Rows = tuple[int, int, int]  # (start, stop, rows of the whole tensor): dim-0 rows [start, stop) of it


class WeightShard(msgspec.Struct, frozen=True):
    """One safetensors file of a version: the tensors of one parameter bucket, written by one rank."""

    blob: BlobRef
    rank: int  # the trainer rank that wrote it
    tensors: list[str]  # tensor names (HF / Qwen3-MoE keys), so a TP reader can skip shards it does not hold
    # Delta shards only: sha256 of the shard's tensors after the delta is applied (the manifest's dtype,
    # each tensor's bytes in `tensors` order), so a reader whose base differs finds out.
    result_sha256: str = ""
    # The shard's digest under WeightManifest.hash (runtime/weights/shard_hash.py); "" where that is sha256, whose
    # digest is blob.sha256, the store's key.
    digest: str = ""
    # Per entry of `tensors`: the rows of the whole tensor the entry holds. Empty: every entry is a whole
    # tensor (a one-process trainer, and every manifest written before ranks wrote their own shards).
    rows: list[Rows] = []


class WeightManifest(msgspec.Struct, frozen=True):
    version: int
    step: int
    dtype: str  # dtype the shards hold ("bfloat16" where the engine serves bf16, else "float32")
    shards: list[WeightShard]
    base_version: int = -1  # -1: a full version; else a delta that applies to this version
    hash: str = "sha256"  # what every shard's `digest` is: "blake3" now; "sha256" (blob.sha256) before
    # A delta's own full version (its shards, the same as a full manifest of `version` would list): what a
    # reader that does not hold base_version loads. Empty for a full version.
    full_shards: list[WeightShard] = []


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(WeightManifest)


def encode_manifest(manifest: WeightManifest) -> bytes:
    return _encoder.encode(manifest)


def decode_manifest(data: bytes) -> WeightManifest:
    return _decoder.decode(data)


def shard_rows(shard: WeightShard) -> dict[str, Rows | None]:
    """Each tensor of the shard -> the rows it holds, None where it is the whole tensor."""
    if not shard.rows:
        return dict.fromkeys(shard.tensors)
    return {name: None if rows[0] == 0 and rows[1] == rows[2] else rows for name, rows in zip(shard.tensors, shard.rows)}


def blob_refs(manifest_ref: BlobRef, manifest: WeightManifest) -> list[BlobRef]:
    """Every blob the version occupies: the manifest itself, its shards and a delta's full shards."""
    return [manifest_ref, *(shard.blob for shard in manifest.shards), *(shard.blob for shard in manifest.full_shards)]
