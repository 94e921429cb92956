"""Re-execute logged training steps from the run's log and measure train/inference mismatch.

Reads the log, the blob store, config.toml and init/ of a run directory; never the bus. A step is
re-executed with the trainer's own `train_step` from the newest checkpoint before it
(runtime/train/reexecute.py), then compared with its StepCommitted. Before the step runs, its batch is
scored by the same weights the trainer had (π_old), several ways (replay/batch_analysis.py), and
the numerics/drift split is compared with the one the run logged: its MismatchSplit event (the
mismatch role's, consumers/mismatch.py), or, in logs from before that role, StepCommitted.metrics.

A step runs on the world size it was trained on (StepCommitted.world_size; `reel replay` starts
that many ranks). On another world size it cannot land on the same bits: the report then gives
how far it lands instead (max |Δweight| against the logged weights, the loss difference).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
import msgspec
import numpy as np

from reel.bus.blob_backends.file import BlobStore
from reel.bus.errors import ReelError
from reel.bus.events import CheckpointsPruned, MismatchSplit, StepCommitted
from reel.bus.run_log import RunLog
from reel.replay.batch_analysis import KL, BatchAnalysis, Ratio, analyse_batch, split_kl
from reel.replay.pruned import pruned_checkpoints, require_replayable, without_pruned
from reel.replay.versions import Versions
from reel.runtime.train import loss as loss_mod
from reel.runtime.train.batch import build_batch
from reel.runtime.config.sections import Config
from reel.runtime.train.groups import GroupLookup
from reel.runtime.train.distributed import LOCAL
from reel.runtime.config.run import load_run_config
from reel.runtime.train.mismatch_split import SPLIT_KEYS
from reel.runtime.model.determinism import set_determinism
from reel.runtime.model.model import MoEModel
from reel.runtime.model.weights import load_state_dict_bytes
from reel.replay.integrity import tampering_note
from reel.runtime.train.reexecute import ReplayMismatch, catch_up, check_reproduced, checkpoint_before
from reel.runtime.train.step import StepResult, TrainState
from reel.runtime.train.trainer_group import TrainerGroup
from reel.runtime.weights.digest import scheme_of

OnStep = Callable[[int], None]


class StepNotLogged(ReelError):
    """A step that the run's log does not hold."""


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
    kl_numerics: KL | None = None  # the split of `kl`: engine vs trainer at the sampling version's weights
    kl_drift: KL | None = None  # ... and the sampling version vs π_old (staleness)
    # The counterfactuals at the sampling version's weights (no drift in them): the honest R3 / FP8 effect.
    kl_numerics_without_router_replay: KL | None = None
    kl_numerics_without_fp8_alignment: KL | None = None
    ranks: int = 1  # world size of this re-execution
    recorded_ranks: int = 1  # world size the run trained the step on
    max_weight_diff: float | None = None  # max |Δweight| vs the logged weights (re-executed on another world size)
    # Steps re-executed for this report, step N included: from the checkpoint up to N, and to re-derive
    # sampling versions whose weights retention deleted (replay/versions.py), each checked by weight hash.
    reexecuted_steps: int = 0
    # Where the run logged this step's split: "event" (MismatchSplit), "metrics" (StepCommitted, logs from
    # before the mismatch role), "" (none: mismatch.every skipped it, the role was off or had not caught up).
    split_logged: str = ""
    split_equal: bool | None = None  # the recomputed split equals the logged one to the bit (None: none logged)


class Recomputed(msgspec.Struct, kw_only=True):
    bitwise: bool
    mismatch: str | None  # why not bitwise, None when bitwise
    kl: KL
    kl_without_router_replay: KL
    kl_without_fp8_alignment: KL | None
    router_agreement_mean: float | None
    kl_numerics: KL | None = None
    kl_drift: KL | None = None
    kl_numerics_without_router_replay: KL | None = None
    kl_numerics_without_fp8_alignment: KL | None = None


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
    kl_numerics: KL | None = None  # logged split (MismatchSplit, or the commit's metrics in older logs)
    kl_drift: KL | None = None


