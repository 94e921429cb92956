"""Sharded weight versions: the canonical hash streamed, shards written in place, loaded shard by shard
into the built-in engine, and a bad shard refused with the old version still serving."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import blake3
import msgspec
import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from reel.bus.blob_backends.file import BlobStore
from reel.bus.events import BlobRef, StepCommitted, StepTiming, WeightsPublished, decode, stream_key
from reel.bus.partitions import slot_key
from reel.bus.streams import DEAD, Publisher, connect
from reel.bus.blobs import BlobMissing
from reel.bus.weight_manifest import WeightManifest, WeightShard, blob_refs, encode_manifest
from reel.producers.builtin_engine import BuiltinEngine
from reel.producers.rollout import RolloutWorker
from reel.runtime.config import run as config_mod
from reel.runtime.config.run import load as load_config
from reel.runtime.train.distributed import LOCAL
from reel.runtime.launch import cli
from reel.runtime.model import state_dict_adapter
from reel.runtime.model.kvcache import prepared_weights
from reel.runtime.model.model import MoEModel
from reel.runtime.model.weights import state_dict_bytes
from reel.runtime.train.step import TrainState
from reel.runtime.train.trainer_group import TrainerGroup
from reel.runtime.weights.delta import publish_delta, rebuilt_version
from reel.runtime.weights.load import WeightLoadError, read_manifest, stream_version, verify_version, version_bytes
from reel.runtime.weights.publish import buckets
from reel.runtime.weights.shards import canonical_sha256, read_header, shard_parts
from rollout_setup import initial_model, make_run, stream_events, wait_for
from weight_setup import SMALL, model, publish, serving, swapped_engine, tensors, trained

torch.set_num_threads(2)


@pytest.mark.parametrize("tied", [False, True])
def test_canonical_hash_is_the_sha256_of_state_dict_bytes(tied: bool) -> None:
    m = model(0, msgspec.structs.replace(SMALL, tie_word_embeddings=tied))
    assert canonical_sha256(tensors(m)) == hashlib.sha256(state_dict_bytes(m)).hexdigest()


def test_shard_parts_are_what_the_safetensors_library_writes() -> None:
    mixed = [("b", torch.randn(3, 5)), ("a", torch.arange(4, dtype=torch.int64)), ("c", torch.randn(2).bfloat16()),
             ("empty", torch.zeros(0, 3))]
    written = b"".join(bytes(p) for p in shard_parts(mixed))
    assert written == st_save(dict(mixed), metadata={"format": "pt"})


def test_buckets_keep_model_order_and_split_at_the_size() -> None:
    items = [(str(i), torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 5])]
    groups = buckets(items, shard_bytes=80, itemsize=4)
    assert [[name for name, _ in g] for g in groups] == [["0", "1"], ["2"], ["3", "4"]]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_manifest_version_round_trips_into_the_engine(tmp_path: Path, dtype: str) -> None:
    blobs = BlobStore(tmp_path)
    source = model(1)
    ref, manifest = publish(blobs, source, 3, dtype=dtype)
    assert len(manifest.shards) > 3 and manifest.dtype == dtype and read_manifest(blobs, ref) == manifest
    assert {r.sha256 for r in blob_refs(ref, manifest)} == {p.name for p in tmp_path.glob("*/*")}
    engine = BuiltinEngine(model(2), max_batch=2, blobs=blobs, version=0)

    async def swap() -> None:
        async with engine:
            await engine.update_weights(manifest, 3)
    asyncio.run(swap())
    assert engine.version == 3
    cast = torch.float32 if dtype == "float32" else torch.bfloat16
    for name, value in source.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], value.to(cast).float()), name
    # Readers that want one blob (the mismatch split) get the same weights.
    whole = st_load(version_bytes(blobs, ref, "manifest"))
    assert all(torch.equal(whole[n], t.to(cast).float()) for n, t in tensors(source))


def test_shards_are_checked_against_their_blake3_and_sha256_manifests_still_load(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path)
    source = model(1)
    _, manifest = publish(blobs, source, 3)
    assert manifest.hash == "blake3"
    for shard in manifest.shards:  # the store keys by sha256; the manifest names the BLAKE3 of the same bytes
        data = blobs.path(shard.blob).read_bytes()
        assert (shard.blob.sha256, shard.digest) == (hashlib.sha256(data).hexdigest(), blake3.blake3(data).hexdigest())
    shapes = {n: t.shape for n, t in tensors(source)}
    # A digest that does not match the bytes is refused, though the store key does match them.
    forged = msgspec.structs.replace(manifest.shards[1], digest=blake3.blake3(b"other").hexdigest())
    with pytest.raises(WeightLoadError, match="is corrupted: its bytes hash to blake3"):
        verify_version(blobs, msgspec.structs.replace(manifest, shards=[manifest.shards[0], forged, *manifest.shards[2:]]),
                       shapes)
    # A manifest written before BLAKE3 (hash sha256, no digests) loads, checked against the store keys.
    old = msgspec.structs.replace(manifest, hash="sha256",
                                  shards=[msgspec.structs.replace(s, digest="") for s in manifest.shards])
    verify_version(blobs, old, shapes)
    engine = BuiltinEngine(model(2), max_batch=2, blobs=blobs, version=0)

    async def swap() -> None:
        async with engine:
            await engine.update_weights(old, 3)
    asyncio.run(swap())
    assert all(torch.equal(engine.model.state_dict()[n], v) for n, v in source.state_dict().items())
    _corrupt(blobs, old.shards[2].blob)
    with pytest.raises(WeightLoadError, match="is corrupted: its bytes hash to sha256"):
        verify_version(blobs, old, shapes)


@pytest.mark.parametrize(("precision", "tied"), [("fp32", False), ("fp32", True), ("bf16", False)])
def test_a_swap_writes_each_weight_once_into_the_matrices_the_engine_multiplies_by(tmp_path: Path, precision: str,
                                                                                    tied: bool) -> None:
    """In fp32 the engine's kernels read its parameters (one copy of the weights): a swap copies into
    them in place and nothing is rebuilt but small derived vectors; bf16 rebuilds its casts. Either
    way the engine then samples what a fresh engine on the new weights samples."""
    config = msgspec.structs.replace(SMALL, tie_word_embeddings=tied, mlp_only_layers=[1])
    blobs = BlobStore(tmp_path)
    _, manifest = publish(blobs, model(1, config), 3)
    served = MoEModel(config, precision)
    served.load_state_dict(model(2, config).state_dict())
    engine = BuiltinEngine(served, max_batch=2, blobs=blobs, version=0)
    params = {p.data_ptr() for p in served.parameters()}

    async def swap() -> list[int]:
        async with engine:
            await serving(engine)
            await engine.update_weights(manifest, 3)
            return (await serving(engine))[0]
    tokens = asyncio.run(swap())
    assert {p.data_ptr() for p in served.parameters()} == params  # copied into, not replaced
    matrices = {t.data_ptr() for t in _matrices(prepared_weights(served, engine.max_seq_len))}
    assert matrices <= params if precision == "fp32" else not matrices & params
    fresh = MoEModel(config, precision)
    fresh.load_state_dict(model(1, config).state_dict())
    assert tokens == asyncio.run(_fresh_tokens(fresh))


def _matrices(w) -> list[torch.Tensor]:
    """The prepared weights' matrices (what a swap would otherwise write a second time)."""
    out = [w.lm_head_VH]
    for layer in w.layers:
        out += [t for t in (layer.q_QH, layer.k_GH, layer.v_GH, layer.o_HQ, layer.router_EH, layer.gate_EIH,
                            layer.up_EIH, layer.down_EHI) if t is not None]
    return out


