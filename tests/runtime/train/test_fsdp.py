"""The trainer on N ranks (FSDP2 on gloo): the same numbers as one process playing every rank,
and DCP checkpoints that reshard between world sizes exactly."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, load_file

import fsdp_peer
import msgspec
from reel.bus.blob_backends.file import BlobStore
from reel.bus.events import BlobRef
from reel.runtime.checkpoint import sharded as sharded_checkpoint
from reel.runtime.model.model import MoEModel
from reel.runtime.weights.delta import full_of
from reel.runtime.weights.load import read_manifest
from weight_setup import swapped_engine
from reel.runtime.train.distributed import LOCAL, World
from reel.runtime.model.weights import state_dict_bytes
from reel.runtime.train.step import train_step
from paths import SUPPORT

pytestmark = pytest.mark.slow
PEER = SUPPORT / "fsdp_peer.py"


def torchrun(*args: str, ranks: int = 2) -> None:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
            str(PEER), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_two_ranks_equal_one_process_accumulating_their_micro_batches(tmp_path: Path) -> None:
    torchrun("steps", str(tmp_path))
    torch.set_num_threads(1)
    cfg = fsdp_peer.config()
    emulated = World(rank=0, size=2, emulated=True)
    state = fsdp_peer.fresh_state(emulated, cfg)
    results = []
    for batch in fsdp_peer.batches(3):
        state, result = train_step(state, batch, cfg, emulated)
        results.append(result)
    ranks = load((tmp_path / "weights.safetensors").read_bytes())
    alone = load(state_dict_bytes(state.model))
    assert ranks.keys() == alone.keys()
    worst = max(float((ranks[k] - alone[k]).abs().max()) for k in ranks)
    assert 0 < worst < 1e-6, worst  # not bitwise (the sum across ranks rounds differently), but close
    logged = json.loads((tmp_path / "results.json").read_text())
    # N ranks hash their own pieces (no gather); the canonical scheme, which older logs hold, is still the
    # sha256 of the gathered state_dict_bytes.
    assert all(r["sha"].startswith("pieces:") and len(r["sha"]) == 71 for r in logged)
    assert len({r["sha"] for r in logged}) == 3
    canonical = (tmp_path / "canonical.txt").read_text()
    assert canonical == hashlib.sha256((tmp_path / "weights.safetensors").read_bytes()).hexdigest()
    for mine, theirs in zip(results, logged):
        assert mine.loss == pytest.approx(theirs["loss"], rel=1e-5, abs=1e-7)
        assert mine.grad_norm == pytest.approx(theirs["grad_norm"], rel=1e-3)
        assert mine.metrics["tokens"] == theirs["metrics"]["tokens"]
        assert mine.metrics["kl_k3"] == pytest.approx(theirs["metrics"]["kl_k3"], rel=1e-4)


@pytest.mark.parametrize("ranks", [2, 4])
def test_expert_parallel_equals_one_process_playing_every_rank(tmp_path: Path, ranks: int) -> None:
    """trainer.expert_parallel = 2 (gloo runs the uneven all-to-all): tokens travel to the rank
    holding their expert; 4 ranks add FSDP over the ranks holding the same experts."""
    torchrun("steps", str(tmp_path), "2", ranks=ranks)
    layout = json.loads((tmp_path / "experts.json").read_text())
    assert "ExpertParallel" in layout["class"]
    assert layout["local_shape"][0] == fsdp_peer.MODEL.num_experts // ranks  # whole experts, then FSDP's split
    torch.set_num_threads(1)
    cfg = fsdp_peer.config(1, ranks)
    emulated = World(rank=0, size=ranks, emulated=True)
    state = fsdp_peer.fresh_state(emulated, cfg)
    for batch in fsdp_peer.batches(3):
        assert batch.routing_BTLK is not None and cfg.trainer.router_replay  # replayed ids go through EP
        state, result = train_step(state, batch, cfg, emulated)
    ranks_sd, alone = load((tmp_path / "weights.safetensors").read_bytes()), load(state_dict_bytes(state.model))
    assert ranks_sd.keys() == alone.keys()
    # Float32 rounding of sums split across ranks, compounded over 3 AdamW steps. 2 ranks, 2026-12-03:
    # 5.1e-7 before the float64 group statistics (4970a30^), 2.9e-7 after and at this commit, alone
    # and in the whole file; the 1.45e-6 once reported here did not reproduce.
    worst = max(float((ranks_sd[k] - alone[k]).abs().max()) for k in ranks_sd)
    assert worst < 1e-6, worst
    logged = json.loads((tmp_path / "results.json").read_text())
    assert result.loss == pytest.approx(logged[-1]["loss"], rel=1e-5, abs=1e-7)
    assert result.grad_norm == pytest.approx(logged[-1]["grad_norm"], rel=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank: 2 GPUs")
@pytest.mark.parametrize("expert_parallel", ["1", "2"])
def test_two_ranks_on_nccl_match_the_cpu_reference(tmp_path: Path, expert_parallel: str) -> None:
    """The same 2-rank step on CUDA (NCCL picked by the backend choice, batches moved to the GPU),
    plain FSDP2 and with the experts split over the 2 ranks."""
    torchrun("steps", str(tmp_path), expert_parallel)
    cfg = fsdp_peer.config()
    emulated = World(rank=0, size=2, emulated=True)
    state = fsdp_peer.fresh_state(emulated, cfg)
    for batch in fsdp_peer.batches(3):
        state, result = train_step(state, batch, cfg, emulated)
    ranks, alone = load((tmp_path / "weights.safetensors").read_bytes()), load(state_dict_bytes(state.model))
    assert max(float((ranks[k] - alone[k]).abs().max()) for k in ranks) < 1e-4  # fp32 GPU kernels differ a little


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank: 2 GPUs")
def test_context_parallel_on_nccl_matches_one_process(tmp_path: Path) -> None:
    """trainer.context_parallel = 2: one CP group, so both ranks get every micro-batch and each holds
    half of its positions (torch's ring attention); one process trains the same micro-batches whole."""
    torchrun("steps", str(tmp_path), "1", "2")
    torch.set_num_threads(1)
    cfg = fsdp_peer.config(1, 2, context_parallel=2)
    state = fsdp_peer.fresh_state(LOCAL, cfg)
    results = []
    for batch in fsdp_peer.batches(3):
        state, result = train_step(state, batch, cfg)
        results.append(result)
    ranks, alone = load((tmp_path / "weights.safetensors").read_bytes()), load(state_dict_bytes(state.model))
    assert ranks.keys() == alone.keys()
    assert max(float((ranks[k] - alone[k]).abs().max()) for k in ranks) < 1e-4  # fp32 GPU kernels differ a little
    for mine, theirs in zip(results, json.loads((tmp_path / "results.json").read_text())):
        assert mine.loss == pytest.approx(theirs["loss"], rel=1e-4, abs=1e-6)
        assert mine.metrics["tokens"] == theirs["metrics"]["tokens"]
        assert mine.metrics["kl_k3"] == pytest.approx(theirs["metrics"]["kl_k3"], rel=1e-3, abs=1e-6)


def _state_dict_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert any(k.startswith("optim.") and k.endswith("exp_avg_sq") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("expert_parallel", ["1", "2"])
def test_dcp_checkpoint_reshards_two_ranks_to_one(tmp_path: Path, expert_parallel: str) -> None:
    run, out = tmp_path / "run", tmp_path / "out"
    run.mkdir(), out.mkdir()
    torchrun("save", str(run), str(out), expert_parallel)
    cfg = fsdp_peer.config()
    state = fsdp_peer.fresh_state(LOCAL, cfg)
    state = sharded_checkpoint.load((run / "manifest.json").read_bytes(), state, LOCAL, run, source="test")
    assert state.step == 2
    _state_dict_equal(fsdp_peer.full_state(state), load_file(out / "state.safetensors"))


@pytest.mark.parametrize("expert_parallel", ["1", "2"])
def test_dcp_checkpoint_reshards_one_process_to_two_ranks(tmp_path: Path, expert_parallel: str) -> None:
    run, out = tmp_path / "run", tmp_path / "out"
    run.mkdir(), out.mkdir()
    torch.set_num_threads(1)
    cfg = fsdp_peer.config()
    state = fsdp_peer.fresh_state(LOCAL, cfg)
    for batch in fsdp_peer.batches(2):
        state, _ = train_step(state, batch, cfg)
    (run / "manifest.json").write_bytes(sharded_checkpoint.save(state, LOCAL, run))
    torchrun("load", str(run), str(out), expert_parallel)
    _state_dict_equal(fsdp_peer.full_state(state), load_file(out / "state.safetensors"))


def test_damaged_checkpoint_file_is_named(tmp_path: Path) -> None:
    cfg = fsdp_peer.config()
    state = fsdp_peer.fresh_state(LOCAL, cfg)
    manifest = sharded_checkpoint.save(state, LOCAL, tmp_path)
    shard = next(p for p in sharded_checkpoint.directory_of(tmp_path, 0).iterdir() if p.suffix == ".distcp")
    shard.write_bytes(b"x" + shard.read_bytes()[1:])
    with pytest.raises(sharded_checkpoint.CheckpointError, match=shard.name):
        sharded_checkpoint.load(manifest, state, LOCAL, tmp_path, source="test")


@pytest.mark.parametrize("ranks, ep", [(2, 1), (4, 2)])  # 4 ranks: EP groups of 2, FSDP over each expert's 2
def test_each_rank_writes_its_own_shards_and_the_engine_loads_the_gathered_bits(tmp_path: Path, ranks: int, ep: int,
                                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """Every rank writes the rows it holds (FSDP2 rows, EP's whole experts); rank 0 writes about its
    share, not the model, and the version loads into the built-in engine with the bits of the same
    weights gathered and published from one process."""
    torchrun("publish", str(tmp_path), str(ep), ranks=ranks)
    blobs = BlobStore(tmp_path / "blobs")
    refs = msgspec.json.decode((tmp_path / "published.json").read_bytes(), type=dict[str, BlobRef])
    mine, gathered = read_manifest(blobs, refs["ranks"]), read_manifest(blobs, refs["gathered"])
    assert mine.hash == gathered.hash and all(s.digest for s in mine.shards)  # hashed as written, like one process's
    whole = sum(s.blob.nbytes for s in gathered.shards)
    written = [sum(s.blob.nbytes for s in mine.shards if s.rank == r) for r in range(ranks)]
    assert all(0 < n < 1.5 * whole / ranks for n in written), (written, whole)  # each its own share
    split = [n for s in mine.shards for n, r in zip(s.tensors, s.rows) if r[:2] != (0, r[2])]
    assert split and not any(".experts." in n for n in split)  # rows of tensors, but whole experts
    by_ranks, by_one = swapped_engine(blobs, mine, start=MoEModel(fsdp_peer.MODEL)), \
        swapped_engine(blobs, gathered, start=MoEModel(fsdp_peer.MODEL))
    assert by_ranks.version == by_one.version == 1
    for name, value in by_one.model.state_dict().items():
        assert torch.equal(by_ranks.model.state_dict()[name], value), name
    # Version 2: each rank's delta against its own shards of version 1, applied into the rows.
    delta = read_manifest(blobs, refs["delta"])
    assert delta.base_version == 1 and {s.rank for s in delta.shards} == set(range(ranks))
    by_delta = swapped_engine(blobs, mine, delta, start=MoEModel(fsdp_peer.MODEL))
    by_full = swapped_engine(blobs, full_of(delta), start=MoEModel(fsdp_peer.MODEL))
    changed = 0
    for name, value in by_full.model.state_dict().items():
        assert torch.equal(by_delta.model.state_dict()[name], value), name
        changed += int((value != by_one.model.state_dict()[name]).sum())
    assert changed >= ranks  # the delta did change the weights
    assert "did not reproduce" not in caplog.text  # applied, not replaced by the full shards
