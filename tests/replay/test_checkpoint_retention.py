"""Checkpoint retention (bus/retention.py, log.keep_checkpoints): what stays replayable, what says why
not, what `reel log verify` and `reel log du` make of it.

The run is built in-process by tests/support/runbuilder.py: 6 steps, checkpoints at 2, 4 and 6, with
log.keep_checkpoints = 1 and log.keep_checkpoints_every = 4, so `reel log gc` prunes step 2's only.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import orjson
import pytest
import torch

from reel.bus.blob_backends.file import BlobStore
from reel.bus.events import BlobRef, CheckpointsPruned, StepCommitted, StepTiming
from reel.bus.run_log import RunLog
from reel.bus.retention import CheckpointPolicy, Retention, RetentionPolicy
from reel.runtime.launch.cli import main as reel
from runbuilder import build_run

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ckpt_retention")
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        mp.setenv("REEL_CACHE", str(root / "cache"))
        warnings.filterwarnings("ignore", message="Converting a tensor with requires_grad", category=UserWarning)
        build_run(root / "built", {"run": {"steps": 6}, "trainer": {"checkpoint_every": 2, "max_off_policy_steps": 1},
                                   "log": {"keep_checkpoints": 1, "keep_checkpoints_every": 4}})
    return (root / "built").rename(root / "run")


def _commit(step: int, checkpoint: BlobRef | None) -> StepCommitted:
    return StepCommitted(run="r", producer="trainer:0", seq=step, step=step, version=step, groups=[], dropped=[],
                         loss=0.0, grad_norm=0.0, weights_sha256="0" * 64, timing=StepTiming(0.0, 0.0, 0.0),
                         checkpoint=checkpoint)


def test_the_policy_keeps_the_newest_and_every_mth_and_deletes_only_what_an_event_names(tmp_path):
    assert CheckpointPolicy().kept([2, 4, 6]) == {2, 4, 6}  # 0: every checkpoint, as before the policy
    assert CheckpointPolicy(keep_last=2, keep_every=8).kept(range(2, 21, 2)) == {8, 16, 18, 20}
    store = BlobStore(tmp_path / "blobs")
    refs = {step: store.put(f"checkpoint of step {step}".encode()) for step in (2, 4, 6, 8)}
    retention = Retention(RetentionPolicy(window=1), store, CheckpointPolicy(keep_last=2))
    retention.add([_commit(step, ref) for step, ref in refs.items()] + [_commit(9, None)])
    assert retention.doomed_checkpoints() == [2, 4]
    retention.collect()  # nothing announced yet: nothing deleted
    assert all(store.path(ref).exists() for ref in refs.values())
    retention.add([CheckpointsPruned(run="r", producer="trainer:0", seq=10, steps=[2, 4], after_step=9, keep_last=2)])
    assert retention.doomed_checkpoints() == []
    _, freed = retention.collect()
    assert freed == sum(ref.nbytes for step, ref in refs.items() if step in (2, 4))
    assert [step for step, ref in refs.items() if store.path(ref).exists()] == [6, 8]
    retention.add([_commit(10, store.put(b"checkpoint of step 10"))])
    assert retention.doomed_checkpoints() == [6]  # the newest two are 8 and 10; the newest is never doomed


def test_after_pruning_later_steps_replay_earlier_ones_say_why_and_verify_passes(built, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(built, run_dir)
    assert reel(["log", "du", "--run", str(run_dir), "--json"]) == 0
    full = orjson.loads(capsys.readouterr().out)
    assert reel(["log", "gc", "--run", str(run_dir), "--dry-run"]) == 0
    assert "and 1 checkpoints (2)" in capsys.readouterr().out
    assert reel(["log", "gc", "--run", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "and 1 checkpoints (2)" in out and "steps after 4 (the oldest checkpoint kept) replay bit for bit" in out
    with RunLog(run_dir, readonly=True) as run_log:
        checkpoints = {e.step: e.checkpoint for _, e in run_log.events("steps")
                       if isinstance(e, StepCommitted) and e.checkpoint is not None}
        (pruned,) = [e for _, e in run_log.events("control") if isinstance(e, CheckpointsPruned)]
    assert (pruned.steps, pruned.after_step, pruned.keep_last, pruned.keep_every) == ([2], 6, 1, 4)
    store = BlobStore(run_dir / "blobs")
    assert [step for step, ref in checkpoints.items() if store.path(ref).exists()] == [4, 6]

    assert reel(["log", "verify", "--run", str(run_dir)]) == 0  # a pruned checkpoint is not damage
    assert "the checkpoints of steps 2 were deleted by retention (CheckpointsPruned)" in capsys.readouterr().out
    for step in (1, 2, 5, 6):  # 1, 2: from init/ (no checkpoint before them); 5, 6: from step 4's
        assert reel(["replay", "step", str(step), "--run", str(run_dir), "--json"]) == 0, step
        assert orjson.loads(capsys.readouterr().out)["bitwise"] is True
    for step in (3, 4):
        assert reel(["replay", "step", str(step), "--run", str(run_dir)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"reel: step {step} is no longer replayable bit for bit: it needs the checkpoint of "
                              f"step 2"), err
        assert "log.keep_checkpoints = 1, log.keep_checkpoints_every = 4" in err
        assert "steps after 4 (the oldest checkpoint kept) still replay" in err and "reel retrain" in err
        assert "Traceback" not in err

    assert reel(["log", "du", "--run", str(run_dir), "--json"]) == 0
    pruned_du = orjson.loads(capsys.readouterr().out)
    assert (full["checkpoints_pruned"], pruned_du["checkpoints_pruned"], pruned_du["checkpoints"]) == (0, 1, 3)
    assert pruned_du["checkpoint_bytes_pruned"] == checkpoints[2].nbytes
    assert pruned_du["bytes"]["checkpoints"] == full["bytes"]["checkpoints"] - checkpoints[2].nbytes
    qwen = pruned_du["extrapolation"][0]  # 1,000 steps, a checkpoint every 2: the newest and every 4th kept
    assert (qwen["checkpoints"], qwen["checkpoints_kept"]) == (500, 250)
    assert qwen["before_bytes"] - qwen["after_bytes"] >= 250 * qwen["checkpoint_bytes"]
    assert reel(["log", "du", "--run", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "2 of 3 checkpoints stored" in out and "deleted 1 checkpoints" in out and "250/500" in out

    store.path(checkpoints[4]).unlink()  # a kept checkpoint missing is still damage
    assert reel(["log", "verify", "--run", str(run_dir)]) != 0
    assert "tampered: the checkpoint of step 4" in capsys.readouterr().out