async def _fresh_tokens(m: MoEModel) -> list[int]:
    async with BuiltinEngine(m, max_batch=2) as engine:
        return (await serving(engine))[0]


def test_a_streamed_version_is_views_of_each_shards_map_one_shard_at_a_time(tmp_path: Path) -> None:
    """What a vLLM worker feeds `load_weights`: no tensor is a copy (a tensor-parallel rank that slices
    one reads only its slice's pages), and a shard's map is released before the next is opened."""
    blobs = BlobStore(tmp_path)
    source = model(1)
    _, manifest = publish(blobs, source, 3)
    want = dict(tensors(source))
    previous, seen = None, []
    for name, t in stream_version(blobs, manifest):
        shard = next(s for s in manifest.shards if name in s.tensors)
        if shard is not previous:  # a new shard: one map, whose tensors lie at their header offsets
            base, previous = t.data_ptr() - _offset(blobs, shard, name), shard
        assert t.data_ptr() - base == _offset(blobs, shard, name), name  # a view, not a copy
        assert torch.equal(t, want[name])
        assert _mapped_files(tmp_path) == {str(blobs.path(shard.blob))}
        seen.append(name)
    assert sorted(seen) == sorted(want)


def _mapped_files(root: Path) -> set[str]:
    """Files under `root` this process has mapped (/proc/self/maps)."""
    lines = Path("/proc/self/maps").read_text().splitlines()
    return {line.split(maxsplit=5)[-1] for line in lines if str(root) in line}


