"""Re-execute logged training steps from the run's log and measure train/inference mismatch.

Reads the log, the blob store, config.toml and init/ of a run directory; never the bus. A step is
re-executed with the trainer's own `train_step` from the newest checkpoint before it
(runtime/reexecute.py), then compared with its StepCommitted. Before the step runs, its batch is
scored by the same weights the trainer had (π_old), three ways:

    run settings        the run's trainer.router_replay and trainer.precision (what the step used)
    own routing         no router replay: the trainer's own top-k (also gives router agreement)
    bf16                the run's routing setting in bf16 (only when the run trained in fp8)

Legend: B rows, T positions, L MoE layers, K experts per token, N completion tokens (flattened).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import msgspec
import numpy as np
import torch

from bus.blob_backends.file import BlobStore
from bus.errors import ReelError
from bus.events import StepCommitted
from bus.log import RunLog
from runtime import loss as loss_mod
from runtime.batch import Batch, build_batch
from runtime.config import Config
from runtime.groups import GroupLookup
from runtime.launch import load_run_config
from runtime.model.determinism import set_determinism
from runtime.reexecute import ReplayMismatch, catch_up, check_reproduced, restore_state
from runtime.train_step import StepResult, TrainState, completion_tokens, split, token_logprobs, train_step

OnStep = Callable[[int], None]


class StepNotLogged(ReelError):
    """A step that the run's log does not hold."""


class KL(msgspec.Struct, frozen=True):
    """Estimators of KL(μ ‖ π) from tokens sampled by μ (runtime/loss.py mismatch_metrics)."""

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


class StepReport(msgspec.Struct, kw_only=True):
    """What `reel replay step N --json` prints."""

    step: int
    bitwise: bool  # loss, grad norm and weight hash all equal the commit's
    mismatch: str | None  # why not bitwise (config hash, code version), None when bitwise
    loss: float
    logged_loss: float
    grad_norm: float
    logged_grad_norm: float
    weights_sha256_match: bool
    kl: KL
    kl_without_router_replay: KL
    kl_without_fp8_alignment: KL | None
    ratio: Ratio
    staleness: dict[int, int]  # versions behind -> completion tokens
    router_agreement: list[float]  # per MoE layer: share of tokens whose own top-k set = logged one
    tokens: int
    replay_seconds: float  # batch assembly + train_step of step N, as the trainer times it (not the log reads)
    original_seconds: float  # StepCommitted.timing.compute
    restored_from: int  # the checkpoint's step (0 = the initial policy)
    router_replay: bool
    precision: str


class Recomputed(msgspec.Struct, kw_only=True):
    bitwise: bool
    mismatch: str | None  # why not bitwise, None when bitwise
    kl: KL
    kl_without_router_replay: KL
    kl_without_fp8_alignment: KL | None
    router_agreement_mean: float | None


class RangeRow(msgspec.Struct, kw_only=True):
    """One step of `reel replay range`: logged figures, plus recomputed ones with --recompute."""

    step: int
    loss: float
    grad_norm: float
    reward_mean: float | None
    kl: KL | None
    ratio: Ratio | None
    staleness: dict[int, int]
    staleness_mean: float
    tokens: int
    dropped: int
    recomputed: Recomputed | None = None


class Run:
    """A run directory opened for reading: config, commits by step, groups, blobs."""

    run_dir: Path
    config: Config
    blobs: BlobStore
    commits: dict[int, StepCommitted]
    lookup: GroupLookup

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.config = load_run_config(run_dir)
        self.blobs = BlobStore(run_dir / "blobs")
        with RunLog(run_dir, readonly=True) as run_log:
            self.commits = {e.step: e for _, e in run_log.events("steps") if isinstance(e, StepCommitted)}
            self.lookup = GroupLookup.from_log(run_log, self.blobs)

    def require(self, first: int, last: int, *, why: str = "") -> None:
        """Every commit first..last is logged, else one sentence naming the available range."""
        for step in range(first, last + 1):
            if step not in self.commits:
                held = f"steps {min(self.commits)}..{max(self.commits)}" if self.commits else "no committed step"
                raise StepNotLogged(f"step {step}{why} is not in the log of {self.run_dir}, which holds {held}")

    def prepare(self) -> None:
        """The trainer's numerics: its thread count (CPU reductions split by thread; the trainer
        takes it from trainer.threads, never the environment) and deterministic kernels."""
        threads = self.config.trainer.threads or 1
        set_determinism(self.config.run.seed, threads=threads)

    def state_before(self, step: int, on_step: OnStep | None = None) -> tuple[TrainState, int]:
        """(the state after step-1, the step of the checkpoint it was rebuilt from; 0 = init).

        The steps between the checkpoint and step-1 are re-executed and checked: one that does not
        reproduce its commit raises ReplayMismatch naming the config hash or code version."""
        base = restore_state(self.run_dir, self.config, self.blobs, self.commits, step - 1)
        self.require(base.step + 1, step - 1, why=f" (needed to rebuild step {step})")
        return catch_up(base, self.commits, step - 1, self.lookup, self.config, on_step), base.step


