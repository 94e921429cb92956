"""What a sink writes: the scalar figures of a committed step and of an eval result, by name.

Every figure comes from the event itself (no wall clock, no interleaving with other streams), so a
sink that backfills from the log and one that followed the live bus write the same values.
"""

from __future__ import annotations

from reel.bus.events import EvalResult, MismatchSplit, StepCommitted
from reel.consumers.aggregates import drop_reason_code, idle_share

EVAL_PREFIX = "eval/"
SPLIT_PREFIX = "mismatch/"  # the mismatch role's figures (MismatchSplit): they lag the trainer, like evals
SPLIT_STEP_KEY = "mismatch/step"  # W&B: their own x axis
EVAL_STEP_KEY = "eval/step"  # W&B: the eval charts' own x axis (evals run behind the trainer)


def step_points(event: StepCommitted) -> dict[str, float]:
    """The figures of one committed step: loss, grad norm, the trainer's metrics (reward, the KL
    split, ...), the staleness histogram and mean, trainer tokens/s, idle share and dropped groups."""
    points = {"loss": event.loss, "grad_norm": event.grad_norm, "version": float(event.version),
              "groups": float(len(event.groups)), "dropped": float(len(event.dropped))}
    points.update({key: float(value) for key, value in event.metrics.items()})
    for reason in {drop_reason_code(d.reason) for d in event.dropped}:
        points[f"dropped/{reason}"] = float(sum(drop_reason_code(d.reason) == reason for d in event.dropped))
    tokens = sum(event.staleness.values())
    for behind, count in event.staleness.items():
        points[f"staleness/{behind}"] = float(count)
    if tokens:
        points["staleness_mean"] = sum(k * n for k, n in event.staleness.items()) / tokens
    wall = event.timing.wait + event.timing.compute + event.timing.publish
    if tokens and wall > 0:
        points["tokens_per_s"] = tokens / wall
    share = idle_share(event.timing)
    if share is not None:
        points["idle_share"] = share
    t = event.timing
    points.update({"time/wait": t.wait, "time/compute": t.compute, "time/publish": t.publish})
    if t.score_old or t.forward_backward or t.optimizer:  # the phases of compute, in logs that have them
        points.update({"time/score_old": t.score_old, "time/forward_backward": t.forward_backward,
                       "time/optimizer": t.optimizer, "time/commit": t.commit})
    return points


def split_points(event: MismatchSplit) -> dict[str, float]:
    """The numerics/drift split of one step and how far behind the trainer the role computed it."""
    points = {**event.figures, "lag_steps": float(event.lag_steps), "lag_s": event.lag_s}
    return {SPLIT_PREFIX + key: float(value) for key, value in points.items()}


def eval_points(event: EvalResult) -> dict[str, float]:
    """The scores of one eval result, under eval/ (logged at the trainer step of the version)."""
    points = {"mean_reward": event.mean_reward, "pass_at_1": event.pass_at_1,
              "pass_at_k": event.pass_at_k, "version": float(event.version)}
    points.update({f"task/{task}": value for task, value in event.per_task.items()})
    return {EVAL_PREFIX + key: float(value) for key, value in points.items()}
