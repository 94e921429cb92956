"""The training step: deterministic, resumable from a checkpoint, router replay wired through."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from reel.runtime.checkpoint import single as checkpoint
from reel.runtime.train.batch import Group, build_batch, micro_batches, routing_problem
from reel.runtime.train.mismatch_split import SPLIT_KEYS, step_split
from reel.runtime.model.weights import state_dict_bytes
from reel.runtime.train.step import train_step, weights_sha256
from train_setup import MODEL, fresh_state, random_groups, step_config


@pytest.mark.parametrize("objective", ["tis", "icepop", "mis", "none"])
def test_same_batches_same_weights(objective: str) -> None:
    config = step_config(objective=objective, optimizer_steps=2)
    hashes = []
    for _ in range(2):
        state = fresh_state(config)
        batches = [build_batch(random_groups(state.model, seed)) for seed in (1, 2)]
        for batch in batches:
            state, result = train_step(state, batch, config)
            assert np.isfinite(result.loss) and result.grad_norm > 0
        hashes.append(result.weights_sha256)
    assert hashes[0] == hashes[1]


def test_checkpoint_resume_is_bitwise() -> None:
    config = step_config()
    state = fresh_state(config)
    b1, b2 = (build_batch(random_groups(state.model, s)) for s in (1, 2))
    state, _ = train_step(state, b1, config)
    saved = checkpoint.checkpoint_bytes(state)
    _, straight = train_step(state, b2, config)

    fresh = fresh_state(config, seed=123)  # different weights: the checkpoint must overwrite everything
    restored = checkpoint.restore(saved, fresh.model, config.trainer, source="test")
    assert restored.step == 1
    _, resumed = train_step(restored, b2, config)
    assert resumed.weights_sha256 == straight.weights_sha256
    assert resumed.loss == straight.loss and resumed.grad_norm == straight.grad_norm


def test_router_replay_uses_logged_ids_and_router_gets_gradients() -> None:
    config = step_config(router_replay=True)
    state = fresh_state(config)
    groups = random_groups(state.model, 1)
    # Replace the logged routing with other ids so that replay is visible.
    flipped = [Group(g.trajectory, [(r + 1) % MODEL.num_experts for r in g.routing]) for g in groups]
    batch = build_batch(flipped)
    seen: list[torch.Tensor] = []
    gate = state.model.model.layers[0].mlp.gate
    hook = gate.register_forward_hook(lambda mod, args, out: seen.append(out[1].detach().clone()))
    before = gate.weight.detach().clone()
    try:
        train_step(state, batch, config)
    finally:
        hook.remove()
    logged_N = batch.routing_BTLK[:, :, 0].flatten(0, 1)
    assert all(torch.equal(ids, logged_N) for ids in seen)
    assert not torch.equal(before, gate.weight.detach())  # the router was trained through replay


def test_without_router_replay_the_model_routes_itself() -> None:
    config = step_config(router_replay=False)
    state = fresh_state(config)
    flipped = [Group(g.trajectory, [(r + 1) % MODEL.num_experts for r in g.routing]) for g in random_groups(state.model, 1)]
    batch = build_batch(flipped)
    seen: list[torch.Tensor] = []
    gate = state.model.model.layers[0].mlp.gate
    hook = gate.register_forward_hook(lambda mod, args, out: seen.append(out[1].detach().clone()))
    try:
        train_step(state, batch, config)
    finally:
        hook.remove()
    assert not torch.equal(seen[0], batch.routing_BTLK[:, :, 0].flatten(0, 1))


def test_micro_batches_accumulate_to_the_full_batch() -> None:
    whole, split = step_config(), step_config(micro_batch_tokens=16)
    s1, s2 = fresh_state(whole), fresh_state(split)
    batch = build_batch(random_groups(s1.model, 3))
    grads: list[list[torch.Tensor]] = []
    for state in (s1, s2):  # compare the accumulated gradients (Adam would magnify tiny differences)
        state.optimizer.register_step_pre_hook(
            lambda opt, args, kwargs: grads.append([p.grad.clone() for p in opt.param_groups[0]["params"]]))
    _, r1 = train_step(s1, batch, whole)
    _, r2 = train_step(s2, batch, split)
    assert len(micro_batches(batch, 16)) > 1
    assert abs(r1.loss - r2.loss) < 1e-5 and abs(r1.grad_norm - r2.grad_norm) < 1e-4
    assert all(torch.allclose(g1, g2, atol=1e-6) for g1, g2 in zip(*grads))


def test_mismatch_metrics_and_staleness_reported() -> None:
    config = step_config()
    state = fresh_state(config)
    _, result = train_step(state, build_batch(random_groups(state.model, 1)), config)
    assert result.metrics["kl_k3"] > 0 and result.metrics["tokens"] > 0
    assert set(result.staleness) == {0} and result.staleness[0] == result.metrics["tokens"]
    assert weights_sha256(state.model) == result.weights_sha256


def test_load_balancing_loss_changes_the_step() -> None:
    plain, balanced = step_config(), step_config(aux_loss_coef=0.5)
    s1, s2 = fresh_state(plain), fresh_state(balanced)
    batch = build_batch(random_groups(s1.model, 4))
    _, r1 = train_step(s1, batch, plain)
    _, r2 = train_step(s2, batch, balanced)
    assert r1.weights_sha256 != r2.weights_sha256 and r2.loss > r1.loss


def test_micro_batches_group_rows_by_length_within_the_token_budget() -> None:
    state = fresh_state(step_config())
    batch = build_batch(random_groups(state.model, 5, n_groups=3))
    lengths = batch.attention_mask_BT.sum(1)
    parts = micro_batches(batch, 24)
    rows = torch.cat([mb.rows_M for mb in parts])
    assert sorted(rows.tolist()) == list(range(len(lengths)))  # every row exactly once
    assert all(mb.length == int(lengths[mb.rows_M].max()) for mb in parts)
    assert all(mb.length * len(mb.rows_M) <= 24 or len(mb.rows_M) == 1 for mb in parts)
    assert torch.equal(lengths[rows], lengths[rows].sort().values)  # short rows first
    assert micro_batches(batch, 0)[0].rows_M.tolist() == list(range(len(lengths)))


def test_mismatch_split_of_stale_tokens_and_of_missing_versions() -> None:
    """step_split (what the mismatch role logs) scores each token at its sampling version: tokens sampled by
    version 0 and trained at step 2 drift; without version 0's weights they are left out and named."""
    config = step_config()
    state = fresh_state(config)
    version_0 = state_dict_bytes(state.model)
    stale = build_batch(random_groups(state.model, 7))  # sampled by version 0
    state, _ = train_step(state, build_batch(random_groups(state.model, 1)), config)
    split = step_split(state.model, stale, config.trainer, state.step, {0: version_0}.get)
    assert set(split.figures) == set(SPLIT_KEYS)
    assert split.figures["split_tokens"] == stale.tokens and split.versions == [0] and split.missing == []
    assert split.figures["drift_k3"] > 0  # one update since sampling
    gone = step_split(state.model, stale, config.trainer, state.step, {}.get)
    assert gone.figures["split_tokens"] == 0 and gone.versions == [] and gone.missing == [0]
    _, result = train_step(state, stale, config)
    assert not set(SPLIT_KEYS) & set(result.metrics)  # never the trainer's work
    assert set(result.phases) == {"score_old", "forward_backward", "optimizer"}