def _offset(blobs: BlobStore, shard: WeightShard, name: str) -> int:
    with blobs.mapped(shard.blob) as data:
        return next(e.start for e in read_header(data) if e.name == name)


def _corrupt(blobs: BlobStore, shard: BlobRef) -> None:
    path = blobs.path(shard)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def _remove(blobs: BlobStore, shard: BlobRef) -> None:
    blobs.path(shard).unlink()


def _elsewhere(manifest: WeightManifest, tmp_path: Path) -> WeightManifest:
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(b"x")
    shard = manifest.shards[1]
    moved = BlobRef(uri=outside.as_uri(), sha256=shard.blob.sha256, nbytes=shard.blob.nbytes)
    shards = [*manifest.shards[:1], msgspec.structs.replace(shard, blob=moved), *manifest.shards[2:]]
    return msgspec.structs.replace(manifest, shards=shards)


@pytest.mark.parametrize("damage, reason", [("corrupt", "is corrupted"), ("missing", "not found"),
                                            ("outside", "outside the blob store")])
def test_a_bad_shard_leaves_the_old_version_serving(tmp_path: Path, damage: str, reason: str) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    engine = BuiltinEngine(model(0), max_batch=2, blobs=blobs, version=0)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    _, manifest = publish(blobs, model(5), 1)
    if damage == "corrupt":
        _corrupt(blobs, manifest.shards[1].blob)
    elif damage == "missing":
        _remove(blobs, manifest.shards[1].blob)
    else:
        manifest = _elsewhere(manifest, tmp_path)

    async def swap() -> None:
        async with engine:
            tokens, _ = await serving(engine)
            with pytest.raises(WeightLoadError, match=reason):
                await engine.update_weights(manifest, 1)
            assert await serving(engine) == (tokens, [(0, 0)])  # still serving, the old version
    asyncio.run(swap())
    assert engine.version == 0
    assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in before.items())


def test_a_shard_with_tensors_the_model_lacks_is_refused(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path)
    _, manifest = publish(blobs, model(0), 1)
    shapes = {n: t.shape for n, t in state_dict_adapter.to_hf(model(0).state_dict(), SMALL).items()}
    verify_version(blobs, manifest, shapes)
    with pytest.raises(WeightLoadError, match="no shard holds"):
        verify_version(blobs, manifest, {**shapes, "model.extra.weight": torch.Size([2])})
    wrong = {**shapes, "model.norm.weight": torch.Size([3])}
    with pytest.raises(WeightLoadError, match="model.norm.weight has shape"):
        verify_version(blobs, manifest, wrong)
    bogus = WeightManifest(version=1, step=1, dtype="float32", shards=manifest.shards, hash="md5")
    with pytest.raises(WeightLoadError, match="unknown shard hash"):
        verify_version(blobs, bogus, shapes)


async def _publish_manifest(url: str, run_dir: Path, version: int, m: MoEModel, damage: bool = False) -> None:
    blobs = BlobStore(run_dir / "blobs")
    ref, manifest = publish(blobs, m, version, shard_bytes=64 << 10)
    if damage:
        _corrupt(blobs, manifest.shards[-1].blob)
    redis = connect(url)
    try:
        trainer = Publisher(redis, run_dir.name, "trainer:0", next_seq=10 * version)
        await trainer.publish([
            trainer.stamp(WeightsPublished, version=version, step=version, weights=ref, format="manifest"),
            trainer.stamp(StepCommitted, step=version, version=version, groups=[], dropped=[], loss=0.0, grad_norm=0.0,
                          weights_sha256="", timing=StepTiming(0, 0, 0))])
    finally:
        await redis.aclose()


async def _wait(condition, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.05)


