"""Loading a manifest version (bus/weight_manifest.py) shard by shard from the blob store.

    read     the manifest blob (verified by the store), then each shard as a map of its file
    verify   every shard's hash and header (names, shapes: every tensor the target needs, once; the
             pieces of a tensor split by rows tile its rows exactly once), shards in parallel, while
             the engine keeps serving the old version
    copy     each shard's tensors (or pieces, into their rows) straight from its map into the target,
             shards in parallel; the engine runs this between two decode steps, so the version goes
             live when the last shard is in

Why verify before any copy: a failing shard must leave the old version serving, and copying into the
live weights first would leave a mix; a staging copy would cost a second model in memory. Both
passes read the page cache through maps and release the pages they are done with (`release`), so
the extra memory is about one hash chunk or one tensor per thread.

    ReelError
     └── WeightLoadError   a shard missing, corrupted, outside the store, or not the tensors expected
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import msgspec
import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from reel.bus.blobs import BlobBackend, BlobError, BlobMissing
from reel.bus.errors import ReelError
from reel.bus.events import BlobRef
from reel.bus.weight_manifest import Rows, WeightManifest, WeightShard, decode_manifest, shard_rows
from reel.runtime.weights.shard_hash import HASHES, expected_digest, new_digest
from reel.runtime.weights.shards import ShardFormatError, read_header, tensor_at

__all__ = ["WeightLoadError", "VersionDeleted", "engine_weights", "read_manifest", "verified_map", "verify_version",
           "copy_version", "stream_version", "version_tensors", "version_bytes"]

Sink = Callable[[str, torch.Tensor, int], None]  # (Hub name, rows [start, start + len) of it, start)
_CHUNK = 8 << 20  # bytes hashed, or rows copied, between two releases of the map's pages


class WeightLoadError(ReelError):
    """A published version that cannot be loaded; the message names the version, shard and reason."""


class VersionDeleted(WeightLoadError, BlobMissing):
    """A version's manifest or shard is no longer in the store (retention deleted it: bus/retention.py);
    readers that can re-derive it (replay/versions.py) or do without it (the mismatch split) catch BlobMissing."""


def read_manifest(blobs: BlobBackend, ref: BlobRef) -> WeightManifest:
    try:
        return decode_manifest(blobs.get(ref))
    except BlobMissing as exc:
        raise VersionDeleted(f"weight manifest {ref.sha256}: {exc}") from exc
    except BlobError as exc:
        raise WeightLoadError(f"weight manifest {ref.sha256}: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise WeightLoadError(f"weight manifest {ref.sha256} is not a WeightManifest: {exc}") from exc


def engine_weights(blobs: BlobBackend, ref: BlobRef, fmt: str) -> BlobRef | WeightManifest:
    """What an engine's update_weights takes for a published version (WeightsPublished.weights and
    .format): the one blob, or the manifest of shards (read and checked here)."""
    return read_manifest(blobs, ref) if fmt == "manifest" else ref


def verify_version(blobs: BlobBackend, manifest: WeightManifest, shapes: Mapping[str, torch.Size] | None,
                   threads: int = 2) -> None:
    """Every shard hashes to its ref and the shards hold each tensor of `shapes` exactly once, whole or as
    pieces that tile its rows (`shapes` None: a reader that cannot name the model's tensors, such as a
    vLLM worker, checks hashes, headers and that each tensor's pieces tile the rows they name)."""
    if manifest.hash not in HASHES:
        raise WeightLoadError(f"version {manifest.version}: unknown shard hash {manifest.hash!r} "
                              f"(this reader knows {', '.join(HASHES)})")
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="reel-verify") as pool:
        found = [item for items in pool.map(lambda s: _verify_shard(blobs, manifest, s, shapes), manifest.shards)
                 for item in items]
    pieces: dict[str, list[Rows | None]] = {}
    for name, rows in found:
        pieces.setdefault(name, []).append(rows)
    for name, rows in pieces.items():
        _check_cover(manifest.version, name, rows)
    missing = sorted(set(shapes or ()) - set(pieces))
    if missing:
        raise WeightLoadError(f"version {manifest.version}: no shard holds {missing[0]}"
                              + (f" (and {len(missing) - 1} more tensors)" if len(missing) > 1 else ""))


