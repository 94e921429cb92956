"""runtime/train/loss.py held to small reference implementations of the published formulas.

Each reference works token by token in Python floats (double precision), written from the papers
rather than from the module: GRPO (Shao et al. 2024) with population and Bessel std, Schulman's
k1/k2/k3 KL estimators, truncated importance sampling, IcePop's band, geometric-mean MIS and PPO's
clipped objective with dual-clip (Ye et al. 2020) and verl's log-ratio clamp. Edge cases: groups of
one, all-equal groups with rewards float32 cannot hold exactly, |log ρ| = 25 and 100, length-1 rows,
NaN and inf at masked positions.
"""

from __future__ import annotations

import math

import pytest
import torch

from reel.runtime.train.loss import LossConfig, grpo_advantages, importance_weights, mismatch_metrics, policy_loss

torch.set_num_threads(1)
EPS = 1e-6


# ---- references -------------------------------------------------------------------------------

def ref_grpo(rewards: list[float], bessel: bool = False) -> list[float]:
    n = len(rewards)
    mean = sum(rewards) / n
    var = sum((r - mean) ** 2 for r in rewards) / (n - 1 if bessel else n) if n > 1 or not bessel else 0.0
    if max(rewards) == min(rewards):
        return [0.0] * n
    return [(r - mean) / (math.sqrt(var) + EPS) for r in rewards]


def ref_weights(log_old: list[float], log_mu: list[float], seqs: list[int], cfg: LossConfig) -> list[float]:
    ratios = [math.exp(o - m) for o, m in zip(log_old, log_mu)]
    if cfg.objective == "none":
        return [1.0] * len(ratios)
    if cfg.objective == "tis":
        return [min(r, cfg.tis_cap) for r in ratios]
    if cfg.objective == "icepop":
        return [r if cfg.icepop_low <= r <= cfg.icepop_high else 0.0 for r in ratios]
    geo = {}
    for s in set(seqs):
        logs = [o - m for o, m, q in zip(log_old, log_mu, seqs) if q == s]
        geo[s] = math.exp(sum(logs) / len(logs))
    return [geo[s] if cfg.mis_low <= geo[s] <= cfg.mis_high else 0.0 for s in seqs]


def ref_token_loss(log_new: float, log_old: float, adv: float, w: float, cfg: LossConfig) -> float:
    log_rho = max(-cfg.ratio_clamp, min(cfg.ratio_clamp, log_new - log_old))
    rho = math.exp(log_rho)
    clipped = max(1 - cfg.clip_eps, min(1 + cfg.clip_eps, rho))
    pg = -min(rho * adv, clipped * adv)
    if cfg.dual_clip and adv < 0:
        pg = min(pg, -cfg.dual_clip * adv)
    k3 = rho - 1 - log_rho
    return w * pg + cfg.kl_coef * w * k3


def ref_loss(log_new, log_old, log_mu, adv, seqs, cfg) -> float:
    w = ref_weights(log_old, log_mu, seqs, cfg)
    terms = [ref_token_loss(*x, cfg) for x in zip(log_new, log_old, adv, w)]
    return sum(terms) / len(terms)


def ref_kl(log_old: list[float], log_mu: list[float]) -> dict[str, float]:
    log_r = [o - m for o, m in zip(log_old, log_mu)]
    n = len(log_r)
    return {"kl_k1": sum(-x for x in log_r) / n, "kl_k2": sum(0.5 * x * x for x in log_r) / n,
            "kl_k3": sum(math.exp(x) - 1 - x for x in log_r) / n}


def _f32(xs) -> list[float]:
    """Values as float32 holds them, so reference and module start from the same numbers."""
    return torch.tensor(xs, dtype=torch.float32).tolist()


# ---- GRPO advantages --------------------------------------------------------------------------

# 0.1, 0.7, 0.9 and reverse_text's LCS fractions are not exact in binary.
UNEXACT = [0.1, 0.7, 0.9, 1 / 3, 5 / 7, 0.3, 2 / 9]


