"""Versions written by N trainer ranks: tensors split by rows into pieces (WeightShard.rows), checked to
tile each tensor once, and read back bitwise by every reader (the built-in engine, vLLM's stream, the
one-blob readers, deltas). The pieces are cut here the way FSDP2 cuts a model on N ranks (dim 0 of each
parameter, uneven and empty chunks included); tests/runtime/train/test_fsdp.py has the real ranks."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load as st_load

from reel.bus.blob_backends.file import BlobStore
from reel.bus.weight_manifest import WeightManifest, WeightShard, decode_manifest, encode_manifest
from reel.producers.builtin_engine import BuiltinEngine
from reel.runtime.model.model import MoEModel
from reel.runtime.weights.shard_hash import WRITE_HASH
from reel.runtime.weights.delta import delta_manifest, delta_shards
from reel.runtime.weights.load import WeightLoadError, stream_version, verify_version, version_bytes
from reel.runtime.weights.publish import Piece, local_pieces, put_shard, write_pieces
from weight_setup import SMALL, serving, swapped_engine, trained, model, publish, tensors
from weight_setup import RANKS, rank_pieces, ranks_version


def shapes(m: MoEModel) -> dict[str, torch.Size]:
    return {name: t.shape for name, t in tensors(m)}


def test_one_process_pieces_are_whole_tensors() -> None:
    m = model(1)
    assert [(p.name, p.rows) for p in local_pieces(m, m.config)] == [(n, None) for n, _ in tensors(m)]


def test_pieces_tile_every_tensor_and_verify(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path)
    m = model(1)
    manifest = ranks_version(blobs, m, 1)
    assert {s.rank for s in manifest.shards} == set(range(RANKS))
    assert any(rows[:2] != (0, rows[2]) for s in manifest.shards for rows in s.rows)
    verify_version(blobs, manifest, shapes(m))
    verify_version(blobs, manifest, None)  # a vLLM worker: no model shapes, the pieces still tile
    old = decode_manifest(msgspec.msgpack.encode({"version": 1, "step": 1, "dtype": "float32", "shards": []}))
    assert old.shards == [] and WeightShard(blob=manifest.shards[0].blob, rank=0, tensors=[]).rows == []


def _without(manifest: WeightManifest, index: int) -> WeightManifest:
    return msgspec.structs.replace(manifest, shards=manifest.shards[:index] + manifest.shards[index + 1:])


def _split_shard(manifest: WeightManifest) -> int:
    return next(i for i, s in enumerate(manifest.shards) if any(r[:2] != (0, r[2]) for r in s.rows))


def test_verify_refuses_a_gap(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path)
    m = model(1)
    manifest = ranks_version(blobs, m, 1)
    for checked in (shapes(m), None):
        with pytest.raises(WeightLoadError, match=r"rows \d+\.\.\d+ of it are in no shard"):
            verify_version(blobs, _without(manifest, _split_shard(manifest)), checked)


def test_verify_refuses_an_overlap(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path)
    m = model(1)
    manifest = ranks_version(blobs, m, 1)
    name, t = "model.norm.weight", m.state_dict()["model.norm.weight"]
    again = write_pieces(blobs, [Piece(name, t[5:14], (5, 14, t.shape[0]))], "float32", shard_bytes=4096, rank=7)
    with pytest.raises(WeightLoadError, match=r"tensor model.norm.weight: rows \d+\.\.\d+ of it are in more than one"):
        verify_version(blobs, msgspec.structs.replace(manifest, shards=manifest.shards + again), shapes(m))


def test_verify_refuses_rows_out_of_range(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path)
    m = model(1)
    manifest = ranks_version(blobs, m, 1)
    t = m.state_dict()["model.norm.weight"]
    ref, digest = put_shard(blobs, [("model.norm.weight", t[:4])])
    bad = WeightShard(blob=ref, rank=0, tensors=["model.norm.weight"], rows=[(30, 34, 32)], digest=digest)
    for checked in (shapes(m), None):
        with pytest.raises(WeightLoadError, match=r"rows 30\.\.34 of 32 do not fit model.norm.weight"):
            verify_version(blobs, msgspec.structs.replace(manifest, shards=manifest.shards + [bad]), checked)
    wrong_total = msgspec.structs.replace(bad, rows=[(0, 4, 40)])
    with pytest.raises(WeightLoadError, match="do not fit"):
        verify_version(blobs, msgspec.structs.replace(manifest, shards=manifest.shards + [wrong_total]), shapes(m))


def test_a_stream_puts_split_tensors_together_bitwise(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path)
    m = model(1)
    manifest = ranks_version(blobs, m, 1)
    want = dict(tensors(m))
    seen = [(name, t) for name, t in stream_version(blobs, manifest)]
    assert sorted(name for name, _ in seen) == sorted(want)  # each tensor once, split or not
    for name, t in seen:
        assert t.shape == want[name].shape and torch.equal(t, want[name]), name
    whole = st_load(version_bytes(blobs, blobs.put(encode_manifest(manifest)), "manifest"))
    assert all(torch.equal(whole[name], t) for name, t in want.items())


def test_pieces_copy_into_the_engines_parameters_bitwise(tmp_path: Path) -> None:
    """Rows land in their range of each parameter: the bits of a one-process version."""
    config = msgspec.structs.replace(SMALL, mlp_only_layers=[1])
    blobs = BlobStore(tmp_path)
    source = model(1, config)
    engine = BuiltinEngine(model(2, config), max_batch=2, blobs=blobs, version=0)

    async def swap() -> list[int]:
        async with engine:
            await serving(engine)
            await engine.update_weights(ranks_version(blobs, source, 3), 3)
            return (await serving(engine))[0]
    tokens = asyncio.run(swap())
    whole = swapped_engine(blobs, publish(blobs, source, 3)[1], start=model(2, config))
    for name, value in whole.model.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], value), name
    assert tokens == asyncio.run(_fresh(source))


async def _fresh(m: MoEModel) -> list[int]:
    async with BuiltinEngine(m, max_batch=2) as engine:
        return (await serving(engine))[0]


def test_a_delta_of_pieces_applies_into_their_rows_bitwise(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Each rank's delta against its own shards of the previous version, applied into the row ranges."""
    blobs = BlobStore(tmp_path)
    v0 = model(3)
    v1 = trained(v0)
    full0 = ranks_version(blobs, v0, 0, "bfloat16")
    full1 = ranks_version(blobs, v1, 1, "bfloat16")
    deltas = [delta_shards(blobs, rank_pieces(v1, rank), [s for s in full0.shards if s.rank == rank], "bfloat16",
                           shard_bytes=4096, rank=rank) for rank in range(RANKS)]
    assert all(d is not None for d in deltas)
    delta = delta_manifest(full1, 0, [s for d in deltas for s in d or ()])
    assert delta is not None and any(s.rows for s in delta.shards)
    by_delta, by_full = swapped_engine(blobs, full0, delta), swapped_engine(blobs, full1)
    assert by_delta.version == by_full.version == 1
    for name, value in by_full.model.state_dict().items():
        assert torch.equal(by_delta.model.state_dict()[name], value), name
        assert torch.equal(value, v1.state_dict()[name].bfloat16().float()), name
    assert "did not reproduce" not in caplog.text  # applied, not replaced by the full shards


