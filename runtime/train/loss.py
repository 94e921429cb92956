"""RL objectives and train/inference mismatch metrics, as small pure functions on flat tokens.

Shape suffixes:
    G  GRPO groups in the batch
    S  samples per group
    N  completion tokens of all samples in the batch, concatenated (flat; padding allowed)
    B  samples (sequences) in the batch; `seq_index_N` maps each token to its sample
    V  vocabulary

Three policies meet here. μ is the inference engine that sampled the tokens (its logprobs are in
the Trajectory event), π_old is the trainer's policy before this batch's update (a no-grad
forward of the same weights μ should have had; it differs through numerics, FP8, routing and
staleness), π_θ is the policy being optimised. The importance weight w = π_old/μ corrects for
sampling from μ; the PPO ratio π_θ/π_old is clipped so several optimizer steps on one batch stay
near π_old. On the first optimizer step π_θ = π_old and the clip is inert.

Normalisation: the loss is a token mean over the batch — the sum over every unmasked token
divided by the number of unmasked tokens, including tokens an objective zeroes (IcePop, MIS), so
rejecting tokens shrinks the gradient instead of up-weighting the survivors. Long and short
samples weigh by their token counts. A batch split into micro-batches scales each micro-batch's
loss by its share of the batch's tokens.

Masks: `mask_N` (bool or 0/1, None = every token counts) selects the tokens that count; masked
positions may hold anything, padding included, without turning a result into NaN.
"""

from __future__ import annotations

import msgspec
import torch
from torch import Tensor

from reel.runtime.config.sections import Objective, TrainerSection

# Mismatch metrics report the share of tokens whose ratio π_old/μ falls outside this band.
RATIO_BAND = (0.5, 2.0)


class LossConfig(msgspec.Struct, frozen=True, kw_only=True):
    objective: Objective = "tis"  # tis | icepop | mis | none: how w = π_old/μ enters the loss
    tis_cap: float = 2.0  # tis: w = min(w, tis_cap)
    icepop_low: float = 0.5  # icepop: w = 0 outside [icepop_low, icepop_high]
    icepop_high: float = 5.0
    mis_low: float = 0.5  # mis: a sample whose geometric-mean w is outside [mis_low, mis_high]
    mis_high: float = 2.0  #      is dropped whole
    clip_eps: float = 0.2  # PPO: π_θ/π_old clipped to [1 - clip_eps, 1 + clip_eps]
    kl_coef: float = 0.0  # weight of the k3 penalty KL(π_old ‖ π_θ); 0 = off
    ratio_clamp: float = 20.0  # log ρ clamped to ±ratio_clamp before exp (verl's bound): loss stays finite
    dual_clip: float = 3.0  # A < 0: the per-token loss is capped at dual_clip·|A| (Ye et al. 2020); 0 = off

    @classmethod
    def from_trainer(cls, t: TrainerSection) -> LossConfig:
        return cls(objective=t.objective, tis_cap=t.tis_cap, icepop_low=t.icepop_low,
                   icepop_high=t.icepop_high, mis_low=t.mis_low, mis_high=t.mis_high,
                   clip_eps=t.clip_eps, kl_coef=t.kl_coef, ratio_clamp=t.ratio_clamp, dual_clip=t.dual_clip)


class LossStats(msgspec.Struct, frozen=True):
    """What one policy_loss call did, as plain floats (token means over its unmasked tokens)."""

    loss: float  # the returned loss
    pg_loss: float  # the policy-gradient part
    kl: float  # k3 estimate of KL(π_old ‖ π_θ), before kl_coef
    clip_frac: float  # share of tokens where the PPO clip removed the gradient
    weight_mean: float  # mean importance weight after capping/masking
    weight_capped_frac: float  # tis: share of tokens whose weight was capped
    weight_zero_frac: float  # icepop/mis: share of tokens whose weight was zeroed
    tokens: float  # unmasked tokens in this call