def _check_cover(version: int, name: str, pieces: list[Rows | None]) -> None:
    """The pieces of `name` are either one whole tensor or row ranges that tile its rows exactly once."""
    if pieces == [None]:
        return
    ranges = sorted(p for p in pieces if p is not None)
    where = f"version {version}: tensor {name}"
    if len(ranges) != len(pieces):
        raise WeightLoadError(f"{where} is in more than one shard")
    totals = {total for _, _, total in ranges}
    if len(totals) > 1:
        raise WeightLoadError(f"{where}: its pieces disagree on its rows ({sorted(totals)})")
    end, total = 0, totals.pop()
    for start, stop, _ in ranges:
        if start != end:
            what = f"rows {end}..{start} of it are in no shard" if start > end else \
                f"rows {start}..{min(end, stop)} of it are in more than one shard"
            raise WeightLoadError(f"{where}: {what}")
        end = stop
    if end != total:
        raise WeightLoadError(f"{where}: rows {end}..{total} of it are in no shard")


def release(data: memoryview, start: int, end: int) -> None:
    """Drops the pages of data[start:end] from this process when `data` is a read-only file map: they
    stay in the page cache, and a later touch maps them in again. A loader that releases what it
    has hashed or copied stays resident at about one tensor (or one hash chunk) per thread, not one
    shard."""
    mapping = data.obj
    if isinstance(mapping, mmap.mmap) and end > start:
        first = start - start % mmap.PAGESIZE  # whole pages; a neighbour's bytes on a shared page refault
        mapping.madvise(mmap.MADV_DONTNEED, first, min(end, len(data)) - first)


@contextmanager
def verified_map(blobs: BlobBackend, algorithm: str, shard: WeightShard, where: str) -> Iterator[memoryview]:
    """The shard's map once its bytes hash to its digest under `algorithm` (the manifest's `hash`); a
    store or format error becomes a WeightLoadError that starts with `where`."""
    try:
        with blobs.mapped(shard.blob) as data:
            digest = new_digest(algorithm)
            for start in range(0, len(data), _CHUNK):
                digest.update(data[start:start + _CHUNK])
                release(data, start, start + _CHUNK)
            actual = digest.hexdigest()
            if actual != expected_digest(algorithm, shard):
                raise WeightLoadError(f"{where} is corrupted: its bytes hash to {algorithm} {actual}")
            yield data
    except BlobError as exc:
        raise WeightLoadError(f"{where}: {exc}") from exc
    except ShardFormatError as exc:
        raise WeightLoadError(f"{where} is not safetensors: {exc}") from exc


def _verify_shard(blobs: BlobBackend, manifest: WeightManifest, shard: WeightShard,
                  shapes: Mapping[str, torch.Size] | None) -> list[tuple[str, Rows | None]]:
    """(name, rows) of every entry of a shard whose bytes and header check out."""
    where = f"version {manifest.version} shard {shard.blob.sha256[:12]}"
    if shard.rows and len(shard.rows) != len(shard.tensors):
        raise WeightLoadError(f"{where} lists {len(shard.rows)} row ranges for {len(shard.tensors)} tensors")
    rows = shard_rows(shard)
    with verified_map(blobs, manifest.hash, shard, where) as data:
        found = []
        for entry in read_header(data):
            if entry.name not in rows:
                raise WeightLoadError(f"{where} holds other tensors than the manifest lists")
            piece = rows[entry.name]
            expected = None if shapes is None else shapes.get(entry.name)
            if shapes is not None and expected is None:
                raise WeightLoadError(f"{where} has tensor {entry.name}, which the model does not have")
            if piece is not None:
                start, stop, total = piece
                if not (0 <= start < stop <= total and (expected is None or (expected and expected[0] == total))):
                    raise WeightLoadError(f"{where}: rows {start}..{stop} of {total} do not fit {entry.name}"
                                          + ("" if expected is None else f" {tuple(expected)}"))
                expected = torch.Size((stop - start, *(entry.shape[1:] if expected is None else expected[1:])))
            if expected is not None and entry.shape != expected:
                raise WeightLoadError(f"{where}: {entry.name} has shape {tuple(entry.shape)}, the model "
                                      f"needs {tuple(expected)}")
            found.append((entry.name, piece))
    if sorted(name for name, _ in found) != sorted(shard.tensors):
        raise WeightLoadError(f"{where} holds other tensors than the manifest lists")
    return found


def copy_version(blobs: BlobBackend, manifest: WeightManifest, sink: Sink, threads: int = 2) -> None:
    """Hands every tensor of a verified version to `sink` as views of the shard's map, in blocks of
    rows of at most _CHUNK bytes (a row may be more), each released once the sink returns: copy each
    into its rows."""
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="reel-copy") as pool:
        list(pool.map(lambda s: _copy_shard(blobs, s, sink), manifest.shards))


def _copy_shard(blobs: BlobBackend, shard: WeightShard, sink: Sink) -> None:
    rows = shard_rows(shard)
    try:
        with blobs.mapped(shard.blob) as data:
            for entry in read_header(data):
                piece = rows[entry.name]
                for first, block, start, end in _row_blocks(tensor_at(data, entry), entry.start):
                    sink(entry.name, block, first + (0 if piece is None else piece[0]))
                    release(data, start, end)
    except (BlobError, ShardFormatError) as exc:
        raise WeightLoadError(f"shard {shard.blob.sha256[:12]} changed after it was verified: {exc}") from exc