def test_the_engine_loads_every_tensor_split_by_rows_experts_included(tmp_path: Path) -> None:
    """Rows of any tensor, an expert's too, land in their rows of its parameter (the engine's kernels
    read the parameters, so there is no other layout to fill)."""
    blobs = BlobStore(tmp_path)
    source = model(1)
    halves = [[Piece(n, t[:1], (0, 1, t.shape[0])) for n, t in tensors(source)],
              [Piece(n, t[1:], (1, t.shape[0], t.shape[0])) for n, t in tensors(source)]]
    assert any(".experts." in p.name for p in halves[0])
    shards = [s for rank, pieces in enumerate(halves)
              for s in write_pieces(blobs, pieces, "float32", shard_bytes=4096, rank=rank)]
    manifest = WeightManifest(version=1, step=1, dtype="float32", shards=shards, hash=WRITE_HASH)
    engine = BuiltinEngine(model(2), max_batch=2, blobs=blobs, version=0)

    async def swap() -> list[int]:
        async with engine:
            await serving(engine)
            await engine.update_weights(manifest, 1)
            return (await serving(engine))[0]
    tokens = asyncio.run(swap())
    assert engine.version == 1
    for name, value in source.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], value), name
    assert tokens == asyncio.run(_fresh(source))


def test_verify_refuses_pieces_that_disagree_on_the_rows(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path)
    m = model(1)
    manifest = ranks_version(blobs, m, 1)
    i = _split_shard(manifest)
    shard = manifest.shards[i]
    k = next(j for j, r in enumerate(shard.rows) if r[:2] != (0, r[2]))
    start, stop, total = shard.rows[k]
    rows = [*shard.rows[:k], (start, stop, total + 1), *shard.rows[k + 1:]]
    bad = msgspec.structs.replace(manifest, shards=[*manifest.shards[:i], msgspec.structs.replace(shard, rows=rows),
                                                    *manifest.shards[i + 1:]])
    with pytest.raises(WeightLoadError, match="pieces disagree on its rows"):
        verify_version(blobs, bad, None)
