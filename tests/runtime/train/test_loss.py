"""runtime/train/loss.py against hand-computed values on tiny tensors."""

from __future__ import annotations

import math

import pytest
import torch

from reel.runtime.config.sections import TrainerSection
from reel.runtime.train.loss import (MISMATCH_KEYS, LossConfig, grpo_advantages, importance_weights, mismatch_metrics,
                          policy_loss, staleness_histogram)

torch.set_num_threads(1)
LOG = math.log


def _t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


def _grad(logp_new_N, *args, **kw) -> tuple[float, torch.Tensor]:
    logp_new_N = logp_new_N.clone().requires_grad_(True)
    loss, _ = policy_loss(logp_new_N, *args, **kw)
    loss.backward()
    return loss.item(), logp_new_N.grad


def test_grpo_advantages_hand_values_and_constant_group():
    adv = grpo_advantages(_t(1, 0, 1, 0, 0.5, 0.5, 0.5, 0.5).view(2, 4))
    assert torch.allclose(adv[0], _t(1, -1, 1, -1), atol=1e-5)
    assert torch.equal(adv[1], torch.zeros(4))  # constant group: exactly 0, no NaN
    assert torch.allclose(grpo_advantages(_t(3, 0, 0).view(1, 3)),
                          _t(2, -1, -1).view(1, 3) / math.sqrt(2), atol=1e-5)


def test_loss_config_from_trainer_section():
    cfg = LossConfig.from_trainer(TrainerSection(objective="icepop", icepop_low=0.25, clip_eps=0.1, kl_coef=0.5))
    assert (cfg.objective, cfg.icepop_low, cfg.icepop_high, cfg.clip_eps, cfg.kl_coef) == ("icepop", 0.25, 5.0, 0.1, 0.5)


def test_tis_hand_computed_loss_and_gradient():
    # w = π_old/μ = 0.5, 1.5, 4 -> capped at 2; A = 1, -1, 1; ρ = 1; last token masked out.
    old = _t(LOG(0.5), LOG(1.5), LOG(4.0), 0.0)
    mu = torch.zeros(4)
    adv, mask = _t(1, -1, 1, 5), torch.tensor([1, 1, 1, 0])
    seq = torch.zeros(4, dtype=torch.long)
    loss, grad = _grad(old, old, mu, adv, seq, LossConfig(objective="tis", tis_cap=2.0), mask)
    assert loss == pytest.approx(-(0.5 - 1.5 + 2.0) / 3, abs=1e-6)
    assert torch.allclose(grad, _t(-0.5, 1.5, -2.0, 0.0) / 3, atol=1e-6)
    _, stats = policy_loss(old, old, mu, adv, seq, LossConfig(objective="tis"), mask)
    assert stats.tokens == 3 and stats.weight_capped_frac == pytest.approx(1 / 3)
    assert stats.weight_mean == pytest.approx((0.5 + 1.5 + 2.0) / 3, abs=1e-6)


def test_weights_at_boundaries():
    seq = torch.zeros(6, dtype=torch.long)
    mask = torch.ones(6)
    w = _t(0.499, 0.501, 1.0, 1.999, 2.0, 2.001)
    old, mu = w.log(), torch.zeros(6)
    tis = importance_weights(old, mu, seq, LossConfig(objective="tis", tis_cap=2.0), mask)
    assert torch.allclose(tis, w.clamp(max=2.0)) and tis.max().item() == 2.0
    icepop = importance_weights(old, mu, seq, LossConfig(objective="icepop", icepop_low=0.5, icepop_high=2.0))
    assert torch.allclose(icepop, _t(0, 0.501, 1.0, 1.999, 2.0, 0), atol=1e-5)
    assert importance_weights(old, mu, seq, LossConfig(objective="none"), mask).eq(1).all()


def test_mis_masks_whole_sample_by_geometric_mean():
    # sample 0: ratios 4 and 1/4 -> geometric mean 1, kept (weight 1 on both, not 4 and 1/4);
    # sample 1: ratios 3, 3 -> 3 > mis_high, dropped; sample 2: ratios 1.5, 1.5 -> kept with 1.5;
    # the masked token of sample 2 (ratio 100) does not count.
    w = _t(4, 0.25, 3, 3, 1.5, 1.5, 100)
    seq = torch.tensor([0, 0, 1, 1, 2, 2, 2])
    mask = torch.tensor([1, 1, 1, 1, 1, 1, 0])
    cfg = LossConfig(objective="mis", mis_low=0.5, mis_high=2.0)
    got = importance_weights(w.log(), torch.zeros(7), seq, cfg, mask)
    assert torch.allclose(got[:6], _t(1, 1, 0, 0, 1.5, 1.5), atol=1e-5)
    _, stats = policy_loss(w.log(), w.log(), torch.zeros(7), torch.ones(7), seq, cfg, mask)
    assert stats.weight_zero_frac == pytest.approx(2 / 6)


@pytest.mark.parametrize("objective", ["tis", "icepop", "mis"])
def test_on_policy_objectives_equal_plain_policy_gradient(objective):
    g = torch.Generator().manual_seed(0)
    old = torch.randn(20, generator=g) - 2
    adv = torch.randn(20, generator=g)
    mask = torch.rand(20, generator=g) > 0.2
    seq = torch.arange(20) // 5
    args = (old, old.clone(), adv, seq)
    loss_none, grad_none = _grad(old, *args, cfg=LossConfig(objective="none"), mask_N=mask)
    loss, grad = _grad(old, *args, cfg=LossConfig(objective=objective), mask_N=mask)
    assert loss == pytest.approx(loss_none, abs=1e-7)
    assert torch.allclose(grad, grad_none, atol=1e-7)
    assert torch.allclose(grad_none, -(adv * mask) / mask.sum(), atol=1e-7)


