"""The training step as a pure function: `train_step(state, batch, config) -> StepResult`.

The trainer, `reel replay` and `reel retrain` all call this one function, so a logged step can be
re-executed bit for bit: the result depends only on (weights, optimizer state, batch, config,
seed), with deterministic algorithms and a fixed thread count set at the start of every step.
On N ranks (runtime/train/distributed.py) each rank runs its share of the micro-batches and every
figure it returns (loss, grad norm, metrics, weight hash) is the global one.

Legend: B rows, T positions, V vocabulary, N completion tokens of the batch (flattened by mask).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import msgspec
import torch
import torch.nn.functional as F

from reel.runtime.train import loss as loss_mod
from reel.runtime.train.batch import Batch, MicroBatch, micro_batches, take
from reel.runtime.config.sections import Config, TrainerSection
from reel.runtime.train.distributed import (LOCAL, World, all_sum, clip_grad_norm, full_state_dict, gather_tokens, plan,
                                 sync_gradients)
from reel.runtime.train.finite import check_update, check_weights
from reel.runtime.model.context_parallel import sequence_shard, with_context_parallel
from reel.runtime.model.determinism import set_determinism
from reel.runtime.model.model import MoEModel
from reel.runtime.model.weights import state_dict_bytes, state_dict_to_bytes
from reel.runtime.weights.digest import PIECES, weights_digest


class TrainState(NamedTuple):
    model: MoEModel
    optimizer: torch.optim.AdamW
    step: int  # steps done; the weights are policy version `step`


class StepResult(msgspec.Struct, frozen=True):
    loss: float
    grad_norm: float
    weights_sha256: str  # the new weights' digest (runtime/weights/digest.py); "" on ranks > 0
    metrics: dict[str, float]
    staleness: dict[int, int]
    # Wall seconds of the step's phases (StepTiming's score_old, forward_backward, optimizer): timed, never
    # part of what a replay compares.
    phases: dict[str, float] = {}


class PhaseClock:
    """Wall seconds per named phase: `lap(name)` adds the time since the previous lap to `name`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._last
        self._last = now


def make_optimizer(model: MoEModel, cfg: TrainerSection) -> torch.optim.AdamW:
    # foreach=False: the single-tensor path is the deterministic reference on every device.
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                             betas=(0.9, 0.999), eps=1e-8, foreach=False)


def weights_sha256(model: MoEModel) -> str:
    """sha256 of `state_dict_bytes(model)`, streamed tensor by tensor (never one buffer)."""
    return weights_digest(model, LOCAL)


class TokenLogprobs(NamedTuple):
    logp_BT: torch.Tensor
    entropy_BT: torch.Tensor
    routing_BTLK: torch.Tensor | None
    aux_loss: torch.Tensor | None


def token_logprobs(model: MoEModel, batch: Batch, *, router_replay: bool, with_routing: bool = False,
                   aux_loss: bool = False, position_ids_BT: torch.Tensor | None = None) -> TokenLogprobs:
    """log pi(target) under logits / temperature (the distribution the engine sampled from).

    `position_ids_BT`: `batch` is a context-parallel slice (runtime/model/context_parallel.py) with
    these positions, attended by position only (what ring attention takes)."""
    replay = batch.routing_BTLK if router_replay else None
    out = model(batch.input_ids_BT, batch.attention_mask_BT, position_ids_BT=position_ids_BT,
                is_causal=position_ids_BT is not None, replay_routing_BTLK=replay,
                return_routing=with_routing, aux_loss=aux_loss)
    logits_BTV = out.logits.float() / batch.temperature_B[:, None, None]
    logprobs_BTV = F.log_softmax(logits_BTV, dim=-1)
    logp_BT = logprobs_BTV.gather(-1, batch.targets_BT[:, :, None]).squeeze(-1)
    entropy_BT = -(logprobs_BTV.exp() * logprobs_BTV).sum(-1)
    return TokenLogprobs(logp_BT, entropy_BT.detach(), out.routing, out.aux_loss)


# Per completion token: π_old's logprob and entropy, μ's logprob, the policy version that sampled it.
TOKEN_DTYPES = (torch.float32, torch.float32, torch.float32, torch.int64)


def completion_of(old: TokenLogprobs, piece: Batch) -> tuple[torch.Tensor, ...]:
    """The TOKEN_DTYPES fields of the completion tokens of `piece` (a micro-batch, or its CP slice)."""
    mask_BT = piece.loss_mask_BT
    return old.logp_BT[mask_BT], old.entropy_BT[mask_BT], piece.logp_mu_BT[mask_BT], piece.versions_BT[mask_BT]


MicroBatchParts = list[tuple[MicroBatch, Batch]]


def split(batch: Batch, max_tokens: int) -> MicroBatchParts:
    """The step's micro-batches with their sub-batches (replay scores with the same ones)."""
    return [(mb, take(batch, mb)) for mb in micro_batches(batch, max_tokens)]


def completion_tokens(parts: MicroBatchParts, field: str) -> torch.Tensor:
    """One per-position field of every micro-batch, flattened to completion tokens in micro-batch order."""
    return torch.cat([getattr(sub, field)[sub.loss_mask_BT] for _, sub in parts])


