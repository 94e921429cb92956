"""The timeline of `reel report`: trainer phases tile each step, workers' counters fill their intervals,
idle shows as idle, and older logs (no phases, no tool/idle counters) still draw."""

from __future__ import annotations

from pathlib import Path

import pytest

from reel.bus.events import StepCommitted, StepTiming, WorkerStats
from reel.replay.timeline import TRAINER_PHASES, png, segments, svg


def _commit(step: int, timing: StepTiming) -> StepCommitted:
    return StepCommitted(run="r", producer="trainer:0", seq=step, step=step, version=step, groups=[], dropped=[],
                         loss=0.0, grad_norm=0.0, weights_sha256="", timing=timing)


def _stats(seq: int, busy: float, tool: float = 0.0, idle: float = 0.0) -> WorkerStats:
    return WorkerStats(run="r", producer="rollout:0", seq=seq, worker="rollout-0", tokens_per_s=0.0, running=0,
                       waiting=0, policy_version=0, groups_published=0, busy_s=busy, tool_wait_s=tool, idle_s=idle)


def test_trainer_phases_tile_each_step_and_workers_fill_their_intervals(tmp_path: Path) -> None:
    phased = StepTiming(wait=0.5, compute=1.0, publish=0.25, score_old=0.2, forward_backward=0.5, optimizer=0.125,
                        commit=0.125)
    commits = [("10000-0", _commit(1, phased)), ("12000-0", _commit(2, StepTiming(wait=1.0, compute=0.5, publish=0.5)))]
    stats = [("10000-0", _stats(0, busy=1.0, tool=0.5, idle=0.5)), ("12000-0", _stats(1, busy=2.0, tool=1.5, idle=0.5))]
    segs = segments(commits, stats)
    first = [s for s in segs if s.lane == "trainer" and s.step == 1]
    assert [s.phase for s in first] == list(TRAINER_PHASES)
    assert all(a.end == b.start for a, b in zip(first, first[1:])) and first[-1].end == 10.0
    assert first[-1].end - first[0].start == pytest.approx(0.125 + 0.5 + 1.0 + 0.25)
    assert {s.phase: s.end - s.start for s in first}["other"] == pytest.approx(1.0 - 0.2 - 0.5 - 0.125)
    old = {s.phase: s.end - s.start for s in segs if s.step == 2}  # an older log: compute is all "other"
    assert old["other"] == 0.5 and old["score_old"] == 0.0 and old["commit"] == 0.0
    worker = {s.phase: s.end - s.start for s in segs if s.lane == "rollout-0"}
    assert worker == pytest.approx({"busy": 1.0, "tool_wait": 1.0, "idle": 0.0})  # 2 s between the stats
    unrecorded = segments([], [("10000-0", _stats(0, busy=1.0)), ("14000-0", _stats(1, busy=2.0))])
    assert {s.phase: s.end - s.start for s in unrecorded} == pytest.approx({"busy": 1.0, "tool_wait": 0.0, "idle": 3.0})
    page = svg(segs)
    assert page.startswith('<svg class="chart"') and "step 1 wait" in page and "rollout-0 tool_wait" in page
    png(segs, tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