class Run:
    """A run directory opened for reading: config, commits by step, groups, blobs."""

    run_dir: Path
    config: Config
    blobs: BlobStore
    commits: dict[int, StepCommitted]  # without the checkpoints retention deleted
    pruned: dict[int, CheckpointsPruned]  # checkpoint step -> the event that says it was deleted
    splits: dict[int, MismatchSplit]  # the mismatch role's events by step
    lookup: GroupLookup
    weights: Versions  # policy version -> its published weights (re-derived where retention deleted them)
    damage: str  # where the log is damaged ("" when it is not): steps after it cannot be replayed
    group: TrainerGroup  # the ranks that re-execute (one process unless `reel replay` started more)

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.config = load_run_config(run_dir)
        self.blobs = BlobStore(run_dir / "blobs")
        # A damaged log still replays the steps whose inputs lie before the damage (bus/log.py).
        with RunLog(run_dir, readonly=True, valid_prefix=True) as run_log:
            steps = [e for _, e in run_log.events("steps")]
            self.pruned = pruned_checkpoints(run_log)  # checkpoints retention deleted (replay/pruned.py)
            self.commits = without_pruned({e.step: e for e in steps if isinstance(e, StepCommitted)}, self.pruned)
            self.splits = {e.step: e for e in steps if isinstance(e, MismatchSplit)}
            self.lookup = GroupLookup.from_log(run_log, self.blobs)
            self.weights = Versions((e for _, e in run_log.events("weights")), self.blobs, self.commits,
                                    lambda: self.lookup, self.config, lambda: self.group, pruned=set(self.pruned))
            damage = run_log.damage() | self.lookup.index.damage
            self.damage = "; ".join(str(exc) for exc in damage.values())
        if self.damage:
            self.lookup.why_missing = f"the log is damaged: {self.damage}; `reel log repair` keeps what is before it"
        self.group = TrainerGroup(LOCAL, run_dir, self.config)

    def logged_split(self, step: int) -> tuple[str, dict[str, float] | None]:
        """(where, figures) of step `step`'s logged split; see StepReport.split_logged."""
        if step in self.splits:
            return "event", self.splits[step].figures
        metrics = self.commits[step].metrics
        if "split_tokens" in metrics:
            return "metrics", {key: metrics[key] for key in SPLIT_KEYS if key in metrics}
        return "", None

    def same_world(self, step: int) -> bool:
        """Whether this re-execution runs on the world size the run trained `step` on."""
        return self.commits[step].world_size == self.group.world.size

    def require(self, first: int, last: int, *, why: str = "") -> None:
        """Every commit first..last is logged, else one sentence naming the available range."""
        for step in range(first, last + 1):
            if step not in self.commits:
                held = f"steps {min(self.commits)}..{max(self.commits)}" if self.commits else "no committed step"
                damaged = f" (the log is damaged: {self.damage}; `reel log repair` keeps what is before it)" \
                    if self.damage else ""
                raise StepNotLogged(f"step {step}{why} is not in the log of {self.run_dir}, which holds {held}{damaged}")

    def prepare(self) -> None:
        """The trainer's numerics: its thread count (CPU reductions split by thread; the trainer
        takes it from trainer.threads, never the environment) and deterministic kernels."""
        threads = self.config.trainer.threads or 1
        set_determinism(self.config.run.seed, threads=threads)

    def state_before(self, step: int, on_step: OnStep | None = None) -> tuple[TrainState, int]:
        """(the state after step-1, the step of the checkpoint it was rebuilt from; 0 = init).

        The steps between the checkpoint and step-1 are re-executed and checked: one that does not
        reproduce its commit raises ReplayMismatch naming the config hash or code version; a step
        whose every earlier checkpoint retention deleted raises CheckpointPruned naming the one it needs."""
        require_replayable(self.commits, self.pruned, step)
        base = self.group.restore(*checkpoint_before(self.commits, step - 1, self.blobs))
        self.require(base.step + 1, step - 1, why=f" (needed to rebuild step {step})")
        check = all(self.same_world(s) for s in range(base.step + 1, step))
        try:
            state = catch_up(base, self.commits, step - 1, self.lookup, self.config, on_step,
                             step_fn=self.group.step, check=check)
        except ReplayMismatch as exc:
            if note := tampering_note(self.run_dir):  # a changed file, not a non-deterministic machine
                raise ReplayMismatch(f"{exc}; {note}") from exc
            raise
        return state, base.step

    def unsharded(self, state: TrainState) -> TrainState:
        """`state` with a one-process copy of its model (what the batch analysis scores with)."""
        if not self.group.world.distributed:
            return state
        model = MoEModel(state.model.config, self.config.trainer.precision)
        load_state_dict_bytes(model, self.group.weights(state))
        return TrainState(model, state.optimizer, state.step)

    def weight_diff(self, step: int, weights: bytes) -> float | None:
        """max |Δ| between `weights` and the weights the run published after `step` (None: retention
        deleted that version, and another number of ranks cannot re-derive it)."""
        from safetensors.torch import load

        published = self.weights.get(step)
        if published is None:
            return None
        mine, logged = load(weights), load(published)
        return max(float((mine[k] - logged[k]).abs().max()) for k in logged)