def scored_tokens(model: MoEModel, parts: MicroBatchParts, router_replay: bool) -> torch.Tensor:
    """log π(token) of every completion token, in micro-batch order, at the model's precision (no grad)."""
    with torch.no_grad():
        return torch.cat([token_logprobs(model, sub, router_replay=router_replay).logp_BT[sub.loss_mask_BT]
                          for _, sub in parts])


def train_step(state: TrainState, batch: Batch, config: Config, world: World = LOCAL, *,
               digest: str = PIECES) -> tuple[TrainState, StepResult]:
    """One RL step. `digest`: the weights digest's scheme on N ranks (runtime/weights/digest.py; a replay
    passes the one its log names). Nothing here depends on the rollout's lag: the mismatch split of
    older tokens is the mismatch role's (consumers/mismatch.py), off the trainer's critical path."""
    cfg = config.trainer
    world = with_context_parallel(world, cfg.context_parallel)
    step = state.step + 1
    set_determinism(config.run.seed * 1_000_003 + step, threads=torch.get_num_threads())
    model, optimizer = state.model, state.optimizer
    model.precision = cfg.precision
    model.train()
    loss_cfg = loss_mod.LossConfig.from_trainer(cfg)
    local = plan(batch, cfg.micro_batch_tokens, world).local
    total_tokens = max(1, batch.tokens)
    clock = PhaseClock()

    # pi_old: the trainer's logprobs before any update, the reference of every importance weight;
    # with the logged fields of the same tokens (this rank's slice of them under CP), in one order.
    olds, counted = [], []
    with torch.no_grad():
        for _, sub, counts in local:
            with sequence_shard(world, sub) as (piece, positions_BT):
                olds.append(token_logprobs(model, piece, router_replay=cfg.router_replay, position_ids_BT=positions_BT))
            if counts:
                counted.append(completion_of(olds[-1], piece))
    columns = list(zip(*counted)) or [()] * 4
    mine = [torch.cat(c) if c else torch.zeros(0, dtype=d) for c, d in zip(columns, TOKEN_DTYPES)]
    logp_old_N, entropy_N, logp_mu_N, versions_N = (gather_tokens(world, t) for t in mine)
    clock.lap("score_old")

    for group in optimizer.param_groups:
        group["lr"] = cfg.lr * (cfg.lr_spike_factor if step == cfg.lr_spike_step else 1.0)
    loss_total, grad_norm = 0.0, 0.0
    for _ in range(cfg.optimizer_steps):
        optimizer.zero_grad(set_to_none=True)
        loss_total, offset = 0.0, 0
        for i, (mb, sub, counts) in enumerate(local):
            with sequence_shard(world, sub) as (piece, positions_BT):
                mask_BT = piece.loss_mask_BT
                n = int(mask_BT.sum()) if counts else 0
                current = token_logprobs(model, piece, router_replay=cfg.router_replay,
                                         aux_loss=cfg.aux_loss_coef > 0, position_ids_BT=positions_BT)
                row_index_BT = mb.rows_M[:, None].expand_as(mask_BT)
                old_N = mine[0][offset:offset + n] if counts else olds[i].logp_BT[mask_BT]
                loss, _ = loss_mod.policy_loss(
                    logp_new_N=current.logp_BT[mask_BT], logp_old_N=old_N,
                    logp_mu_N=piece.logp_mu_BT[mask_BT], advantages_N=piece.advantages_BT[mask_BT],
                    seq_index_N=row_index_BT[mask_BT], cfg=loss_cfg,
                )
                if current.aux_loss is not None:  # load balancing on the router's full scores
                    loss = loss + cfg.aux_loss_coef * current.aux_loss
                # Each micro-batch's token-mean is reweighted to its share of the step's tokens, so
                # accumulation (and the sum across ranks) equals one pass over the whole batch. A
                # filler pass (counts False) keeps the ranks' collectives paired and adds zero.
                sync_gradients(model, i == len(local) - 1)
                (loss * (n / total_tokens)).backward()
            loss_total += float(loss.detach()) * n / total_tokens
            offset += n
        loss_total = all_sum(world, loss_total)
        clock.lap("forward_backward")
        grad_norm = clip_grad_norm(model, cfg.max_grad_norm)
        check_update(step, loss_total, grad_norm, model)
        optimizer.step()
        clock.lap("optimizer")
    check_weights(step, model, world)
    clock.lap("optimizer")

    metrics = loss_mod.mismatch_metrics(logp_old_N, logp_mu_N, None, entropy_N)
    metrics["reward_mean"] = float(batch.rewards_B.mean())
    metrics["tokens"] = float(batch.tokens)
    metrics["router_replay"] = float(cfg.router_replay and batch.routing_BTLK is not None)  # R3 applied, per step
    # Staleness = versions between a token's sampler and the weights this step trains (0 = on-policy).
    staleness = loss_mod.staleness_histogram(versions_N, state.step)
    new_state = TrainState(model, optimizer, step)
    return new_state, StepResult(loss=loss_total, grad_norm=grad_norm, weights_sha256=weights_digest(model, world, digest),
                                 metrics=metrics, staleness=staleness, phases=clock.seconds)


def full_weights(model: MoEModel, world: World) -> bytes:
    """`state_dict_bytes` of the whole model: a collective on N ranks, b"" on ranks > 0."""
    if not world.distributed:
        return state_dict_bytes(model)
    full = full_state_dict(model)
    return state_dict_to_bytes(full, model.config) if world.rank == 0 else b""