def _row_blocks(t: torch.Tensor, offset: int) -> Iterator[tuple[int, torch.Tensor, int, int]]:
    """(first row, rows of t, their bytes' [start, end) in the map) in blocks of at most _CHUNK bytes
    (a row may be more); a scalar or an empty tensor whole. `offset`: where t starts in the map."""
    row_bytes = t[0].numel() * t.element_size() if t.dim() and len(t) else 0
    if not row_bytes:
        yield 0, t, offset, offset + t.numel() * t.element_size()
        return
    step = max(1, _CHUNK // row_bytes)
    for first in range(0, len(t), step):
        block = t[first:first + step]
        yield first, block, offset + first * row_bytes, offset + (first + len(block)) * row_bytes


def stream_version(blobs: BlobBackend, manifest: WeightManifest) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a verified version, shard by shard, as a view of the shard's map: nothing is
    read until the consumer touches it, so one that slices a tensor (a tensor-parallel rank) reads
    only the pages of its slice, and one shard's map is open at a time. A tensor split by rows over
    shards (N trainer ranks) is put together from its pieces when its first piece comes (vLLM's
    loaders take whole tensors): one such tensor in memory at a time."""
    split = _split(manifest)
    for shard in manifest.shards:
        rows = shard_rows(shard)
        with _mapped(blobs, shard) as data:
            for entry in read_header(data):
                if rows.get(entry.name) is None:
                    yield entry.name, tensor_at(data, entry)
                elif split[entry.name][0][0] is shard:  # its first piece: the whole tensor now
                    yield entry.name, _assembled(blobs, entry.name, split[entry.name])


def _split(manifest: WeightManifest) -> dict[str, list[tuple[WeightShard, Rows]]]:
    """Tensors split by rows -> their pieces (shard, rows), in shard order."""
    split: dict[str, list[tuple[WeightShard, Rows]]] = {}
    for shard in manifest.shards:
        for name, rows in shard_rows(shard).items():
            if rows is not None:
                split.setdefault(name, []).append((shard, rows))
    return split


def _assembled(blobs: BlobBackend, name: str, pieces: list[tuple[WeightShard, Rows]]) -> torch.Tensor:
    whole: torch.Tensor | None = None
    for shard, (start, stop, total) in pieces:
        with _mapped(blobs, shard) as data:
            entry = next(e for e in read_header(data) if e.name == name)
            if whole is None:
                whole = torch.empty((total, *entry.shape[1:]), dtype=entry.dtype)
            whole[start:stop].copy_(tensor_at(data, entry))
            release(data, entry.start, entry.start + entry.count * entry.dtype.itemsize)
    assert whole is not None
    return whole


@contextmanager
def _mapped(blobs: BlobBackend, shard: WeightShard) -> Iterator[memoryview]:
    try:
        with blobs.mapped(shard.blob) as data:
            yield data
    except (BlobError, ShardFormatError) as exc:
        raise WeightLoadError(f"shard {shard.blob.sha256[:12]} changed after it was verified: {exc}") from exc


def version_tensors(blobs: BlobBackend, manifest: WeightManifest) -> dict[str, torch.Tensor]:
    """A full version's tensors whole, in the manifest's dtype (pieces put together); each shard's hash is
    checked on read. Raises the store's BlobError or SafetensorError."""
    tensors: dict[str, torch.Tensor] = {}
    for shard in manifest.shards:
        rows = shard_rows(shard)
        for name, t in st_load(blobs.get(shard.blob)).items():
            piece = rows.get(name)
            if piece is None:
                tensors[name] = t
                continue
            start, stop, total = piece
            whole = tensors.setdefault(name, torch.empty((total, *t.shape[1:]), dtype=t.dtype))
            whole[start:stop] = t
    return tensors


def version_bytes(blobs: BlobBackend, ref: BlobRef, fmt: str) -> bytes:
    """A published version as one fp32 safetensors blob (`state_dict_bytes`' layout), for readers that
    hold the whole model in one process anyway (the mismatch split, a bench from a run's weights)."""
    if fmt == "safetensors":
        return blobs.get(ref)
    manifest = read_manifest(blobs, ref)
    try:
        tensors = version_tensors(blobs, manifest)
    except BlobMissing as exc:
        raise VersionDeleted(f"version {manifest.version}: {exc}") from exc
    except (BlobError, SafetensorError) as exc:
        raise WeightLoadError(f"version {manifest.version}: {exc}") from exc
    return st_save({name: t.float() for name, t in tensors.items()}, metadata={"format": "pt"})