def test_ppo_clip_stops_gradient_only_past_the_clip_in_the_advantage_direction():
    # ρ = 1.5 (A = ±1) and ρ = 0.5 (A = ±1), clip_eps = 0.2.
    old = torch.zeros(4)
    new = _t(LOG(1.5), LOG(1.5), LOG(0.5), LOG(0.5))
    adv = _t(1, -1, 1, -1)
    cfg = LossConfig(objective="none", clip_eps=0.2)
    loss, grad = _grad(new, old, old, adv, torch.zeros(4, dtype=torch.long), cfg)
    # terms min(ρA, clip(ρ)A): 1.2 (clipped), -1.5, 0.5, -0.8 (clipped)
    assert loss == pytest.approx(-(1.2 - 1.5 + 0.5 - 0.8) / 4, abs=1e-6)
    assert torch.allclose(grad, _t(0.0, 1.5, -0.5, 0.0) / 4, atol=1e-6)  # d(-ρA)/dlogp = -ρA
    _, stats = policy_loss(new, old, old, adv, torch.zeros(4, dtype=torch.long), cfg)
    assert stats.clip_frac == pytest.approx(0.5)


def test_kl_penalty_k3_against_old_policy():
    old = torch.zeros(2)
    new = _t(LOG(2.0), LOG(0.5))
    cfg = LossConfig(objective="none", kl_coef=0.1, clip_eps=10.0)
    args = (torch.zeros(2), torch.zeros(2), torch.zeros(2, dtype=torch.long))  # μ = π_old, A = 0
    loss, grad = _grad(new, old, *args, cfg=cfg)
    k3 = ((2 - 1 - LOG(2)) + (0.5 - 1 - LOG(0.5))) / 2
    _, stats = policy_loss(new, old, *args, cfg)
    assert stats.kl == pytest.approx(k3, abs=1e-6) and loss == pytest.approx(0.1 * k3, abs=1e-6)
    assert torch.allclose(grad, 0.1 * _t(2 - 1, 0.5 - 1) / 2, atol=1e-6)  # d k3/d logp = ρ - 1
    # On the first optimizer step (π_θ = π_old) the penalty and its gradient vanish.
    loss0, grad0 = _grad(old, old, *args, cfg=cfg)
    assert loss0 == 0.0 and grad0.eq(0).all()


def test_padding_is_harmless_and_no_mask_means_every_token():
    g = torch.Generator().manual_seed(1)
    old, mu, adv = torch.randn(10, generator=g), torch.randn(10, generator=g), torch.randn(10, generator=g)
    seq = torch.arange(10) // 2
    for objective in ("tis", "mis"):
        cfg = LossConfig(objective=objective)
        full, _ = policy_loss(old, old, mu, adv, seq, cfg)
        padded = [torch.cat([x, torch.full((2,), -math.inf)]) for x in (old, old, mu)]
        loss, grad = _grad(padded[0], padded[1], padded[2], torch.cat([adv, torch.zeros(2)]),
                           torch.cat([seq, torch.tensor([5, 5])]), cfg, torch.arange(12) < 10)
        assert loss == pytest.approx(full.item(), abs=1e-6) and torch.isfinite(grad).all()


def test_mismatch_metrics_hand_values_and_zero_when_on_policy():
    old = _t(LOG(2.0), LOG(0.25), 0.0)
    mask = torch.tensor([True, True, False])
    m = mismatch_metrics(old, torch.zeros(3), mask, entropy_N=_t(1.0, 3.0, 100.0))
    log_r = [LOG(2.0), LOG(0.25)]
    assert m["kl_k1"] == pytest.approx(-sum(log_r) / 2, abs=1e-6)
    assert m["kl_k2"] == pytest.approx(sum(0.5 * x * x for x in log_r) / 2, abs=1e-6)
    assert m["kl_k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in log_r) / 2, abs=1e-6)
    assert (m["ratio_mean"], m["ratio_min"], m["ratio_max"]) == pytest.approx((1.125, 0.25, 2.0))
    assert m["ratio_frac_outside"] == 0.5 and m["entropy"] == 2.0 and m["tokens"] == 2.0
    assert all(isinstance(v, float) for v in m.values())

    same = torch.randn(50) - 3
    m = mismatch_metrics(same, same.clone(), torch.ones(50))
    assert m["kl_k1"] == m["kl_k2"] == m["kl_k3"] == m["ratio_frac_outside"] == 0.0
    assert m["ratio_mean"] == m["ratio_min"] == m["ratio_max"] == 1.0
    assert mismatch_metrics(same, same, torch.zeros(50)) == dict.fromkeys([*MISMATCH_KEYS, "tokens"], 0.0)


def test_staleness_histogram():
    versions = torch.tensor([5, 5, 4, 2, 5, 0])
    mask = torch.tensor([1, 1, 1, 1, 1, 0])
    assert staleness_histogram(versions, 6, mask) == {1: 3, 2: 1, 4: 1}
