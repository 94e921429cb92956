"""Weight-version retention (bus/retention.py), `reel log gc`, and replay after it.

The run is built in-process by tests/support/runbuilder.py: 6 steps, checkpoints at 3 and 6, stale groups
sampled one version behind (so each step's mismatch split needs the version before its π_old).
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import orjson
import pytest
import torch

from reel.bus.blob_backends.file import BlobStore
from reel.bus.blobs import BlobMissing
from reel.bus.events import BlobRef, StepCommitted, StepTiming, WeightsPublished
from reel.bus.run_log import RunLog
from reel.bus.retention import Retention, RetentionPolicy
from reel.bus.weight_manifest import WeightManifest, WeightShard, encode_manifest
from reel.replay.analysis import Run, replay_range, replay_step
from reel.runtime.launch.cli import main as reel
from runbuilder import build_run

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("retention")
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        mp.setenv("REEL_CACHE", str(root / "cache"))
        warnings.filterwarnings("ignore", message="Converting a tensor with requires_grad", category=UserWarning)
        build_run(root / "built", {"run": {"steps": 6}, "trainer": {"checkpoint_every": 3, "max_off_policy_steps": 1}})
    # Moved, so no blob ref's own file:// path (the store where it was written) still exists.
    return (root / "built").rename(root / "run")


def _published(version: int, ref: BlobRef, fmt: str = "safetensors") -> WeightsPublished:
    return WeightsPublished(run="r", producer="trainer:0", seq=version, version=version, step=version, weights=ref,
                            format=fmt)


def test_the_window_follows_async_level_and_max_off_policy_steps():
    assert RetentionPolicy.of(async_level=1, max_off_policy_steps=4).window == 5
    assert RetentionPolicy.of(async_level=3, max_off_policy_steps=2).window == 4
    policy = RetentionPolicy.of(1, 2, keep_every=10)
    assert [v for v in range(31) if policy.keeps(v, newest=30)] == [0, 10, 20, 28, 29, 30]


def test_safetensors_versions_go_checkpoints_and_shared_blobs_stay(tmp_path):
    store = BlobStore(tmp_path / "blobs")
    refs = [store.put(f"weights {v}".encode()) for v in range(6)]
    ckpt = store.put(b"checkpoint of step 2")
    same_as_5 = store.put(b"weights 5")  # content addressing: version 6 shares version 5's bytes
    retention = Retention(RetentionPolicy(window=2), store)
    commit = StepCommitted(run="r", producer="trainer:0", seq=99, step=2, version=2, groups=[], dropped=[],
                           loss=0.0, grad_norm=0.0, weights_sha256=refs[2].sha256, timing=StepTiming(0.0, 0.0, 0.0),
                           checkpoint=ckpt)
    retention.add([_published(v, r) for v, r in enumerate(refs)] + [commit])
    assert [v.version for v in retention.doomed()] == [0, 1, 2, 3]
    deleted, freed = retention.collect()
    assert deleted == [0, 1, 2, 3] and freed == sum(r.nbytes for r in refs[:4])
    assert set(store.keys()) == {refs[4].sha256, refs[5].sha256, ckpt.sha256}
    with pytest.raises(BlobMissing):
        store.get(refs[0])
    retention.add([_published(6, same_as_5)])
    assert retention.collect() == ([4], refs[4].nbytes)
    assert store.get(same_as_5) == b"weights 5"
    assert store.delete(refs[0]) == 0  # idempotent


def test_a_kept_delta_keeps_its_base_and_a_version_goes_with_its_shards(tmp_path):
    store = BlobStore(tmp_path / "blobs")
    manifests, shards = {}, {}
    for v in range(5):
        shards[v] = [store.put(f"v{v} shard {i}".encode()) for i in range(2)]
        base = -1 if v in (0, 2) else v - 1 if v != 4 else 2  # 4 is a delta against 2, 3 against 2, 1 against 0
        parts = [WeightShard(blob=s, rank=i, tensors=[f"t{i}"]) for i, s in enumerate(shards[v])]
        manifest = WeightManifest(version=v, step=v, dtype="float32", base_version=base, shards=parts)
        manifests[v] = store.put(encode_manifest(manifest))
    retention = Retention(RetentionPolicy(window=1), store)
    retention.add([_published(v, ref, "manifest") for v, ref in manifests.items()])
    assert [v.version for v in retention.doomed()] == [0, 1, 3]  # 4 needs 2
    retention.collect()
    left = set(store.keys())
    for v in (2, 4):
        assert {manifests[v].sha256, *(s.sha256 for s in shards[v])} <= left
    for v in (0, 1, 3):
        assert manifests[v].sha256 not in left and not {s.sha256 for s in shards[v]} & left
    # A second pass over the same log (reel log gc again) finds the deleted manifests gone and deletes nothing.
    again = Retention(RetentionPolicy(window=1), store)
    again.add([_published(v, ref, "manifest") for v, ref in manifests.items()])
    assert again.collect()[1] == 0 and set(store.keys()) == left


def test_every_step_replays_bitwise_after_gc(built, tmp_path, capsys):
    before = {step: replay_step(Run(built), step)[0] for step in (4, 5)}
    run_dir = tmp_path / "run"
    shutil.copytree(built, run_dir)
    assert reel(["log", "gc", "--run", str(run_dir), "--dry-run"]) == 0
    assert "would delete 5 weight versions (0..4)" in capsys.readouterr().out
    assert len(BlobStore(run_dir / "blobs").keys()) == len(BlobStore(built / "blobs").keys())
    assert reel(["log", "gc", "--run", str(run_dir)]) == 0
    assert "deleted 5 weight versions (0..4)" in capsys.readouterr().out
    run = Run(run_dir)
    assert run.blobs.keys().keys() & {run.weights.refs[v].sha256 for v in range(5)} == set()
    # 1..3 start from init/, 4 just after the checkpoint of step 3, 5 and 6 just before and at the next one.
    for step in range(1, 7):
        report, _ = replay_step(run, step)
        assert report.bitwise, (step, report.mismatch)
        if step in before:  # the split needs version step-2, re-derived now: the same figures
            assert report.kl_numerics == before[step].kl_numerics and report.kl_numerics is not None
            assert report.kl_drift == before[step].kl_drift
    # Step 5: 4 and 5 from the checkpoint of step 3 (version 3, for the split, is that checkpoint).
    assert replay_step(Run(run_dir), 5)[0].reexecuted_steps == 2
    # Step 4: itself from the checkpoint of step 3, and 1..2 from init/ to re-derive version 2.
    assert replay_step(Run(run_dir), 4)[0].reexecuted_steps == 1 + 2
    rows = replay_range(Run(run_dir), 2, 6, recompute=True)
    assert all(row.recomputed.bitwise for row in rows)


def test_a_missing_checkpoint_names_the_file_and_the_nearest_usable_one(built, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(built, run_dir)
    with RunLog(run_dir, readonly=True) as run_log:
        checkpoints = {e.step: e.checkpoint for _, e in run_log.events("steps")
                       if isinstance(e, StepCommitted) and e.checkpoint is not None}
    store = BlobStore(run_dir / "blobs")
    store.path(checkpoints[6]).unlink()
    assert reel(["replay", "step", "6", "--run", str(run_dir)]) == 0  # it starts from the checkpoint of step 3
    capsys.readouterr()
    assert reel(["log", "gc", "--run", str(run_dir)]) == 0
    store.path(checkpoints[3]).write_bytes(b"not a checkpoint")
    # Step 6 needs the checkpoint of step 3 for version 4 (gc deleted it): a corrupt file, named.
    assert reel(["replay", "step", "5", "--run", str(run_dir)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("reel: the checkpoint of step 3 cannot be read") and checkpoints[3].sha256 in err
    assert "nearest usable state is the initial policy (init/)" in err and "Traceback" not in err


def test_du_sees_the_versions_go(built, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(built, run_dir)
    assert reel(["log", "du", "--run", str(run_dir), "--json"]) == 0
    full = orjson.loads(capsys.readouterr().out)
    reel(["log", "gc", "--run", str(run_dir)])
    capsys.readouterr()
    assert reel(["log", "du", "--run", str(run_dir), "--json"]) == 0
    kept = orjson.loads(capsys.readouterr().out)
    assert (full["weight_versions_stored"], kept["weight_versions_stored"]) == (7, 2)
    assert kept["bytes"]["weight_versions"] * 7 == full["bytes"]["weight_versions"] * 2
    assert kept["bytes"]["checkpoints"] == full["bytes"]["checkpoints"] > 0
    assert kept["bytes"]["trajectories"] > 0 and kept["bytes"]["routing_traces"] > 0 and kept["trained_tokens"] > 0
    assert kept["routing_at_rest_ratio"] > 2  # zstd-packed in the log (bus/logcodec.py)
    qwen = kept["extrapolation"][0]
    assert qwen["shape"]["name"] == "Qwen3-30B-A3B" and qwen["basis"].startswith("calculation")
    assert qwen["weight_version_bytes"] == 61_000_000_000 and qwen["checkpoint_bytes"] == 366_000_000_000
    assert qwen["after_bytes"] < qwen["before_bytes"]
    assert reel(["log", "du", "--run", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "extrapolation (calculation" in out and "routing traces at rest: " in out
