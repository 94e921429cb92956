"""Context parallelism on CPU: the config keys, the CUDA-only refusal, the batch split over
data-parallel groups, the mesh shape, is_causal attention against the padding mask, position ids
from the whole rows, and torch's sequence sharding on 2 gloo ranks. (The ring attention step
itself needs CUDA: test_fsdp.py's gpu test.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fsdp_peer
from reel.runtime.config.keys import ConfigError
from reel.runtime.config.run import from_dict
from reel.runtime.train.distributed import LOCAL, World, plan
from reel.runtime.model.config import ModelError
from reel.runtime.model.context_parallel import context_degree, mesh_shape, pad_positions
from reel.runtime.model.model import MoEModel, positions_from_mask
from reel.runtime.train.step import train_step
from paths import SUPPORT

PEER = SUPPORT / "cp_peer.py"


@pytest.mark.parametrize("trainer, key", [
    ({"ranks": 4, "context_parallel": 3}, "divide trainer.ranks = 4"),
    ({"ranks": 2, "context_parallel": 0}, "must be at least 1"),
    ({"ranks": 4, "context_parallel": 2, "expert_parallel": 2}, "trainer.expert_parallel = 2 is not supported"),
    ({"ranks": 2, "context_parallel": 2, "objective": "mis"}, "trainer.objective"),
    ({"ranks": 2, "context_parallel": 2, "aux_loss_coef": 0.01}, "trainer.aux_loss_coef"),
])
def test_context_parallel_errors_name_the_key(trainer: dict, key: str) -> None:
    with pytest.raises(ConfigError, match="trainer.context_parallel") as err:
        from_dict({"trainer": trainer})
    assert key in str(err.value)


def test_context_parallel_needs_cuda_ranks_and_falls_back_where_it_does_not_apply() -> None:
    with pytest.raises(ModelError, match=r"trainer.context_parallel = 2 needs CUDA ranks"):
        context_degree(World(0, 2), 2)  # no process group here: the ranks' device is the CPU
    assert context_degree(World(0, 3), 2) == 1  # a replay on 3 ranks of a CP = 2 run
    assert context_degree(World(0, 2, emulated=True), 2) == 1
    assert context_degree(LOCAL, 2) == 1


def test_mesh_is_dp_by_cp_with_each_cp_group_consecutive_ranks() -> None:
    world = World(0, 8, cp=2)
    assert mesh_shape(world) == (4, 2)
    for dp, group in enumerate(torch.arange(8).view(mesh_shape(world)).tolist()):  # init_device_mesh's layout
        assert [World(r, 8, cp=2).dp_rank for r in group] == [dp, dp]


def test_batch_is_split_over_data_parallel_groups_not_ranks() -> None:
    batch = fsdp_peer.batches(1)[0]
    for rank in range(4):
        mine = plan(batch, fsdp_peer.MICRO_BATCH_TOKENS, World(rank, 4, cp=2)).local
        group = plan(batch, fsdp_peer.MICRO_BATCH_TOKENS, World(rank // 2, 2)).local
        assert [(mb.rows_M.tolist(), mb.length, counts) for mb, _, counts in mine] == \
            [(mb.rows_M.tolist(), mb.length, counts) for mb, _, counts in group]


def test_batches_are_right_padded_so_is_causal_attention_gives_the_same_logits_on_real_tokens() -> None:
    batch = fsdp_peer.batches(1)[0]
    mask_BT = batch.attention_mask_BT.bool()
    assert not (~mask_BT[:, :-1] & mask_BT[:, 1:]).any()  # no real token after a padding one
    assert (mask_BT.sum(1) < mask_BT.shape[1]).any()  # and some rows are padded
    torch.manual_seed(0)
    model = MoEModel(fsdp_peer.MODEL)
    with torch.no_grad():
        masked = model(batch.input_ids_BT, batch.attention_mask_BT, replay_routing_BTLK=batch.routing_BTLK)
        causal = model(batch.input_ids_BT, batch.attention_mask_BT, replay_routing_BTLK=batch.routing_BTLK,
                       is_causal=True)
    torch.testing.assert_close(causal.logits[mask_BT], masked.logits[mask_BT], rtol=0, atol=1e-6)


def test_position_ids_come_from_the_whole_rows_before_the_split() -> None:
    batch = fsdp_peer.batches(1)[0]
    padded, positions_BT = pad_positions(batch, 4)
    T = batch.input_ids_BT.shape[1]
    assert padded.input_ids_BT.shape[1] % 4 == 0 and padded.routing_BTLK.shape[1] == padded.input_ids_BT.shape[1]
    assert not padded.attention_mask_BT[:, T:].any() and not padded.loss_mask_BT[:, T:].any()
    assert (padded.versions_BT[:, T:] == -1).all() and padded.tokens == batch.tokens
    real_BT = batch.attention_mask_BT.bool()
    torch.testing.assert_close(positions_BT[:, :T][real_BT], positions_from_mask(batch.attention_mask_BT)[real_BT])
    half = T // 2  # a second half's own mask would number its tokens from 0; its place in the row says half
    assert positions_BT[0, half] == half != positions_from_mask(batch.attention_mask_BT[:, half:])[0, 0]
    torch.manual_seed(0)
    model = MoEModel(fsdp_peer.MODEL)
    with torch.no_grad():
        given = model(batch.input_ids_BT, batch.attention_mask_BT, position_ids_BT=positions_BT[:, :T]).logits
        derived = model(batch.input_ids_BT, batch.attention_mask_BT).logits
        shifted = model(batch.input_ids_BT, batch.attention_mask_BT, position_ids_BT=positions_BT[:, :T] + 3).logits
    assert torch.equal(given, derived) and not torch.allclose(shifted[real_BT], derived[real_BT])


def test_one_process_replays_a_context_parallel_config_as_plain_training() -> None:
    """`reel replay --ranks 1` of a CP run: context parallelism is a layout, the step the same."""
    torch.set_num_threads(1)
    results = []
    for cp in (1, 2):
        cfg = fsdp_peer.config(ranks=2, context_parallel=cp)
        state = fsdp_peer.fresh_state(LOCAL, cfg)
        _, result = train_step(state, fsdp_peer.batches(1)[0], cfg)
        results.append(result)
    assert results[0].weights_sha256 == results[1].weights_sha256 and results[0].loss == results[1].loss


@pytest.mark.slow
def test_two_gloo_ranks_hold_head_and_tail_chunks_of_every_micro_batch_with_whole_row_positions(
        tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(PEER),
            str(tmp_path)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    batch = fsdp_peer.batches(1)[0]
    whole = plan(batch, fsdp_peer.MICRO_BATCH_TOKENS, LOCAL).local
    assert len(ranks[0]) == len(ranks[1]) == len(whole)  # one CP group: both ranks get every micro-batch
    counted = 0
    for (mb, sub, _), slices in zip(whole, zip(*ranks)):
        chunk = 2 * slices[0]["width"] // 4  # padded length / 2C
        seen = []
        for r, piece in enumerate(slices):
            for row, pos, input_id, target, loss in piece["tokens"]:
                assert pos // chunk in (r, 3 - r)  # head-tail load balancing
                # right-padded rows: a real token's position is its column in the whole row
                assert (batch.input_ids_BT[row, pos], batch.targets_BT[row, pos]) == (input_id, target)
                assert batch.loss_mask_BT[row, pos] == bool(loss)
                counted += loss
                seen.append((row, pos))
        real = sub.attention_mask_BT.bool()
        want = [(int(mb.rows_M[b]), t) for b, t in real.nonzero().tolist()]
        assert sorted(seen) == sorted(want)  # every real token on exactly one rank
    assert counted == batch.tokens
