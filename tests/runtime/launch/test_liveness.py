"""The launcher's liveness check (runtime/launch/liveness.py) on heartbeats written by runtime/heartbeat.py."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec

from reel.runtime.heartbeat import BEAT_SUFFIX, Beat, Heartbeat, read_beats
from reel.runtime.config import run as config_mod
from reel.runtime.launch.liveness import Liveness
from reel.runtime.launch.progress import Progress


def _beat(roles: Path, role: str, beat: Beat) -> None:
    (roles / f"{role}{BEAT_SUFFIX}").write_bytes(msgspec.json.encode(beat))


def test_heartbeats_tell_progress_from_a_loop_that_comes_round(tmp_path: Path):
    beat = Heartbeat(tmp_path / f"trainer{BEAT_SUFFIX}")
    beat.alive("waiting for groups", "0 of 8 for step 1", waiting=True)
    first = read_beats(tmp_path)["trainer"]
    assert first.waiting and first.progress_count == 0
    beat.progress("training", "step 1")
    trained = read_beats(tmp_path)["trainer"]
    assert (trained.phase, trained.progress_count, trained.at) == ("training", 1, trained.progress_at)
    beat.alive("waiting for groups", "0 of 8 for step 2", waiting=True)  # a new phase: written at once
    waiting = read_beats(tmp_path)["trainer"]
    assert waiting.waiting and waiting.progress_at == trained.progress_at and waiting.progress_count == 1
    Heartbeat(None).progress("training")  # no run directory: nothing, no error


def test_a_stalled_role_is_named_once_with_what_waits_on_it_and_again_when_it_moves(tmp_path: Path):
    now = time.time()
    liveness = Liveness(tmp_path, stall_s=10)
    _beat(tmp_path, "rollout-0", Beat("generating", "3 published", now - 30, now - 30, progress_count=3))
    _beat(tmp_path, "trainer", Beat("waiting for groups", "1 of 4 for step 5", now, now - 30, True, 8))
    _beat(tmp_path, "archiver", Beat("waiting for events", "90 logged", now - 1, now - 30, True, 9))
    (line,) = liveness.check(now)
    assert line.startswith("reel: rollout-0 has made no progress for 30 s (since ")
    assert "last: generating, 3 published; bound 10 s, run.stall_s = 10" in line
    assert "waiting meanwhile: archiver: waiting for events, 90 logged; trainer: waiting for groups, 1 of 4" in line
    assert liveness.newly_stalled == ["rollout-0"]
    assert liveness.check(now + 1) == [] and liveness.newly_stalled == []  # named once
    _beat(tmp_path, "rollout-0", Beat("generating", "4 published", now + 2, now + 2, progress_count=4))
    assert liveness.check(now + 2) == ["reel: rollout-0 moves again after 32 s (generating, 4 published)"]


def test_a_role_frozen_while_waiting_is_named_and_a_slow_role_earns_a_longer_bound(tmp_path: Path):
    now = time.time()
    liveness = Liveness(tmp_path, stall_s=10)
    _beat(tmp_path, "archiver", Beat("waiting for events", "", now - 11, now - 100, True, 1))
    assert [line.split(" (")[0] for line in liveness.check(now)] == ["reel: archiver has made no progress for 11 s"]
    # The trainer's steps take 20 s: its bound becomes 5 x 20 s, so a 30 s step is not a stall.
    liveness = Liveness(tmp_path, stall_s=10)  # a new launch: the beats of the last one are gone
    assert read_beats(tmp_path) == {}
    _beat(tmp_path, "trainer", Beat("training", "step 1", now - 60, now - 60, progress_count=1))
    liveness.check(now - 60)
    _beat(tmp_path, "trainer", Beat("training", "step 2", now - 40, now - 40, progress_count=2))
    liveness.check(now - 40)
    assert liveness.bound("trainer") == 100
    _beat(tmp_path, "trainer", Beat("training", "step 3", now - 30, now - 30, progress_count=3))
    assert liveness.check(now) == []
    liveness.forget("trainer")
    assert "trainer" not in read_beats(tmp_path) and liveness.bound("trainer") == 10


def test_the_live_view_says_what_a_quiet_trainer_waits_for(tmp_path: Path):
    progress = Progress("redis://127.0.0.1:1", config_mod.from_dict({}), live=False,
                        work_file=tmp_path / "progress.json")
    assert progress.trainer_doing() is None  # no beat yet
    now = time.time()
    _beat(tmp_path, "trainer", Beat("waiting for groups", "3 of 8 for step 12", now, now - 40, True, 11))
    assert progress.trainer_doing() == "trainer: waiting for groups, 3 of 8 for step 12 (no progress for 40 s)"
    _beat(tmp_path, "trainer", Beat("training", "step 12", now, now - 2, progress_count=12))
    assert progress.trainer_doing() is None  # moving: nothing to say


def test_decide_is_every_launchers_rule_and_a_pools_watcher_sees_only_its_roles(tmp_path: Path):
    now = time.time()
    _beat(tmp_path, "trainer", Beat("training", "step 3", now - 25, now - 25, progress_count=3))
    _beat(tmp_path, "rollout-1", Beat("generating", "", now - 300, now - 300, progress_count=2))  # a last launch's
    pool = Liveness(tmp_path, stall_s=10, only=["rollout-1"])  # one pool task's watcher (a Slurm job)
    assert set(read_beats(tmp_path)) == {"trainer"}  # its own stale beat went, the others' stay
    _beat(tmp_path, "rollout-1", Beat("generating", "", now - 30, now - 30, progress_count=2))
    _beat(tmp_path, "vllm-rollout-0", Beat("generating", "2 requests", now - 30, now - 30, progress_count=2))
    _beat(tmp_path, "eval", Beat("scoring", "", now - 30, now - 30, progress_count=1))
    (line,) = pool.decide(now).lines  # its role only
    assert line.startswith("reel: rollout-1 has made no progress for 30 s")
    assert pool.decide(now).restart == [] and pool.decide(now + 100).stop is None  # named once; the trainer not its
    beats = read_beats(tmp_path)
    job = Liveness(tmp_path, stall_s=10)  # `reel run`, or a Slurm job's own watcher
    for role, beat in beats.items():
        _beat(tmp_path, role, beat)
    verdict = job.decide(now)
    assert len(verdict.lines) == 4  # every stalled role is named; the restartable ones are restarted
    assert verdict.restart == ["rollout-1", "vllm-rollout-0"] and verdict.stop is None
    assert job.decide(now + 11).restart == []  # named once
    assert job.decide(now + 4).stop is None  # the trainer: stalled since now - 25, not yet for 3 bounds (30 s)
    assert job.decide(now + 6).stop == "trainer"  # 31 s: the run stops (the eval role never stops it)