def replay_step(run: Run, step: int, on_step: OnStep | None = None) -> tuple[StepReport, BatchAnalysis]:
    """Re-execute step `step` and analyse its batch; a step that does not reproduce is bitwise false."""
    run.require(step, step)
    run.prepare()
    commit = run.commits[step]
    derived_before = run.weights.reexecuted
    state, restored_from = run.state_before(step, on_step)
    analysis = analyse_batch(run.unsharded(state), build_batch(run.lookup.groups_of(commit)), run.config,
                             run.weights.get)
    state, result, seconds = timed_step(state, commit, run)
    if on_step is not None:
        on_step(step)
    weights_match = result.weights_sha256 == commit.weights_sha256
    mismatch, weight_diff = None, None
    ranks = run.group.world.size
    if not run.same_world(step):
        weight_diff = run.weight_diff(step, run.group.weights(state))
        diff = "unknown (that version is no longer stored)" if weight_diff is None else f"{weight_diff:.3e}"
        mismatch = (f"re-executed on {ranks} rank(s), the run trained on {commit.world_size}: max |Δweight| "
                    f"{diff}, loss differs by {result.loss - commit.loss:+.3e} (expected: the batch "
                    f"is split and summed differently)")
    else:
        mismatch = mismatch_reason(commit, result, run)
    bitwise = mismatch is None
    cfg = run.config.trainer
    split_logged, logged_figures = run.logged_split(step)
    report = StepReport(
        step=step, bitwise=bitwise, mismatch=mismatch, loss=result.loss, logged_loss=commit.loss,
        grad_norm=result.grad_norm, logged_grad_norm=commit.grad_norm, weights_sha256_match=weights_match,
        kl=analysis.kl, kl_without_router_replay=analysis.kl_without_router_replay,
        kl_without_fp8_alignment=analysis.kl_without_fp8_alignment, ratio=analysis.ratio,
        staleness=dict(result.staleness), router_agreement=analysis.router_agreement, tokens=analysis.tokens,
        replay_seconds=seconds, original_seconds=commit.timing.compute, restored_from=restored_from,
        router_replay=cfg.router_replay, precision=cfg.precision, ranks=ranks, recorded_ranks=commit.world_size,
        max_weight_diff=weight_diff, reexecuted_steps=step - restored_from + run.weights.reexecuted - derived_before,
        kl_numerics=analysis.kl_numerics, kl_drift=analysis.kl_drift,
        kl_numerics_without_router_replay=analysis.kl_numerics_without_router_replay,
        kl_numerics_without_fp8_alignment=analysis.kl_numerics_without_fp8_alignment,
        split_logged=split_logged, split_equal=None if logged_figures is None else logged_figures == analysis.split,
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
    rows = [_logged_row(run.commits[s], run.logged_split(s)[1]) for s in range(first, last + 1)]
    if not recompute:
        return rows
    run.prepare()
    state, _ = run.state_before(first, on_step)
    for i, step in enumerate(range(first, last + 1)):
        commit = run.commits[step]
        analysis = analyse_batch(run.unsharded(state), build_batch(run.lookup.groups_of(commit)), run.config,
                                 run.weights.get)
        state, result, _ = timed_step(state, commit, run)
        agreement = analysis.router_agreement
        mismatch = mismatch_reason(commit, result, run)
        rows[i].recomputed = Recomputed(
            bitwise=mismatch is None, mismatch=mismatch, kl=analysis.kl,
            kl_without_router_replay=analysis.kl_without_router_replay,
            kl_without_fp8_alignment=analysis.kl_without_fp8_alignment,
            router_agreement_mean=float(np.mean(agreement)) if agreement else None,
            kl_numerics=analysis.kl_numerics, kl_drift=analysis.kl_drift,
            kl_numerics_without_router_replay=analysis.kl_numerics_without_router_replay,
            kl_numerics_without_fp8_alignment=analysis.kl_numerics_without_fp8_alignment)
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


def timed_step(state: TrainState, commit: StepCommitted, run: Run) -> tuple[TrainState, StepResult, float]:
    # Timed like the trainer's compute: its groups are in memory already (read from the log here,
    # untimed), then batch assembly and train_step.
    groups = run.lookup.groups_of(commit)
    started = time.perf_counter()
    batch = build_batch(groups)
    state, result = run.group.step(state, batch, digest=scheme_of(commit.weights_sha256))
    return state, result, time.perf_counter() - started


def _logged_row(commit: StepCommitted, split: dict[str, float] | None) -> RangeRow:
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
        kl_numerics=split_kl(split, "numerics"), kl_drift=split_kl(split, "drift"),
    )
