"""Metrics: rolling aggregates from hand-built events, watchers on a real Redis, exporters."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from bus.events import (
    BlobRef, DroppedGroup, RunFinished, Sample, StepCommitted, StepTiming, Tensor, Trajectory,
    WeightsPublished, WorkerStats,
)
from consumers.aggregates import RunAggregates

_seq = itertools.count()


def _traj(run: str, group_id: str, rewards: list[float], seq: int | None = None) -> Trajectory:
    sample = lambda r: Sample(  # noqa: E731
        tokens=Tensor.from_numpy(np.array([1, 2], np.int32)),
        logprobs=Tensor.from_numpy(np.array([-0.1, -0.2], np.float32)),
        reward=r, finish_reason="stop", seed=0, spans=[(0, 0)],
    )
    return Trajectory(run=run, producer="rollout:0", seq=next(_seq) if seq is None else seq, group_id=group_id,
                      env="reverse_text", prompt=Tensor.from_numpy(np.array([3], np.int32)),
                      samples=[sample(r) for r in rewards], worker="rollout:0")


def _step(run: str, step: int, groups: list[str], *, dropped=(), metrics=None, staleness=None,
          timing=(0.0, 1.0, 0.0)) -> StepCommitted:
    return StepCommitted(run=run, producer="trainer:0", seq=next(_seq), step=step, version=step, groups=groups,
                         dropped=[DroppedGroup(g, r) for g, r in dropped], loss=0.5 / step, grad_norm=float(step),
                         weights_sha256="ab" * 32, timing=StepTiming(*timing), metrics=metrics or {},
                         staleness=staleness or {})


def _weights(run: str, version: int) -> WeightsPublished:
    return WeightsPublished(run=run, producer="trainer:0", seq=next(_seq), version=version, step=version,
                            weights=BlobRef(uri="file:///w", sha256="cd" * 32, nbytes=1))


def _stats(run: str, worker: str, tokens_per_s: float, version: int) -> WorkerStats:
    return WorkerStats(run=run, producer=worker, seq=next(_seq), worker=worker, tokens_per_s=tokens_per_s,
                       running=3, waiting=1, policy_version=version, groups_published=7)


def _synthetic_run(run: str) -> list:
    """Four groups (mean rewards 0.5, 1, 0, 0.5), two steps, two workers, then RunFinished."""
    t1 = _traj(run, "g1", [1.0, 0.0])
    return [
        _weights(run, 0), t1, t1,  # the duplicate delivery must not count
        _traj(run, "g2", [1.0, 1.0]), _traj(run, "g3", [0.0, 0.0]), _traj(run, "g4", [0.5, 0.5]),
        _stats(run, "rollout:0", 10.0, 0),
        _step(run, 1, ["g1", "g2"], dropped=[("g3", "stale"), ("g4", "stale")], staleness={0: 10, 1: 30},
              timing=(1.0, 3.0, 0.0)),
        _weights(run, 1), _weights(run, 2),
        _stats(run, "rollout:0", 100.0, 1), _stats(run, "rollout:1", 50.0, 2),
        _step(run, 2, ["g4"], dropped=[("g9", "off_policy")], staleness={1: 20, 2: 20}, timing=(0.0, 1.0, 1.0),
              metrics={"reward_mean": 0.6, "kl_k1": 0.01, "kl_k3": 0.002, "ratio_mean": 1.01, "other": 5.0}),
        RunFinished(run=run, producer="launcher:0", seq=next(_seq), reason="done"),
    ]


def test_aggregates_hand_checked():
    agg = RunAggregates(window_groups=3, window_steps=20)
    for event in _synthetic_run("r"):
        agg.apply(event)
    agg.set_dead_letters(2)
    s = agg.snapshot()
    assert s.run == "r" and s.finished == "done"
    assert s.groups_seen == 4 and s.groups_trained == 3
    # window = last 3 groups: 1, 0, 0.5 -> mean 0.5, p50 0.5, p90 = 0.5 + 0.8 * 0.5 (linear)
    assert s.window_groups == 3
    assert s.reward_mean == pytest.approx(0.5)
    assert s.reward_p50 == pytest.approx(0.5)
    assert s.reward_p90 == pytest.approx(0.9)
    assert s.step == 2 and s.policy_version == 2
    assert s.step_reward == pytest.approx(0.6)  # the trainer's reward_mean wins
    assert s.loss == pytest.approx(0.25) and s.grad_norm == 2.0
    assert s.mismatch == {"kl_k1": 0.01, "kl_k3": 0.002, "ratio_mean": 1.01}  # missing keys stay missing
    assert s.idle_ratio == pytest.approx(1.0 / 6.0)  # waits 1 + 0 over totals 4 + 2
    assert s.staleness == {0: 10, 1: 50, 2: 20}
    assert s.dropped == {"off_policy": 1, "stale": 2}
    assert s.dead_letters == 2
    assert [(w.worker, w.tokens_per_s, w.version_lag) for w in s.workers] == [("rollout:0", 100.0, 1),
                                                                               ("rollout:1", 50.0, 0)]
    assert s.tokens_per_s == 150.0
    first, second = s.recent_steps
    assert first.reward == pytest.approx(0.75)  # no reward_mean: mean of g1 (0.5) and g2 (1.0)
    assert first.staleness_mean == pytest.approx(0.75)  # (0*10 + 1*30) / 40
    assert first.idle_share == pytest.approx(0.25) and second.idle_share == 0.0
    assert first.dropped == 2 and first.dropped_by_reason == {"stale": 2}
    assert second.staleness_mean == pytest.approx(1.5)


def test_aggregates_empty_and_idle_window():
    s = RunAggregates().snapshot()
    assert s.step is None and s.reward_mean is None and s.reward_p90 is None and s.idle_ratio is None
    assert s.mismatch == {} and s.workers == [] and s.dead_letters is None
    agg = RunAggregates(window_steps=1)
    agg.apply(_step("r", 1, [], timing=(1.0, 1.0, 0.0)))
    agg.apply(_step("r", 2, [], timing=(0.0, 0.0, 0.0)))  # a zero-length step has no idle share
    s = agg.snapshot()
    assert s.idle_ratio is None and s.recent_steps[0].idle_share == 0.5 and s.step_reward is None
