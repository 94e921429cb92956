"""Split the train/inference mismatch into numerics and policy drift.

The logged mismatch KL(μ ‖ π_old) mixes two things once rollouts run ahead of the trainer
(async_level ≥ 1): μ sampled a token under policy version v, π_old is version `step`, so the
figure holds the engine's numerics *and* the v → step updates. Scoring the batch again with the
trainer at each token's own sampling version π_v separates them:

    numerics   KL(μ ‖ π_v)      engine vs trainer at the same weights (precision, routing, kernels)
    drift      KL(π_v ‖ π_old)  what the updates since sampling moved (staleness)

both estimated on the tokens μ sampled (k1, k2, k3 as in loss.mismatch_metrics). A token generated
after an in-flight weight swap is attributed to the version that generated it, so the effect of a
KV cache computed by the older weights lands in `numerics`. Tokens whose version's weights are not
available are left out of both (`split_tokens` counts the rest).

It is computed beside the trainer, never in its step (consumers/mismatch.py publishes it as a
MismatchSplit event; logs before that event hold it in StepCommitted.metrics), and recomputed by
`reel replay step N` with the same function, `batch_split`.

Legend: N completion tokens of the batch in micro-batch order (train_step's order).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from reel.bus.blobs import BlobBackend, BlobMissing
from reel.bus.events import AnyEvent, BlobRef, WeightsPublished
from reel.runtime.train import loss as loss_mod
from reel.runtime.model.model import MoEModel
from reel.runtime.model.weights import load_state_dict_bytes
from reel.runtime.config.sections import TrainerSection
from reel.runtime.train.batch import Batch
from reel.runtime.train.step import MicroBatchParts, completion_tokens, scored_tokens, split
from reel.runtime.weights.load import version_bytes

# version -> the weights blob's bytes (state_dict_bytes), None when that version is not known
WeightsOf = Callable[[int], bytes | None]

SPLIT_KEYS = ("numerics_k1", "numerics_k2", "numerics_k3", "drift_k1", "drift_k2", "drift_k3", "split_tokens")


class WeightHistory:
    """Published policy weights by version, read from the blob store on demand; the last few stay in memory."""

    refs: dict[int, BlobRef]
    formats: dict[int, str]
    _cache: OrderedDict[int, bytes]

    def __init__(self, blobs: BlobBackend, keep: int = 4):
        self.blobs = blobs
        self.keep = max(1, keep)
        self.refs = {}
        self.formats = {}
        self._cache = OrderedDict()

    @classmethod
    def from_events(cls, events: Iterable[AnyEvent], blobs: BlobBackend, keep: int = 4) -> WeightHistory:
        history = cls(blobs, keep)
        for event in events:
            if isinstance(event, WeightsPublished):
                history.add(event.version, event.weights, event.format)
        return history

    def add(self, version: int, ref: BlobRef, fmt: str = "safetensors") -> None:
        """`fmt`: the WeightsPublished.format of `ref`."""
        self.refs[version] = ref
        self.formats[version] = fmt

    def get(self, version: int) -> bytes | None:
        if version in self._cache:
            self._cache.move_to_end(version)
            return self._cache[version]
        ref = self.refs.get(version)
        if ref is None:
            return None
        try:
            data = version_bytes(self.blobs, ref, self.formats[version])
        except BlobMissing:  # deleted by retention (bus/retention.py): only older than any trained token
            return None
        self._cache[version] = data
        while len(self._cache) > self.keep:
            self._cache.popitem(last=False)
        return data


@torch.no_grad()
def sampler_logprobs(model: MoEModel, score: Callable[[MoEModel], torch.Tensor], logp_old_N: torch.Tensor,
                     versions_N: torch.Tensor, current: int,
                     weights_of: WeightsOf) -> tuple[torch.Tensor, torch.Tensor]:
    """(log π_v of each token under its own sampling version v, mask of the tokens that have one).

    `score(m)` is log m(token) for every token, computed exactly as π_old was (micro-batches,
    precision, router replay), so against π_old only the weights differ. Tokens of the current
    version reuse logp_old_N; other versions are scored by a copy of `model` with their weights."""
    logp_N = logp_old_N.clone()
    known_N = torch.ones_like(versions_N, dtype=torch.bool)
    scratch: MoEModel | None = None
    for version in torch.unique(versions_N).tolist():
        if version == current:
            continue
        at_N = versions_N == version
        data = weights_of(version)
        if data is None:
            known_N &= ~at_N
            continue
        if scratch is None:
            scratch = copy.deepcopy(model)
            scratch.zero_grad(set_to_none=True)
        load_state_dict_bytes(scratch, data)
        logp_N = torch.where(at_N, score(scratch), logp_N)
    return logp_N, known_N


def split_metrics(logp_old_N: torch.Tensor, logp_sampler_N: torch.Tensor, logp_mu_N: torch.Tensor,
                  known_N: torch.Tensor) -> dict[str, float]:
    """numerics_k* = KL(μ ‖ π_v), drift_k* = KL(π_v ‖ π_old), on the tokens in known_N; see the module doc."""
    numerics = loss_mod.mismatch_metrics(logp_sampler_N, logp_mu_N, known_N)
    drift = loss_mod.mismatch_metrics(logp_old_N, logp_sampler_N, known_N)
    out = {f"numerics_{k}": numerics[f"kl_{k}"] for k in ("k1", "k2", "k3")}
    out |= {f"drift_{k}": drift[f"kl_{k}"] for k in ("k1", "k2", "k3")}
    out["split_tokens"] = numerics["tokens"]
    return out


class Split(NamedTuple):
    figures: dict[str, float]  # SPLIT_KEYS
    versions: list[int]  # the older versions the batch was scored with
    missing: list[int]  # older versions whose weights are gone (their tokens are left out)


def batch_split(model: MoEModel, parts: MicroBatchParts, logp_old_N: torch.Tensor, current: int,
                weights_of: WeightsOf, router_replay: bool) -> Split:
    """The split of a batch whose π_old (`model`, policy version `current`) scored `logp_old_N`."""
    logp_mu_N = completion_tokens(parts, "logp_mu_BT")
    versions_N = completion_tokens(parts, "versions_BT")
    sampler_N, known_N = sampler_logprobs(model, lambda m: scored_tokens(m, parts, router_replay), logp_old_N,
                                          versions_N, current, weights_of)
    older = [v for v in torch.unique(versions_N).tolist() if v != current]
    missing = [v for v in older if not bool(known_N[versions_N == v].any())]
    return Split(split_metrics(logp_old_N, sampler_N, logp_mu_N, known_N),
                 [v for v in older if v not in missing], missing)


@torch.no_grad()
def step_split(model: MoEModel, batch: Batch, cfg: TrainerSection, current: int, weights_of: WeightsOf) -> Split:
    """The split of the batch of step current + 1, `model` holding policy version `current`: π_old scored
    exactly as train_step scores it (the trainer's micro-batches and precision, train mode, router replay)."""
    model.train()
    model.precision = cfg.precision
    parts = split(batch, cfg.micro_batch_tokens)
    replay = cfg.router_replay and batch.routing_BTLK is not None
    return batch_split(model, parts, scored_tokens(model, parts, replay), current, weights_of, replay)