def test_one_bad_trace_never_turns_router_replay_off_silently() -> None:
    """A trace that does not fit its tokens is named by routing_problem (the trainer drops its
    group); build_batch refuses a batch mixing it with good ones; the step records whether R3 ran."""
    config = step_config()
    state = fresh_state(config)
    good, other = random_groups(state.model, 1)
    layers, k, experts = len(MODEL.moe_layers), MODEL.num_experts_per_tok, MODEL.num_experts
    assert routing_problem(good, layers, k, experts) is None
    short = Group(other.trajectory, [r[:-1] for r in other.routing])
    assert "shape" in routing_problem(short, layers, k, experts)
    assert "samples" in routing_problem(Group(other.trajectory, other.routing[:-1]), layers, k, experts)
    beyond = Group(other.trajectory, [np.full_like(r, experts) for r in other.routing])
    assert f"expert {experts} of {experts}" in routing_problem(beyond, layers, k, experts)
    with pytest.raises(ValueError, match=f"group {other.trajectory.group_id} has no routing"):
        build_batch([good, short])
    _, result = train_step(state, build_batch([good, other]), config)
    assert result.metrics["router_replay"] == 1.0
    _, result = train_step(fresh_state(config), build_batch([good, other]), step_config(router_replay=False))
    assert result.metrics["router_replay"] == 0.0
