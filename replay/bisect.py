"""`reel replay bisect`: find the first step where a run went wrong, then say why.

1. From the log alone (no re-execution): the first committed step whose logged metric crosses the
   threshold (`--above X` / `--below X`). Any StepCommitted.metrics key works, plus `loss`,
   `grad_norm` and `staleness_mean`.
2. Re-execute a window of steps around it (`--before` steps before, `--after` after; each checked
   bitwise against its commit) and measure, per step, the causes of train/inference mismatch:

       staleness   policy drift KL(π_v ‖ π_old): what the updates since sampling moved
       routing     |KL without router replay - KL with it|: what routing changes
       numerics    KL(μ ‖ π_v): engine vs trainer at the sampling version's weights
       tail        share of tokens with importance ratio π_old/μ outside [0.5, 2]

   plus each step's own update size, KL(π_old ‖ π_new) on its batch: the step whose update the
   drift at the crossing comes from (`culprit_update`) is the largest of those before it.
3. Rank the causes by how much each grew at the crossing against the steps before it in the
   window: growth = (at crossing + ε) / (baseline + ε), with ε = 1% of the KL k3 at the crossing
   for the KL causes and 1% of tokens for the tail, so a cause under 1% of the mismatch it would
   explain cannot rank first by growing from nothing. A crossing at the window's first step has no
   baseline: causes are then ranked by their value.

The KL figures are k3 estimates in nats per token.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import msgspec

from reel.bus.errors import ReelError
from reel.bus.events import StepCommitted
from reel.replay.analysis import OnStep, Run, reproduces, timed_step
from reel.replay.batch_analysis import analyse_batch, mismatch
from reel.runtime.train.batch import build_batch
from reel.runtime.train.step import scored_tokens, split

CAUSES = ("staleness", "routing", "numerics", "tail")
STEP_FIGURES = ("loss", "grad_norm", "staleness_mean")  # metrics kept on StepCommitted itself


class BisectError(ReelError):
    """A bisect request the run cannot answer (unknown metric, no threshold)."""


class StepCauses(msgspec.Struct, kw_only=True):
    """One re-executed step of the window."""

    step: int
    logged: float | None  # the bisected metric as logged
    bitwise: bool  # the re-execution reproduced the commit
    kl_k3: float  # KL(μ ‖ π_old), run settings
    staleness: float | None  # drift k3; None when the sampling versions' weights are not in the log
    routing: float
    numerics: float | None
    numerics_without_fp8_alignment: float | None  # numerics counterfactual of fp8 runs (bf16 trainer)
    tail: float
    ratio_max: float
    update_k3: float  # KL(π_old ‖ π_new) of this step's update, on its batch
    staleness_mean: float


class Cause(msgspec.Struct, kw_only=True):
    name: str
    at_crossing: float | None
    baseline: float | None  # mean over the window's steps before the crossing
    growth: float | None


class BisectReport(msgspec.Struct, kw_only=True):
    metric: str
    direction: Literal["above", "below"]
    threshold: float
    first_crossing: int | None
    value: float | None  # the logged metric at the crossing
    culprit_update: int | None  # the step before the crossing whose update moved the policy most
    causes: list[Cause]  # ranked, most likely first
    window: list[StepCauses]
    logged: list[tuple[int, float | None]]  # every committed step's metric (for the plot)


def logged_value(commit: StepCommitted, metric: str) -> float | None:
    if metric == "staleness_mean":
        tokens = sum(commit.staleness.values())
        return sum(k * v for k, v in commit.staleness.items()) / tokens if tokens else 0.0
    if metric in STEP_FIGURES:
        return float(getattr(commit, metric))
    return commit.metrics.get(metric)


def first_crossing(logged: list[tuple[int, float | None]], threshold: float, above: bool) -> int | None:
    for step, value in logged:
        if value is not None and (value > threshold if above else value < threshold):
            return step
    return None


class Located(NamedTuple):
    logged: list[tuple[int, float | None]]  # every committed step's metric
    crossing: int | None
    first: int  # the window to re-execute (empty when there is no crossing)
    last: int


def locate(run: Run, metric: str, threshold: float, *, above: bool, before: int, after: int) -> Located:
    """Step 1 of the module doc: the first crossing and its window, from the log alone."""
    if not run.commits:
        raise BisectError(f"{run.run_dir} has no committed step to bisect")
    if before < 0 or after < 0:
        raise BisectError(f"--before {before} and --after {after} must be >= 0")
    logged = [(s, logged_value(run.commits[s], metric)) for s in sorted(run.commits)]
    if all(v is None for _, v in logged):
        known = sorted({*STEP_FIGURES, *(k for c in run.commits.values() for k in c.metrics)})
        raise BisectError(f"metric {metric!r} is not logged by {run.run_dir}; use one of {', '.join(known)}")
    crossing = first_crossing(logged, threshold, above)
    if crossing is None:
        return Located(logged, None, 1, 0)
    return Located(logged, crossing, max(min(run.commits), crossing - before), min(max(run.commits), crossing + after))


def bisect(run: Run, metric: str, threshold: float, *, above: bool, before: int = 3, after: int = 1,
           on_step: OnStep | None = None) -> BisectReport:
    logged, crossing, first, last = locate(run, metric, threshold, above=above, before=before, after=after)
    direction: Literal["above", "below"] = "above" if above else "below"
    if crossing is None:
        return BisectReport(metric=metric, direction=direction, threshold=threshold, first_crossing=None,
                            value=None, culprit_update=None, causes=[], window=[], logged=logged)
    run.require(first, last, why=f" (of the window {first}..{last} around step {crossing})")
    window = reexecute_window(run, first, last, metric, on_step)
    earlier = [w for w in window if w.step < crossing]
    at = next(w for w in window if w.step == crossing)
    culprit = max(earlier, key=lambda w: w.update_k3).step if earlier else None
    return BisectReport(metric=metric, direction=direction, threshold=threshold, first_crossing=crossing,
                        value=at.logged, culprit_update=culprit, causes=rank_causes(at, earlier),
                        window=window, logged=logged)


def reexecute_window(run: Run, first: int, last: int, metric: str, on_step: OnStep | None) -> list[StepCauses]:
    run.prepare()
    state, _ = run.state_before(first, on_step)
    cfg = run.config.trainer
    rows = []
    for step in range(first, last + 1):
        commit = run.commits[step]
        batch = build_batch(run.lookup.groups_of(commit))
        analysis = analyse_batch(run.unsharded(state), batch, run.config, run.weights.get)
        state, result, _ = timed_step(state, commit, run)
        replay = cfg.router_replay and batch.routing_BTLK is not None
        logp_new_N = scored_tokens(state.model, split(batch, cfg.micro_batch_tokens), replay)
        fp8 = analysis.kl_without_fp8_alignment
        rows.append(StepCauses(
            step=step, logged=logged_value(commit, metric), bitwise=reproduces(commit, result),
            kl_k3=analysis.kl.k3, staleness=analysis.kl_drift.k3 if analysis.kl_drift else None,
            routing=abs(analysis.kl_without_router_replay.k3 - analysis.kl.k3),
            numerics=analysis.kl_numerics.k3 if analysis.kl_numerics else None,
            numerics_without_fp8_alignment=fp8.k3 if fp8 else None,
            tail=analysis.ratio.frac_outside, ratio_max=analysis.ratio.max,
            update_k3=mismatch(logp_new_N, analysis.logp_old_N).kl.k3,
            staleness_mean=logged_value(commit, "staleness_mean") or 0.0,
        ))
        if on_step is not None:
            on_step(step)
    return rows


def rank_causes(at: StepCauses, earlier: list[StepCauses]) -> list[Cause]:
    causes = []
    for name in CAUSES:
        value = getattr(at, name)
        values = [getattr(w, name) for w in earlier if getattr(w, name) is not None]
        baseline = sum(values) / len(values) if values else None
        eps = 0.01 if name == "tail" else 0.01 * at.kl_k3
        growth = None
        if value is not None and baseline is not None:
            growth = (value + eps) / (baseline + eps) if baseline + eps > 0 else None
        causes.append(Cause(name=name, at_crossing=value, baseline=baseline, growth=growth))
    # Growth first; without a baseline, by value (KL causes before the tail share).
    return sorted(causes, key=lambda c: (c.growth is None, -(c.growth or 0.0), c.name == "tail",
                                         -(c.at_crossing or 0.0)))