@pytest.mark.parametrize("reward", UNEXACT)
def test_all_equal_groups_get_exact_zeros_for_every_size(reward):
    for size in range(1, 129):
        adv = grpo_advantages(torch.full((1, size), reward))
        assert adv.eq(0).all(), f"group of {size} rewards {reward}: max |A| = {adv.abs().max().item()}"


def test_groups_of_one_get_zero():
    assert grpo_advantages(torch.tensor([[0.3], [1.0], [-2.0]])).eq(0).all()


@pytest.mark.parametrize("size", [2, 3, 7, 8, 12, 64, 128])
def test_grpo_matches_population_std_reference(size):
    g = torch.Generator().manual_seed(size)
    rewards = (torch.rand(4, size, generator=g) * 10).round() / 10  # 0.0, 0.1, ..., 1.0: ties and unexact values
    rewards[3] = 0.7  # one all-equal group in the batch
    got = grpo_advantages(rewards)
    for row, out in zip(rewards.tolist(), got.tolist()):
        assert out == pytest.approx(ref_grpo(row), abs=2e-6)


def test_grpo_population_vs_bessel_convention():
    # Reel divides by the population std (defined for groups of one); TRL's Bessel std gives
    # advantages smaller by sqrt((S-1)/S), up to eps. docs/numerics.md says which Reel uses.
    rewards = [0.1, 0.7, 0.9, 0.2, 0.2]
    ours = grpo_advantages(torch.tensor([rewards]))[0].tolist()
    bessel = ref_grpo(_f32(rewards), bessel=True)
    scale = math.sqrt((len(rewards) - 1) / len(rewards))
    assert [a * scale for a in ours] == pytest.approx(bessel, abs=1e-5)
    assert ours != pytest.approx(bessel, abs=1e-3)


# ---- importance weights and KL estimators -----------------------------------------------------

def _random_tokens(seed: int, n: int = 40, rows: int = 8, spread: float = 0.8):
    g = torch.Generator().manual_seed(seed)
    log_mu = torch.rand(n, generator=g).log() - 0.1
    log_old = log_mu + spread * torch.randn(n, generator=g)
    log_new = log_old + spread * torch.randn(n, generator=g)
    adv = torch.randn(n, generator=g) * 2
    seqs = torch.sort(torch.randint(0, rows, (n,), generator=g)).values
    return log_new, log_old, log_mu, adv, seqs


@pytest.mark.parametrize("cfg", [LossConfig(objective="tis", tis_cap=1.5), LossConfig(objective="icepop"),
                                 LossConfig(objective="mis", mis_low=0.7, mis_high=1.4),
                                 LossConfig(objective="none")], ids=lambda c: c.objective)
def test_importance_weights_match_reference(cfg):
    _, log_old, log_mu, _, seqs = _random_tokens(1)
    got = importance_weights(log_old, log_mu, seqs, cfg).tolist()
    want = ref_weights(log_old.tolist(), log_mu.tolist(), seqs.tolist(), cfg)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_mis_with_length_one_rows_weighs_each_token_alone():
    log_old, log_mu = torch.tensor([0.5, -2.0, 0.1]), torch.zeros(3)
    seqs = torch.tensor([0, 1, 2])
    cfg = LossConfig(objective="mis", mis_low=0.5, mis_high=2.0)
    got = importance_weights(log_old, log_mu, seqs, cfg).tolist()
    assert got == pytest.approx(ref_weights(log_old.tolist(), [0.0] * 3, [0, 1, 2], cfg), rel=1e-6)
    assert got[1] == 0.0


def test_kl_estimators_match_reference():
    _, log_old, log_mu, _, _ = _random_tokens(2)
    got = mismatch_metrics(log_old, log_mu)
    for key, want in ref_kl(log_old.tolist(), log_mu.tolist()).items():
        assert got[key] == pytest.approx(want, rel=1e-5), key


# ---- the clipped loss -------------------------------------------------------------------------