async def test_the_worker_dead_letters_a_version_it_cannot_load_and_goes_on(redis_url: str, run_name: str,
                                                                            tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, run_name, async_level=0)
    worker = RolloutWorker(run_dir, redis_url, 0, load_config(run_dir / "config.toml"))
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    first = initial_model(run_dir)
    await _publish_manifest(redis_url, run_dir, 0, first)
    await wait_for(redis_url, run_name, 2)
    await _publish_manifest(redis_url, run_dir, 1, model(7, first.config), damage=True)
    await _wait(lambda: worker.refused == 1)
    assert worker.engine.version == 0
    await wait_for(redis_url, run_name, 4)  # the run goes on: round 1 sampled under version 0
    await _publish_manifest(redis_url, run_dir, 2, model(8, first.config))
    await _wait(lambda: worker.engine.version == 2)
    stop.set()
    await asyncio.wait_for(task, 30)

    redis = connect(redis_url)
    try:
        dead = await redis.xrange(slot_key(stream_key(run_name, "weights"), DEAD))
    finally:
        await redis.aclose()
    assert len(dead) == 1
    fields = dead[0][1]
    assert decode(fields[b"raw"]).version == 1 and fields[b"consumer"] == b"rollout:0"
    assert b"policy version 1 not loaded" in fields[b"reason"] and b"is corrupted" in fields[b"reason"]
    spans = [s.spans for g in await stream_events(redis_url, run_name, "trajectories") for s in g.samples]
    assert all(v != 1 for span in spans for _, v in span)


def _delta_versions(blobs: BlobStore) -> tuple[MoEModel, WeightManifest, BlobRef, WeightManifest, WeightManifest]:
    v0 = model(3)
    v1 = trained(v0)
    _, full0 = publish(blobs, v0, 0, dtype="bfloat16")
    _, full1 = publish(blobs, v1, 1, dtype="bfloat16")
    ref, delta = publish_delta(blobs, tensors(v1), full0, full1, shard_bytes=4096)
    return v1, full0, ref, delta, full1


def test_a_delta_swap_serves_the_bits_of_a_full_swap(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path)
    v1, full0, ref, delta, full1 = _delta_versions(blobs)
    assert delta.base_version == 0 and delta.full_shards == full1.shards
    delta_bytes = sum(s.blob.nbytes for s in delta.shards)
    assert 0 < delta_bytes < sum(s.blob.nbytes for s in full1.shards)
    assert {r.sha256 for r in blob_refs(ref, delta)} >= {s.blob.sha256 for s in full1.shards}
    by_delta = swapped_engine(blobs, full0, delta)
    by_full = swapped_engine(blobs, full1)
    assert by_delta.version == by_full.version == 1
    for name, value in by_full.model.state_dict().items():
        assert torch.equal(by_delta.model.state_dict()[name], value), name
        assert torch.equal(value, v1.state_dict()[name].bfloat16().float()), name


def _names(blobs: BlobStore, ref: BlobRef) -> list[str]:
    return list(st_load(blobs.get(ref)))


def test_a_worker_without_the_base_takes_the_full_shards(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path)
    _, _, _, delta, full1 = _delta_versions(blobs)
    skipped = swapped_engine(blobs, delta)  # holds no version 0
    # Holds "version 0" but other weights: the result check of the tensors the delta indexes catches it,
    # and the full shards are loaded.
    assert any(name.endswith("::index") for s in delta.shards for name in _names(blobs, s.blob))
    wrong_base = BuiltinEngine(model(11), max_batch=2, blobs=blobs, version=0)

    async def swap() -> None:
        async with wrong_base:
            await wrong_base.update_weights(delta, 1)
    asyncio.run(swap())
    reference = swapped_engine(blobs, full1).model.state_dict()
    for engine in (skipped, wrong_base):
        assert all(torch.equal(engine.model.state_dict()[n], v) for n, v in reference.items())


def test_a_corrupted_delta_leaves_the_base_serving(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path)
    _, full0, _, delta, _ = _delta_versions(blobs)
    engine = swapped_engine(blobs, full0)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    _corrupt(blobs, delta.shards[0].blob)
    engine = BuiltinEngine(engine.model, max_batch=2, blobs=blobs, version=0)

    async def swap() -> None:
        async with engine:
            with pytest.raises(WeightLoadError, match="delta shard .* is corrupted"):
                await engine.update_weights(delta, 1)
    asyncio.run(swap())
    assert engine.version == 0
    assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in before.items())


