"""Sparse delta versions: per shard, what changed bitwise since the previous version.

A delta shard is safetensors like a full one; per tensor of its bucket that changed it holds either
    <name>::index  int32 [K]  flat indices of the elements whose bits changed
    <name>::value  [K]        their new values (the manifest's dtype)
or, where indices and values would outweigh the tensor, <name> itself (the whole new tensor). A tensor
whose bits did not change is absent. WeightShard.tensors lists every tensor the shard touches, and
`result_sha256` is the sha256 of those tensors' new bytes in that order: the reader recomputes it after
applying, so a base that differs from the writer's is caught (the reader then loads the full shards).

On N trainer ranks each rank writes the delta of its own pieces against its own shards of the
previous version (rows as in the full shards); a reader applies a piece's delta into its row range.
Written against the previous version's full shards, read back through the store's maps (the page
cache), so the trainer keeps no second copy of the weights. A delta pays where training moves few
elements across a representable step: bf16 weights under a small learning rate.

Two ways to read one: `apply_delta` changes a reader's live tensors in place (the built-in engine);
`rebuilt_version` rebuilds the tensors from the base version's full shards in the store, for a reader
whose live weights are not Hub tensors (a vLLM worker: fused, sharded, packed).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager

import torch

from reel.bus.blobs import BlobBackend, BlobError
from reel.bus.events import BlobRef
from reel.bus.weight_manifest import Rows, WeightManifest, WeightShard, encode_manifest, shard_rows
from reel.runtime.weights.shard_hash import WRITE_HASH
from reel.runtime.weights.load import WeightLoadError, verified_map, verify_version
from reel.runtime.weights.publish import DTYPES, Piece, buckets, put_shard, shard_of
from reel.runtime.weights.shards import ShardFormatError, read_header, tensor_at

__all__ = ["INDEX", "VALUE", "changed", "delta_shards", "delta_manifest", "publish_delta", "verify_delta", "full_of",
           "apply_delta", "base_shards", "rebuilt_version"]

INDEX, VALUE = "::index", "::value"
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def changed(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Flat indices where the bits differ (NaN and -0.0 compare as the bits they are)."""
    bits = _BITS[new.element_size()]
    return torch.nonzero(new.reshape(-1).view(bits) != old.reshape(-1).view(bits)).reshape(-1)