def grpo_advantages(rewards_GS: Tensor, eps: float = 1e-6) -> Tensor:
    """(r - group mean) / (group std + eps) in float32; a group whose rewards are all equal gets zeros.

    The statistics are computed in float64 and a constant group is zeroed explicitly: a reward that
    is not exact in binary (0.1, 0.7) has a float32 mean one rounding step off, and std ≈ 1e-8
    against eps = 1e-6 would push every sample of a group that carries no signal by up to ±0.1.
    """
    rewards_GS = rewards_GS.double()
    mean_G1 = rewards_GS.mean(dim=1, keepdim=True)
    # Population std (correction=0): defined for any group size, including groups of one.
    std_G1 = rewards_GS.std(dim=1, keepdim=True, correction=0)
    constant_G1 = rewards_GS.amax(dim=1, keepdim=True) == rewards_GS.amin(dim=1, keepdim=True)
    advantages_GS = torch.where(constant_G1, 0.0, (rewards_GS - mean_G1) / (std_G1 + eps))
    return advantages_GS.float()


def importance_weights(logp_old_N: Tensor, logp_mu_N: Tensor, seq_index_N: Tensor, cfg: LossConfig,
                       mask_N: Tensor | None = None) -> Tensor:
    """w = π_old/μ per token as the objective uses it (no gradient flows through it).

    tis: min(w, tis_cap). icepop: w inside [icepop_low, icepop_high], else 0. none: 1.
    mis: per sample the geometric-mean ratio w̄ = exp(mean log w) over its unmasked tokens; every
    token of the sample gets w̄ when w̄ is inside [mis_low, mis_high] and 0 otherwise. Using w̄
    rather than each token's own w keeps the weight bounded by mis_high.
    """
    keep_N = _keep(mask_N, logp_old_N)
    log_w_N = torch.where(keep_N, (logp_old_N - logp_mu_N).detach().float(), 0.0)
    if cfg.objective == "none":
        return torch.ones_like(log_w_N)
    if cfg.objective == "tis":
        return log_w_N.exp().clamp(max=cfg.tis_cap)
    if cfg.objective == "icepop":
        w_N = log_w_N.exp()
        return torch.where((w_N >= cfg.icepop_low) & (w_N <= cfg.icepop_high), w_N, torch.zeros_like(w_N))
    if cfg.objective == "mis":
        ones_N = keep_N.float()
        num_seqs = int(seq_index_N.max()) + 1 if seq_index_N.numel() else 0
        sum_B = log_w_N.new_zeros(num_seqs).index_add_(0, seq_index_N, log_w_N)
        count_B = log_w_N.new_zeros(num_seqs).index_add_(0, seq_index_N, ones_N)
        geo_B = (sum_B / count_B.clamp(min=1)).exp()
        keep_B = (geo_B >= cfg.mis_low) & (geo_B <= cfg.mis_high)
        return torch.where(keep_B, geo_B, torch.zeros_like(geo_B))[seq_index_N]
    raise ValueError(f"unknown objective {cfg.objective!r}; use tis, icepop, mis or none")


def policy_loss(logp_new_N: Tensor, logp_old_N: Tensor, logp_mu_N: Tensor, advantages_N: Tensor,
                seq_index_N: Tensor, cfg: LossConfig, mask_N: Tensor | None = None) -> tuple[Tensor, LossStats]:
    """Token-mean loss  w · L_pg + kl_coef · w · k3,  ρ = π_θ/π_old = exp(clamp(log ρ, ±ratio_clamp)).

    L_pg = -min(ρA, clip(ρ, 1±ε)A), and for A < 0 with dual_clip = c > 0: min(L_pg, -cA), so a token
    whose ratio ran far past the clip on a later optimizer step costs at most c·|A| (dual-clip PPO).
    logp_new_N carries the gradient; logp_old_N, logp_mu_N and advantages_N are constants.

    Both terms are expectations under π_old, estimated from μ's samples, so both carry w. The KL
    penalty is k3 = ρ - 1 - log ρ, an unbiased estimate of KL(π_old ‖ π_θ) from π_old's samples:
    TRPO's trust region. The anchor is π_old, not μ, because μ may be several versions stale and
    pulling toward it would undo training; so the penalty only acts when optimizer_steps > 1
    (on the first step ρ = 1, where k3 and its gradient are zero).
    """
    keep_N = _keep(mask_N, logp_new_N)
    mask_N = keep_N.to(logp_new_N.dtype)
    tokens = mask_N.sum()
    n = tokens.clamp(min=1)
    w_N = importance_weights(logp_old_N, logp_mu_N, seq_index_N, cfg, keep_N).to(logp_new_N.dtype)
    # Masked before anything multiplies it: NaN · 0 is NaN, so junk at padding would reach the loss.
    adv_N = torch.where(keep_N, advantages_N.detach().to(logp_new_N.dtype), 0.0)

    log_ratio_N = torch.where(keep_N, logp_new_N - logp_old_N.detach(), 0.0)
    log_ratio_N = log_ratio_N.clamp(-cfg.ratio_clamp, cfg.ratio_clamp)
    ratio_N = log_ratio_N.exp()
    unclipped_N = ratio_N * adv_N
    clipped_N = ratio_N.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps) * adv_N
    pg_N = -torch.minimum(unclipped_N, clipped_N)
    if cfg.dual_clip:
        pg_N = torch.where(adv_N < 0, torch.minimum(pg_N, -cfg.dual_clip * adv_N), pg_N)
    pg_loss = (w_N * pg_N * mask_N).sum() / n
    kl = (w_N * (torch.expm1(log_ratio_N) - log_ratio_N) * mask_N).sum() / n
    loss = pg_loss + cfg.kl_coef * kl if cfg.kl_coef else pg_loss

    with torch.no_grad():
        clipped_frac = ((clipped_N < unclipped_N) * mask_N).sum() / n
        capped_N = torch.where(keep_N, logp_old_N - logp_mu_N, 0.0).exp() > cfg.tis_cap
        capped_frac = (capped_N * mask_N).sum() / n if cfg.objective == "tis" else n.new_zeros(())
        zero_frac = ((w_N == 0) * mask_N).sum() / n if cfg.objective in ("icepop", "mis") else n.new_zeros(())
        values = torch.stack([loss.detach(), pg_loss.detach(), kl.detach(), clipped_frac,
                              (w_N * mask_N).sum() / n, capped_frac, zero_frac, tokens]).tolist()  # one sync
    return loss, LossStats(*values)


