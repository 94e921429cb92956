"""`reel compare RUN_A RUN_B`: two runs side by side, step by step, from their logs.

For a retrain against its source, R3 on against off, or two learning rates: per common step the
batch reward, mismatch KL k3, gradient norm, mean staleness, and whether the weights after the
step are the same (sha256 of the committed weights); the first step whose weights differ is where
the runs part (None: every common step is identical). Where the eval role scored the step's version,
its held-out mean reward and pass@1 (EvalResult) stand beside the training reward.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from reel.bus.errors import ReelError
from reel.bus.events import EvalResult, StepCommitted
from reel.bus.run_log import RunLog


class CompareError(ReelError):
    """Runs that cannot be compared (no committed step in common)."""


class Side(msgspec.Struct, kw_only=True):
    reward: float | None
    kl_k3: float | None
    grad_norm: float
    loss: float
    staleness_mean: float
    eval_reward: float | None = None  # held-out mean reward of the step's version (None: not evaluated)
    eval_pass_at_1: float | None = None


class StepPair(msgspec.Struct, kw_only=True):
    step: int
    a: Side
    b: Side
    same_weights: bool


class Comparison(msgspec.Struct, kw_only=True):
    run_a: str
    run_b: str
    first_differing_step: int | None
    steps: list[StepPair]
    only_in_a: list[int]
    only_in_b: list[int]


def read_commits(run_dir: Path) -> dict[int, StepCommitted]:
    with RunLog(run_dir, readonly=True) as run_log:
        return {e.step: e for _, e in run_log.events("steps") if isinstance(e, StepCommitted)}


def read_evals(run_dir: Path) -> dict[int, EvalResult]:
    """Version -> the eval role's result for it (none when the run had no [eval])."""
    with RunLog(run_dir, readonly=True) as run_log:
        if "control" not in run_log.names():
            return {}
        return {e.version: e for _, e in run_log.events("control") if isinstance(e, EvalResult)}


def side(commit: StepCommitted, evaluated: EvalResult | None = None) -> Side:
    tokens = sum(commit.staleness.values())
    return Side(reward=commit.metrics.get("reward_mean"), kl_k3=commit.metrics.get("kl_k3"),
                grad_norm=commit.grad_norm, loss=commit.loss,
                staleness_mean=sum(k * v for k, v in commit.staleness.items()) / tokens if tokens else 0.0,
                eval_reward=evaluated.mean_reward if evaluated else None,
                eval_pass_at_1=evaluated.pass_at_1 if evaluated else None)


def compare(run_a: Path, run_b: Path) -> Comparison:
    a, b = read_commits(run_a), read_commits(run_b)
    common = sorted(a.keys() & b.keys())
    if not common:
        raise CompareError(f"{run_a} ({len(a)} committed steps) and {run_b} ({len(b)}) have no committed step "
                           "in common; compare runs that both trained")
    eval_a, eval_b = read_evals(run_a), read_evals(run_b)
    pairs = [StepPair(step=s, a=side(a[s], eval_a.get(a[s].version)), b=side(b[s], eval_b.get(b[s].version)),
                      same_weights=a[s].weights_sha256 == b[s].weights_sha256)
             for s in common]
    first = next((p.step for p in pairs if not p.same_weights), None)
    return Comparison(run_a=str(run_a), run_b=str(run_b), first_differing_step=first, steps=pairs,
                      only_in_a=sorted(a.keys() - b.keys()), only_in_b=sorted(b.keys() - a.keys()))