def _entries(name: str, new: torch.Tensor, old: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    index = changed(new, old)
    if index.numel() == 0:
        return []
    if index.numel() * (4 + new.element_size()) >= new.numel() * new.element_size() or new.numel() >= 2**31:
        return [(name, new)]
    return [(name + INDEX, index.to(torch.int32)), (name + VALUE, new.reshape(-1)[index])]


def _result_sha256(tensors: Iterable[torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
    return digest.hexdigest()


def _delta_shard(blobs: BlobBackend, group: list[Piece], base: WeightShard, dtype: torch.dtype,
                 rank: int) -> WeightShard | None:
    mine = shard_of(base.blob, base.digest, rank, group)
    if (base.tensors, base.rows) != (mine.tensors, mine.rows):
        raise ValueError("the previous version's shard holds other tensors: publish a full version")
    entries, touched = [], []
    with blobs.mapped(base.blob) as data:
        old = {entry.name: entry for entry in read_header(data)}
        for piece in group:
            new = piece.tensor.detach().to("cpu", dtype).contiguous()
            found = _entries(piece.name, new, tensor_at(data, old[piece.name]))
            if found:
                entries += found
                touched.append(piece._replace(tensor=new))
    if not touched:
        return None
    ref, digest = put_shard(blobs, entries)
    return shard_of(ref, digest, rank, touched, result_sha256=_result_sha256(p.tensor for p in touched))


def delta_shards(blobs: BlobBackend, pieces: Iterable[Piece], base: list[WeightShard], dtype: str, *,
                 shard_bytes: int, rank: int = 0, threads: int = 2) -> list[WeightShard] | None:
    """This rank's delta shards of `pieces` against its own shards `base` of the previous full version;
    None when the buckets differ (another layout or dtype)."""
    torch_dtype = DTYPES[dtype]
    groups = buckets(pieces, shard_bytes, torch.empty(0, dtype=torch_dtype).element_size())
    if len(groups) != len(base):
        return None
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="reel-delta") as pool:
        try:
            return [s for s in pool.map(lambda gb: _delta_shard(blobs, gb[0], gb[1], torch_dtype, rank),
                                        zip(groups, base)) if s is not None]
        except (ValueError, KeyError, BlobError, ShardFormatError):
            return None


def delta_manifest(full: WeightManifest, base_version: int, shards: list[WeightShard]) -> WeightManifest | None:
    """The delta version of `full` made of `shards`; None when it would not be smaller than `full`."""
    if sum(s.blob.nbytes for s in shards) >= sum(s.blob.nbytes for s in full.shards):
        return None
    return WeightManifest(version=full.version, step=full.step, dtype=full.dtype, shards=shards,
                          base_version=base_version, full_shards=full.shards, hash=WRITE_HASH)


def publish_delta(blobs: BlobBackend, tensors: Iterable[tuple[str, torch.Tensor]], base: WeightManifest,
                  full: WeightManifest, *, shard_bytes: int, rank: int = 0,
                  threads: int = 2) -> tuple[BlobRef, WeightManifest] | None:
    """The delta of `full` (just written by this one process, its tensors given again) against the full
    version `base`; None when the layouts differ or the delta would not be smaller."""
    if base.dtype != full.dtype:
        return None
    shards = delta_shards(blobs, (Piece(name, t, None) for name, t in tensors), base.full_shards or base.shards,
                          full.dtype, shard_bytes=shard_bytes, rank=rank, threads=threads)
    manifest = None if shards is None else delta_manifest(full, base.version, shards)
    return None if manifest is None else (blobs.put(encode_manifest(manifest)), manifest)


def verify_delta(blobs: BlobBackend, manifest: WeightManifest, shapes: dict[str, torch.Size]) -> None:
    """Every delta shard hashes to its ref; its entries name tensors of `shapes` and fit them."""
    dtype = DTYPES.get(manifest.dtype)
    for shard in manifest.shards:
        where = f"version {manifest.version} delta shard {shard.blob.sha256[:12]}"
        with verified_map(blobs, manifest.hash, shard, where) as data:
            entries = {entry.name: entry for entry in read_header(data)}
            for name, rows in shard_rows(shard).items():
                shape = _piece_shape(where, name, rows, shapes)
                _check_entry(where, name, entries, shape, dtype)
                if name + INDEX in entries:
                    index = tensor_at(data, entries[name + INDEX])
                    if index.numel() and not 0 <= int(index.min()) <= int(index.max()) < shape.numel():
                        raise WeightLoadError(f"{where} indexes past the end of {name}")
                    del index


def _piece_shape(where: str, name: str, rows: Rows | None, shapes: dict[str, torch.Size]) -> torch.Size:
    """The shape of the rows of `name` a delta shard changes (the model's shape where it is whole)."""
    if name not in shapes:
        raise WeightLoadError(f"{where} changes {name}, which the model does not have")
    shape = shapes[name]
    if rows is None:
        return shape
    start, stop, total = rows
    if not (shape and total == shape[0] and 0 <= start < stop <= total):
        raise WeightLoadError(f"{where}: rows {start}..{stop} of {total} do not fit {name} {tuple(shape)}")
    return torch.Size((stop - start, *shape[1:]))


def _check_entry(where: str, name: str, entries: dict, shape: torch.Size, dtype: torch.dtype | None) -> None:
    whole = entries.get(name)
    if whole is not None:
        if whole.shape != shape or whole.dtype != dtype:
            raise WeightLoadError(f"{where}: {name} is {whole.dtype} {tuple(whole.shape)}, not the model's shape")
        return
    index, value = entries.get(name + INDEX), entries.get(name + VALUE)
    if index is None or value is None or index.dtype != torch.int32 or value.dtype != dtype \
            or index.shape != value.shape or len(index.shape) != 1:
        raise WeightLoadError(f"{where} has no well-formed index and value for {name}")


def full_of(manifest: WeightManifest) -> WeightManifest:
    """The full version a delta carries, as a manifest of its own."""
    return WeightManifest(version=manifest.version, step=manifest.step, dtype=manifest.dtype,
                          shards=manifest.full_shards, hash=manifest.hash)


def apply_delta(blobs: BlobBackend, manifest: WeightManifest, hub: dict[str, torch.Tensor]) -> list[str]:
    """Applies a verified delta to `hub` (the held base version, Hub name -> live tensor); returns the
    shards whose result does not match (empty: the version is in place; else load `full_of` it)."""
    dtype = DTYPES[manifest.dtype]
    wrong = []
    for shard in manifest.shards:
        targets = {name: hub[name] if rows is None else hub[name][rows[0]:rows[1]]
                   for name, rows in shard_rows(shard).items()}
        with blobs.mapped(shard.blob) as data:
            entries = {entry.name: entry for entry in read_header(data)}
            for name, target in targets.items():
                _apply(data, entries, name, target)
        if _result_sha256(t.to(dtype) for t in targets.values()) != shard.result_sha256:
            wrong.append(shard.blob.sha256[:12])
    return wrong


def _apply(data: memoryview, entries: dict, name: str, target: torch.Tensor) -> None:
    """One tensor's change from a delta shard (its map and header entries) written into `target`."""
    if name in entries:
        target.copy_(tensor_at(data, entries[name]))
        return
    target.view(-1).index_copy_(0, tensor_at(data, entries[name + INDEX]).long(),
                                tensor_at(data, entries[name + VALUE]).to(target.dtype))


def base_shards(base: WeightManifest, names: set[str]) -> list[WeightShard]:
    """The shards of the full version `base` that hold any of `names`."""
    return [shard for shard in base.shards if not names.isdisjoint(shard.tensors)]


@contextmanager
def rebuilt_version(blobs: BlobBackend, delta: WeightManifest, base: WeightManifest,
                    needed: set[str]) -> Iterator[Iterator[tuple[str, torch.Tensor]]]:
    """The `needed` tensors of `delta`'s version, in `base`'s order, rebuilt on `base` (the full version
    the reader holds): a tensor the delta changes is the base's, copied, with the change applied; any
    other is a view of its base shard's map (a reader that slices it reads only its slice).

    Checked before anything is yielded, so a failing delta changes nothing: the base shards holding
    `needed` and every delta shard hash to their refs, the delta's entries fit the base's tensors, and
    each delta shard's tensors, rebuilt, hash to its `result_sha256`. Any failure is a WeightLoadError
    (the reader then loads the version's full shards). The maps stay open while the context is.
    """
    if any(shard.rows for shard in (*base.shards, *delta.shards)):  # tensors split by rows over ranks' shards
        raise WeightLoadError(f"version {delta.version}: a version in pieces is not rebuilt from a delta here")
    touched = {name for shard in delta.shards for name in shard.tensors}
    shards = base_shards(base, needed | touched)
    verify_version(blobs, WeightManifest(version=base.version, step=base.step, dtype=base.dtype, shards=shards,
                                         hash=base.hash), None)
    with ExitStack() as stack:
        old = {}  # name -> a view of the base version's tensor
        for shard in shards:
            data = stack.enter_context(blobs.mapped(shard.blob))
            old |= {entry.name: tensor_at(data, entry) for entry in read_header(data)}
        verify_delta(blobs, delta, {name: t.shape for name, t in old.items()})
        changes = {}  # name -> (its delta shard's map, that shard's header entries)
        for shard in delta.shards:
            data = stack.enter_context(blobs.mapped(shard.blob))
            entries = {entry.name: entry for entry in read_header(data)}
            changes |= {name: (data, entries) for name in shard.tensors}

        def new(name: str) -> torch.Tensor:
            target = old[name].clone()
            _apply(*changes[name], name, target)
            return target

        wrong = [s.blob.sha256[:12] for s in delta.shards if _result_sha256(map(new, s.tensors)) != s.result_sha256]
        if wrong:
            raise WeightLoadError(f"version {delta.version}: delta shards {wrong} do not rebuild it on the held "
                                  f"version {base.version}")
        yield ((name, new(name) if name in touched else t) for name, t in old.items() if name in needed)
