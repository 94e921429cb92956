"""The Mooncake blob backend on this CPU over TCP: a real mooncake_master and holder process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from reel.bus.blob_backends.file import BlobStore
from reel.bus.blob_backends.mooncake import MooncakeBlobs
from reel.bus.blob_backends.mooncake_service import MooncakeService
from reel.bus.blobs import BlobError, BlobMissing
from reel.bus.events import BlobRef, WeightsPublished
from reel.bus.run_log import RunLog
from runbuilder import e2e_config
from reel.runtime.launch.cli import main


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory):
    with MooncakeService(tmp_path_factory.mktemp("mooncake"), segment_bytes=256 << 20) as service:
        yield service


def test_put_get_upsert_and_verify(store: MooncakeService, tmp_path: Path) -> None:
    blobs = MooncakeBlobs(store.address, retry_s=1.0)
    try:
        data = os.urandom(3 << 20)
        ref = blobs.put(data)
        assert ref.uri == f"mooncake://{ref.sha256}" and ref.nbytes == len(data)
        assert blobs.get(ref) == data
        assert blobs.put(data) == ref  # content-addressed: the same bytes, the same claim check
        # Mooncake's plain put keeps an existing key's bytes; Reel's put is an upsert.
        wrong = os.urandom(3 << 20)
        raw = blobs._store_or_connect()
        assert raw.upsert(ref.sha256, wrong) == 0
        with pytest.raises(BlobError, match="corrupted"):
            blobs.get(ref)
        assert blobs.put(data) == ref
        assert blobs.get(ref) == data
        with pytest.raises(BlobError, match="has 3 bytes"):  # a ref whose size disagrees
            raw.upsert(ref.sha256, b"abc")
            blobs.get(ref)
        missing = BlobRef(uri="mooncake://" + "0" * 64, sha256="0" * 64, nbytes=5)
        with pytest.raises(BlobError, match=f"get of blob {'0' * 64} failed for 1 s"):
            blobs.get(missing)
    finally:
        blobs.close()


def test_mapped_reads_into_one_writable_buffer_and_falls_back_to_the_run_copy(store: MooncakeService,
                                                                               tmp_path: Path) -> None:
    files = BlobStore(tmp_path / "blobs")
    blobs = MooncakeBlobs(store.address, fallback=files, retry_s=1.0)
    try:
        data = os.urandom((5 << 20) + 3)
        ref = blobs.put(data)
        with blobs.mapped(ref) as view:
            assert bytes(view) == data and not view.readonly  # tensors viewing a shard need it writable
        smaller = blobs.put(data[:100])  # stored under another key: a ref claiming 200 bytes of it
        with blobs.mapped(BlobRef(uri=smaller.uri, sha256=smaller.sha256, nbytes=200)) as view:
            assert bytes(view) == data[:100]  # what the store holds, for the loader's digest to refuse
        archived = files.put(b"only in the run directory")
        lost = BlobRef(uri="mooncake://" + archived.sha256, sha256=archived.sha256, nbytes=archived.nbytes)
        with blobs.mapped(lost) as view:
            assert bytes(view) == b"only in the run directory"
        with pytest.raises(BlobMissing, match="cannot be read"):
            with blobs.mapped(BlobRef(uri="mooncake://" + "2" * 64, sha256="2" * 64, nbytes=7)):
                pass
    finally:
        blobs.close()


def test_delete_removes_the_blob_from_the_store_and_the_run_copy(store: MooncakeService, tmp_path: Path) -> None:
    files = BlobStore(tmp_path / "blobs")
    blobs = MooncakeBlobs(store.address, fallback=files, retry_s=1.0)
    try:
        data = os.urandom(1 << 20)
        ref = blobs.put(data)
        files.put(data)  # the archiver's copy
        assert ref.sha256 in blobs.keys()
        assert blobs.delete(ref) == 2 * len(data)
        assert ref.sha256 not in blobs.keys()
        with pytest.raises(BlobMissing):
            blobs.get(ref)
        assert blobs.delete(ref) == 0  # idempotent
    finally:
        blobs.close()


_WRITER = """
import os, signal, sys
from reel.bus.blob_backends.mooncake import MooncakeAddress, MooncakeBlobs
blobs = MooncakeBlobs(MooncakeAddress(sys.argv[1], sys.argv[2]))
ref = blobs.put(bytes.fromhex(sys.argv[3]) * 100_000)
print(ref.uri, ref.sha256, ref.nbytes, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no close(): the writer crashes
"""


def test_a_reader_gets_blobs_of_a_writer_that_crashed(store: MooncakeService) -> None:
    writer = subprocess.run([sys.executable, "-c", _WRITER, store.address.master, store.address.metadata, "c0ffee"],
                            capture_output=True, text=True, timeout=60)
    assert writer.returncode == -signal.SIGKILL, writer.stderr[-2000:]
    uri, sha, nbytes = writer.stdout.split()
    reader = MooncakeBlobs(store.address)
    try:  # the holder owns the segment: the writer's crash takes nothing with it
        assert reader.get(BlobRef(uri, sha, int(nbytes))) == bytes.fromhex("c0ffee") * 100_000
    finally:
        reader.close()


def test_holder_restart_loses_the_store_not_the_run_dir_copy(tmp_path: Path, tmp_path_factory) -> None:
    with MooncakeService(tmp_path_factory.mktemp("mooncake-restart"), segment_bytes=64 << 20) as service:
        files = BlobStore(tmp_path / "blobs")
        blobs = MooncakeBlobs(service.address, fallback=files, retry_s=1.0)
        try:
            kept, lost = blobs.put(b"archived weights"), blobs.put(b"never archived")
            files.put(b"archived weights")  # what the archiver does for every blob an event names
            service.stop_holder()
            service.start_holder()
            assert blobs.get(kept) == b"archived weights"  # from the run dir
            with pytest.raises(BlobError, match=f"Mooncake store at {service.address.master}.*not found in"):
                blobs.get(lost)
            # The new holder takes writes once the master has dropped the old segment (client TTL):
            # a put retries across that window.
            writer = MooncakeBlobs(service.address)
            try:
                fresh = writer.put(b"after the restart")
                assert writer.get(fresh) == b"after the restart"
            finally:
                writer.close()
        finally:
            blobs.close()


@pytest.mark.slow
def test_a_run_with_weights_over_mooncake_replays_bitwise(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = e2e_config(tmp_path / "mooncake.toml", "mooncake", 3,
                        {"blobs": {"backend": "mooncake", "mooncake_segment_bytes": 256 << 20},
                         "log": {"keep_weights_every": 1}})  # every version kept: each archived copy is checked
    run_dir = tmp_path / "run"
    assert main(["run", str(config), "--out", str(run_dir), "--no-live"]) == 0
    with RunLog(run_dir, readonly=True) as log:
        weights = [e.weights for _, e in log.events("weights") if isinstance(e, WeightsPublished)]
    assert [ref.uri.split("://")[0] for ref in weights] == ["mooncake"] * 4
    files = BlobStore(run_dir / "blobs")
    assert all(files.get(ref) for ref in weights)  # the archiver copied every one into the run dir
    assert not (run_dir / "mooncake.json").exists()  # the store was stopped with the run
    capsys.readouterr()
    for step in (1, 3):  # replay reads the run dir only: no store is running now
        assert main(["replay", "step", str(step), "--run", str(run_dir), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["bitwise"] is True


def test_a_manifest_version_loads_from_mooncake_one_object_per_shard(store: MooncakeService, tmp_path: Path) -> None:
    import asyncio

    import torch

    from reel.producers.builtin_engine import BuiltinEngine
    from reel.runtime.model.weights import hub_tensors
    from reel.runtime.weights.load import WeightLoadError
    from reel.runtime.weights.publish import publish_version
    from weight_setup import model

    blobs = MooncakeBlobs(store.address, fallback=BlobStore(tmp_path / "blobs"), retry_s=1.0)
    try:
        source = model(1)
        _, manifest = publish_version(blobs, hub_tensors(source.state_dict(), source.config), version=1, step=1,
                                      shard_bytes=4096)
        assert len(manifest.shards) > 3 and all(s.blob.uri == f"mooncake://{s.blob.sha256}" for s in manifest.shards)
        engine = BuiltinEngine(model(2), max_batch=2, blobs=blobs, version=0)
        lost = type(manifest)(version=2, step=2, dtype=manifest.dtype, shards=[*manifest.shards[:-1], type(
            manifest.shards[-1])(blob=BlobRef(uri="mooncake://" + "1" * 64, sha256="1" * 64, nbytes=10), rank=0,
                                 tensors=manifest.shards[-1].tensors)])

        async def swap() -> None:
            async with engine:
                await engine.update_weights(manifest, 1)
                with pytest.raises(WeightLoadError, match="cannot be read"):
                    await engine.update_weights(lost, 2)
        asyncio.run(swap())
        assert engine.version == 1
        assert all(torch.equal(engine.model.state_dict()[n], t) for n, t in source.state_dict().items())
    finally:
        blobs.close()