def replay_step(run: Run, step: int, on_step: OnStep | None = None) -> tuple[StepReport, BatchAnalysis]:
    """Re-execute step `step` and analyse its batch; a step that does not reproduce is bitwise false."""
    run.require(step, step)
    run.prepare()
    commit = run.commits[step]
    state, restored_from = run.state_before(step, on_step)
    analysis = analyse_batch(state, build_batch(run.lookup.groups_of(commit)), run.config)
    state, result, seconds = _timed_step(state, commit, run)
    if on_step is not None:
        on_step(step)
    weights_match = result.weights_sha256 == commit.weights_sha256
    mismatch = mismatch_reason(commit, result, run)
    bitwise = mismatch is None
    cfg = run.config.trainer
    report = StepReport(
        step=step, bitwise=bitwise, mismatch=mismatch, loss=result.loss, logged_loss=commit.loss,
        grad_norm=result.grad_norm, logged_grad_norm=commit.grad_norm, weights_sha256_match=weights_match,
        kl=analysis.kl, kl_without_router_replay=analysis.kl_without_router_replay,
        kl_without_fp8_alignment=analysis.kl_without_fp8_alignment, ratio=analysis.ratio,
        staleness=dict(result.staleness), router_agreement=analysis.router_agreement, tokens=analysis.tokens,
        replay_seconds=seconds, original_seconds=commit.timing.compute, restored_from=restored_from,
        router_replay=cfg.router_replay, precision=cfg.precision,
    )
    return report, analysis


def replay_range(run: Run, first: int, last: int, *, recompute: bool,
                 on_step: OnStep | None = None) -> list[RangeRow]:
    """Per-step figures of first..last from the commits; `recompute` re-executes them too.

    Steps before `first` must reproduce (ReplayMismatch otherwise); within the range a step that
    does not is marked bitwise false and the next ones continue from its re-executed weights."""
    if first > last:
        raise StepNotLogged(f"range {first}..{last} is empty; write A..B with A <= B")
    run.require(first, last, why=f" (of the range {first}..{last})")
    rows = [_logged_row(run.commits[s]) for s in range(first, last + 1)]
    if not recompute:
        return rows
    run.prepare()
    state, _ = run.state_before(first, on_step)
    for i, step in enumerate(range(first, last + 1)):
        commit = run.commits[step]
        analysis = analyse_batch(state, build_batch(run.lookup.groups_of(commit)), run.config)
        state, result, _ = _timed_step(state, commit, run)
        agreement = analysis.router_agreement
        mismatch = mismatch_reason(commit, result, run)
        rows[i].recomputed = Recomputed(
            bitwise=mismatch is None, mismatch=mismatch, kl=analysis.kl,
            kl_without_router_replay=analysis.kl_without_router_replay,
            kl_without_fp8_alignment=analysis.kl_without_fp8_alignment,
            router_agreement_mean=float(np.mean(agreement)) if agreement else None)
        if on_step is not None:
            on_step(step)
    return rows


def mismatch_reason(commit: StepCommitted, result: StepResult, run: Run) -> str | None:
    """Why a re-executed step differs from its commit (config hash, code version), None when bitwise."""
    if reproduces(commit, result):
        return None
    try:
        check_reproduced(commit, result, run.config)
    except ReplayMismatch as exc:
        return str(exc)
    return f"step {commit.step} re-executed to the same weights but a different loss or grad norm"


def reproduces(commit: StepCommitted, result: StepResult) -> bool:
    """Loss, grad norm and weight hash all exactly as committed."""
    return (result.weights_sha256 == commit.weights_sha256 and result.loss == commit.loss
            and result.grad_norm == commit.grad_norm)


def _timed_step(state: TrainState, commit: StepCommitted, run: Run) -> tuple[TrainState, StepResult, float]:
    # Timed like the trainer's compute: its groups are in memory already (read from the log here,
    # untimed), then batch assembly and train_step.
    groups = run.lookup.groups_of(commit)
    started = time.perf_counter()
    batch = build_batch(groups)
    state, result = train_step(state, batch, run.config)
    return state, result, time.perf_counter() - started


@torch.no_grad()
def analyse_batch(state: TrainState, batch: Batch, config: Config) -> BatchAnalysis:
    """Score `batch` with the state's weights in the micro-batches train_step uses (same bits as its π_old)."""
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
    finally:
        model.precision = cfg.precision
    run_settings = mismatch(logp_N, logp_mu_N)
    return BatchAnalysis(
        kl=run_settings.kl, ratio=run_settings.ratio,
        kl_without_router_replay=mismatch(own_logp_N, logp_mu_N).kl,
        kl_without_fp8_alignment=None if bf16_logp_N is None else mismatch(bf16_logp_N, logp_mu_N).kl,
        router_agreement=router_agreement(own_routing_BTLK, [sub for _, sub in parts]),
        log_ratio_N=(logp_N - logp_mu_N).numpy(), tokens=batch.tokens,
    )


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


def _logged_row(commit: StepCommitted) -> RangeRow:
    m = commit.metrics
    k1, k2, k3, mean, low, high, outside = (m.get(k) for k in loss_mod.MISMATCH_KEYS)
    tokens = sum(commit.staleness.values())
    return RangeRow(
        step=commit.step, loss=commit.loss, grad_norm=commit.grad_norm, reward_mean=m.get("reward_mean"),
        kl=KL(k1, k2, k3) if k3 is not None else None,
        ratio=Ratio(mean, low, high, outside) if mean is not None else None,
        staleness=dict(commit.staleness),
        staleness_mean=sum(k * v for k, v in commit.staleness.items()) / tokens if tokens else 0.0,
        tokens=int(m.get("tokens", tokens)), dropped=len(commit.dropped),
    )