def test_a_delta_rebuilt_from_the_base_shards_is_the_full_version_bitwise(tmp_path: Path) -> None:
    """What a vLLM worker loads for a delta: the tensors it asks for, rebuilt on the base version's
    shards; a base that is not the delta's, or a corrupted delta, fails before any tensor is given."""
    blobs = BlobStore(tmp_path)
    _, full0, _, delta, full1 = _delta_versions(blobs)
    touched = {name for shard in delta.shards for name in shard.tensors}
    untouched = next(name for shard in full0.shards for name in shard.tensors if name not in touched)
    want = dict(stream_version(blobs, full1))
    with rebuilt_version(blobs, delta, full0, touched | {untouched}) as rebuilt:
        got = dict(rebuilt)
    assert set(got) == touched | {untouched}
    assert all(torch.equal(t, want[name]) for name, t in got.items())
    _, other = publish(blobs, model(11), 0, dtype="bfloat16")
    with pytest.raises(WeightLoadError, match="do not rebuild it on the held version 0"):
        with rebuilt_version(blobs, delta, other, touched):
            pass
    _corrupt(blobs, delta.shards[0].blob)
    with pytest.raises(WeightLoadError, match="delta shard .* is corrupted"):
        with rebuilt_version(blobs, delta, full0, touched):
            pass


def test_no_delta_where_it_would_not_be_smaller(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path)
    v0, v1 = model(3), model(3)
    with torch.no_grad():
        for p in v1.parameters():
            p.add_(0.05)  # every element moves by more than a bf16 step
    _, full0 = publish(blobs, v0, 0, dtype="bfloat16")
    _, full1 = publish(blobs, v1, 1, dtype="bfloat16")
    assert publish_delta(blobs, tensors(v1), full0, full1, shard_bytes=4096) is None


def test_bench_swap_quick_reports_every_phase(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("REEL_BENCH_NO_VLLM", "1")
    assert cli.main(["bench", "swap", "--quick"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    result = msgspec.json.decode(line)
    size = result["sizes"]["quick"]
    assert result["bench"] == "swap" and result["ratio"] == size["load"]["ratio"] > 0 and result["vllm"] is None
    assert result["hash"] == "blake3" and result["loader_ratio"] == size["load"]["loader_ratio"] > 0
    assert {"gather_s", "serialise_s", "key_sha256_s", "hash_s", "raw_write_fdatasync_s", "pipeline_s"} <= set(size["publish"])
    assert {"raw_read_s", "read_s", "verify_s", "copy_s", "loader_s", "update_s", "visible_s",
            "cold_raw_read_s", "cold_update_s"} <= set(size["load"]) and result["cold_ratio"] > 0
    assert size["publish"]["ratio"] > 0 and 0 <= size["delta"]["unchanged_share"] <= 1


def test_the_trainer_publishes_a_delta_where_it_is_smaller(tmp_path: Path) -> None:
    config = config_mod.loads('[trainer]\nweight_delta = true\nweight_shard_mb = 1\n')
    group = TrainerGroup(LOCAL, tmp_path, config)
    blobs = BlobStore(tmp_path / "blobs")
    m = model(3)
    ref0, fmt = group.publish(TrainState(m, None, 0), blobs)
    with torch.no_grad():
        m.model.norm.weight[:3] += 1.0  # a step that moved three elements
    ref1, _ = group.publish(TrainState(m, None, 1), blobs)
    full0, delta = read_manifest(blobs, ref0), read_manifest(blobs, ref1)
    assert fmt == "manifest" and full0.base_version == -1 and delta.base_version == 0
    assert delta.shards[0].tensors == ["model.norm.weight"] and len(delta.full_shards) == len(full0.shards)
    assert swapped_engine(blobs, full0, delta).model.state_dict()["model.norm.weight"].equal(m.model.norm.weight)
    ref2, _ = group.publish(TrainState(m, None, 5), blobs)  # not the next version: a full one
    assert read_manifest(blobs, ref2).base_version == -1


def test_a_version_retention_deleted_reads_as_missing_not_broken(tmp_path: Path) -> None:
    """Replay re-derives (and the mismatch split skips) a deleted version only if its loss is told
    apart from damage: a deleted manifest or shard is a BlobMissing, still a WeightLoadError."""
    blobs = BlobStore(tmp_path / "blobs")
    shard = blobs.put(st_save({"w": torch.ones(2)}))
    manifest = blobs.put(encode_manifest(WeightManifest(1, 1, "float32", [])))
    with_shard = blobs.put(encode_manifest(WeightManifest(2, 2, "float32", [WeightShard(shard, 0, ["w"])])))
    blobs.delete(manifest)
    blobs.delete(shard)
    for ref in (manifest, with_shard):
        with pytest.raises(BlobMissing) as caught:
            version_bytes(blobs, ref, "manifest")
        assert isinstance(caught.value, WeightLoadError)