CONFIGS = [LossConfig(objective="tis"), LossConfig(objective="icepop", clip_eps=0.1),
           LossConfig(objective="mis", kl_coef=0.05), LossConfig(objective="none", dual_clip=0.0),
           LossConfig(objective="tis", dual_clip=2.0, kl_coef=0.1, ratio_clamp=5.0)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.objective}-dc{c.dual_clip}-kl{c.kl_coef}")
@pytest.mark.parametrize("seed", [3, 4])
def test_policy_loss_matches_reference(cfg, seed):
    log_new, log_old, log_mu, adv, seqs = _random_tokens(seed, spread=1.5)
    got, _ = policy_loss(log_new, log_old, log_mu, adv, seqs, cfg)
    want = ref_loss(log_new.tolist(), log_old.tolist(), log_mu.tolist(), adv.tolist(), seqs.tolist(), cfg)
    assert got.item() == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_dual_clip_caps_negative_advantage_tokens():
    # ρ = e^2 ≈ 7.4 with A = -1: PPO alone costs 7.4; the dual clip caps it at 3.
    log_new, zeros = torch.tensor([2.0], requires_grad=True), torch.zeros(1)
    seqs = torch.zeros(1, dtype=torch.long)
    loss, _ = policy_loss(log_new, zeros, zeros, torch.tensor([-1.0]), seqs, LossConfig(objective="none"))
    loss.backward()
    assert loss.item() == pytest.approx(3.0) and log_new.grad.item() == 0.0
    off, _ = policy_loss(log_new, zeros, zeros, torch.tensor([-1.0]), seqs, LossConfig(objective="none", dual_clip=0))
    assert off.item() == pytest.approx(math.exp(2.0), rel=1e-6)


@pytest.mark.parametrize("log_rho", [25.0, -25.0, 100.0, -100.0])
def test_extreme_log_ratio_gives_finite_loss_and_gradient(log_rho):
    log_new = torch.tensor([log_rho, 0.0], requires_grad=True)
    zeros, seqs = torch.zeros(2), torch.zeros(2, dtype=torch.long)
    adv = torch.tensor([-1.0, 1.0])
    for cfg in (LossConfig(objective="none", kl_coef=0.1), LossConfig(objective="none", dual_clip=0, kl_coef=0.1)):
        log_new.grad = None
        loss, _ = policy_loss(log_new, zeros, zeros, adv, seqs, cfg)
        loss.backward()
        want = ref_loss(log_new.tolist(), [0.0, 0.0], [0.0, 0.0], adv.tolist(), [0, 0], cfg)
        assert math.isfinite(loss.item()) and torch.isfinite(log_new.grad).all()
        assert loss.item() == pytest.approx(want, rel=1e-5)
        assert loss.item() < 1e10  # the unclamped ratio would give e^25 ≈ 7e10 and, past 88, inf


@pytest.mark.parametrize("junk", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("objective", ["tis", "icepop", "mis", "none"])
def test_junk_at_masked_positions_changes_nothing(objective, junk):
    log_new, log_old, log_mu, adv, seqs = _random_tokens(5, n=12, rows=3)
    cfg = LossConfig(objective=objective, kl_coef=0.1)
    want = ref_loss(log_new.tolist(), log_old.tolist(), log_mu.tolist(), adv.tolist(), seqs.tolist(), cfg)
    pad = torch.full((3,), junk)
    padded = [torch.cat([x, pad]) for x in (log_new, log_old, log_mu, adv)]
    padded[0] = padded[0].clone().requires_grad_(True)
    mask = torch.arange(15) < 12
    loss, stats = policy_loss(*padded, torch.cat([seqs, torch.full((3,), 2)]), cfg, mask)
    loss.backward()
    assert loss.item() == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert torch.isfinite(padded[0].grad).all() and padded[0].grad[12:].eq(0).all()
    assert all(math.isfinite(v) for v in (stats.loss, stats.kl, stats.weight_mean, stats.clip_frac))