MISMATCH_KEYS = ("kl_k1", "kl_k2", "kl_k3", "ratio_mean", "ratio_min", "ratio_max", "ratio_frac_outside")


def mismatch_metrics(logp_old_N: Tensor, logp_mu_N: Tensor, mask_N: Tensor | None = None,
                     entropy_N: Tensor | None = None) -> dict[str, float]:
    """How far inference (μ) is from the trainer (π_old) on the sampled tokens.

    With r = π_old/μ and tokens sampled from μ: kl_k1 = -log r, kl_k2 = ½(log r)²,
    kl_k3 = r - 1 - log r, each averaged over unmasked tokens, estimate KL(μ ‖ π_old) (k1 and k3
    unbiased, k3 ≥ 0 per token, k2 biased with low variance). Also r's mean/min/max, the share of
    tokens with r outside RATIO_BAND, `entropy` = mean of entropy_N (π_old's per-token entropy)
    when given, and `tokens`. With no unmasked token every figure is 0.
    """
    keep_N = _keep(mask_N, logp_old_N)
    log_r = (logp_old_N.detach().float() - logp_mu_N.detach().float())[keep_N]
    names = [*MISMATCH_KEYS, "entropy"] if entropy_N is not None else list(MISMATCH_KEYS)
    if log_r.numel() == 0:
        return dict.fromkeys(names, 0.0) | {"tokens": 0.0}
    r = log_r.exp()
    lo, hi = RATIO_BAND
    stats = [(-log_r).mean(), (0.5 * log_r.square()).mean(), (torch.expm1(log_r) - log_r).mean(),
             r.mean(), r.min(), r.max(), ((r < lo) | (r > hi)).float().mean()]
    if entropy_N is not None:
        stats.append(entropy_N.detach().float()[keep_N].mean())
    return dict(zip(names, torch.stack(stats).tolist())) | {"tokens": float(log_r.numel())}


def staleness_histogram(versions_N: Tensor, step: int, mask_N: Tensor | None = None) -> dict[int, int]:
    """{step - version: tokens}: how many policy versions behind each unmasked token was sampled.

    The trainer passes `step` = the version of the weights it is about to update (steps done so
    far), so 0 means on-policy and `trainer.max_off_policy_steps` bounds exactly this number."""
    behind = step - versions_N[_keep(mask_N, versions_N)].long()
    values, counts = torch.unique(behind, sorted=True, return_counts=True)
    return dict(zip(values.tolist(), counts.tolist()))


def _keep(mask_N: Tensor | None, like_N: Tensor) -> Tensor:
    return torch.ones_like(like_N, dtype=torch.bool) if mask_N is None else mask_N.bool()
