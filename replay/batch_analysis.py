"""Step N's batch scored by the weights the trainer had before the step (π_old), several ways.

    run settings        the run's trainer.router_replay and trainer.precision (what the step used)
    own routing         no router replay: the trainer's own top-k (also gives router agreement)
    bf16                the run's routing setting in bf16 (only when the run trained in fp8)
    sampling version    each token under the weights of the version that sampled it (the mismatch
                        split of runtime/train/mismatch_split.py: numerics vs drift, by `batch_split`,
                        the function the mismatch role logs it with)

Legend: B rows, T positions, L MoE layers, K experts per token, N completion tokens (flattened).
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec
import numpy as np
import torch

from reel.runtime.config.sections import Config
from reel.runtime.train import loss as loss_mod
from reel.runtime.train.batch import Batch
from reel.runtime.train.mismatch_split import WeightsOf, batch_split, sampler_logprobs
from reel.runtime.train.step import TrainState, completion_tokens, scored_tokens, split, token_logprobs


class KL(msgspec.Struct, frozen=True):
    """Estimators of KL(μ ‖ π) from tokens sampled by μ (runtime/train/loss.py mismatch_metrics)."""

    k1: float
    k2: float
    k3: float


class Ratio(msgspec.Struct, frozen=True):
    """π/μ on the sampled tokens."""

    mean: float
    min: float
    max: float
    frac_outside: float = msgspec.field(name="frac_outside_0.5_2")


class Mismatch(NamedTuple):
    kl: KL
    ratio: Ratio


class BatchAnalysis(NamedTuple):
    """Step N's batch scored by the weights after N-1 (before the step updates them)."""

    kl: KL  # run settings
    ratio: Ratio  # run settings
    kl_without_router_replay: KL
    kl_without_fp8_alignment: KL | None
    router_agreement: list[float]  # per MoE layer; empty when the batch has no routing
    log_ratio_N: np.ndarray  # log π_old - log μ per completion token (run settings)
    tokens: int
    kl_numerics: KL | None  # KL(μ ‖ π_v), π_v the sampling version; None without its weights
    kl_drift: KL | None  # KL(π_v ‖ π_old)
    logp_old_N: torch.Tensor  # log π_old per completion token (run settings)
    kl_numerics_without_router_replay: KL | None  # KL(μ ‖ π_v) with the trainer's own routing (R3 runs)
    kl_numerics_without_fp8_alignment: KL | None  # KL(μ ‖ π_v) with a bf16 trainer (fp8 runs)
    split: dict[str, float] | None = None  # the split's figures (mismatch_split.SPLIT_KEYS), as MismatchSplit logs them


@torch.no_grad()
def analyse_batch(state: TrainState, batch: Batch, config: Config,
                  weights_of: WeightsOf | None = None) -> BatchAnalysis:
    """Score `batch` with the state's weights in the micro-batches train_step uses (same bits as its π_old);
    with `weights_of`, also each token under its sampling version's weights (the numerics/drift split)."""
    cfg = config.trainer
    model = state.model
    model.train()  # the mode train_step scores π_old in
    parts = split(batch, cfg.micro_batch_tokens)
    logp_mu_N = completion_tokens(parts, "logp_mu_BT")
    replay = cfg.router_replay and batch.routing_BTLK is not None

    def score(precision: str, router_replay: bool, with_routing: bool = False):
        model.precision = precision
        outs = [token_logprobs(model, sub, router_replay=router_replay, with_routing=with_routing)
                for _, sub in parts]
        logp_N = torch.cat([o.logp_BT[sub.loss_mask_BT] for o, (_, sub) in zip(outs, parts)])
        return logp_N, [o.routing_BTLK for o in outs]

    try:
        logp_N, own_routing_BTLK = score(cfg.precision, replay, with_routing=not replay)
        own_logp_N = logp_N
        if replay:
            own_logp_N, own_routing_BTLK = score(cfg.precision, False, with_routing=True)
        bf16_logp_N = score("bf16", replay)[0] if cfg.precision == "fp8" else None
        model.precision = cfg.precision
        split_figures, numerics_free, numerics_bf16 = None, None, None
        if weights_of is not None:
            versions_N = completion_tokens(parts, "versions_BT")

            def numerics(precision: str, router_replay: bool, current_N: torch.Tensor):
                """Each token under its sampling version's weights (runtime/train/mismatch_split.py)."""
                model.precision = precision
                return sampler_logprobs(model, lambda m: scored_tokens(m, parts, router_replay), current_N,
                                        versions_N, state.step, weights_of)

            # What the mismatch role computes and logs (MismatchSplit), by the same function.
            split_figures = batch_split(model, parts, logp_N, state.step, weights_of, replay).figures
            # The counterfactuals without drift: what routing and precision do at the sampler's own weights.
            if replay:
                numerics_free = _kl_on(*numerics(cfg.precision, False, own_logp_N), logp_mu_N)
            if bf16_logp_N is not None:
                numerics_bf16 = _kl_on(*numerics("bf16", replay, bf16_logp_N), logp_mu_N)
    finally:
        model.precision = cfg.precision
    run_settings = mismatch(logp_N, logp_mu_N)
    return BatchAnalysis(
        kl=run_settings.kl, ratio=run_settings.ratio,
        kl_without_router_replay=mismatch(own_logp_N, logp_mu_N).kl,
        kl_without_fp8_alignment=None if bf16_logp_N is None else mismatch(bf16_logp_N, logp_mu_N).kl,
        router_agreement=router_agreement(own_routing_BTLK, [sub for _, sub in parts]),
        log_ratio_N=(logp_N - logp_mu_N).numpy(), tokens=batch.tokens,
        kl_numerics=split_kl(split_figures, "numerics"), kl_drift=split_kl(split_figures, "drift"),
        logp_old_N=logp_N, kl_numerics_without_router_replay=numerics_free,
        kl_numerics_without_fp8_alignment=numerics_bf16, split=split_figures,
    )


def _kl_on(logp_N: torch.Tensor, known_N: torch.Tensor, logp_mu_N: torch.Tensor) -> KL | None:
    if not bool(known_N.any()):
        return None
    return mismatch(logp_N[known_N], logp_mu_N[known_N]).kl


def split_kl(split: dict[str, float] | None, part: str) -> KL | None:
    if split is None or not split["split_tokens"]:
        return None
    return KL(split[f"{part}_k1"], split[f"{part}_k2"], split[f"{part}_k3"])


def mismatch(logp_N: torch.Tensor, logp_mu_N: torch.Tensor) -> Mismatch:
    k1, k2, k3, mean, low, high, outside = (loss_mod.mismatch_metrics(logp_N, logp_mu_N)[k]
                                            for k in loss_mod.MISMATCH_KEYS)
    return Mismatch(KL(k1, k2, k3), Ratio(mean, low, high, outside))


def router_agreement(own: list[torch.Tensor | None], subs: list[Batch]) -> list[float]:
    """Per MoE layer, the share of real tokens whose top-k expert set equals the logged one."""
    if any(o is None for o in own) or any(sub.routing_BTLK is None for sub in subs):
        return []  # no MoE layer, or a group without its trace
    same_NL = torch.cat([
        (o.sort(-1).values == sub.routing_BTLK.sort(-1).values).all(-1)[sub.attention_mask_BT.bool()]
        for o, sub in zip(own, subs)
    ])
    return same_NL.float().mean(0).tolist()
