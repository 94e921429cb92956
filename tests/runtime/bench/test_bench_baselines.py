"""The benches' baselines do the work the way Reel does it, so a ratio measures Reel, not a handicap."""

from __future__ import annotations

import os
import time
from pathlib import Path

import orjson
import pytest
import redis

from reel.runtime.bench.common import bus_pipeline as bench
from reel.runtime.launch import cli

FSDP_QUICK_RATIO_FLOOR = 1.3  # 1-process / 2-rank measured peak memory, `reel bench fsdp --quick` on CPU


def test_raw_bus_writer_overlaps_its_fdatasync_with_the_next_read(redis_url: str, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch):
    # 300 events wait; the writer reads at most 256 a round. On a slow disk (the first fdatasync
    # takes 0.5 s) the overlapped writer (the archiver's way) has read the other 44 before it returns.
    key, client = "raw:overlap", redis.Redis.from_url(redis_url)
    for _ in range(300):
        client.xadd(key, {b"e": b"x" * 10})
    real_fdatasync, pending_during_sync = os.fdatasync, []

    def slow_fdatasync(fd: int) -> None:
        if not pending_during_sync:
            time.sleep(0.5)
            pending_during_sync.append(client.xpending(key, "writer")["pending"])
        real_fdatasync(fd)

    monkeypatch.setattr(os, "fdatasync", slow_fdatasync)
    assert bench.raw_read(redis_url, key, "writer", "300", str(tmp_path / "events.bin")) == 0
    assert (tmp_path / "events.bin").stat().st_size == 3000
    assert pending_during_sync == [300]  # in line, the next read would wait: 256
    assert client.xpending(key, "writer")["pending"] == 0


@pytest.mark.slow
def test_bench_fsdp_measures_peak_memory_and_sharding_lowers_it(capsys: pytest.CaptureFixture):
    # Measured (peak RSS above a baseline, per process), not counted: the peak holds more than the
    # parameters, gradients and AdamW state. The floor is docs/benchmarks.md's regression bound for
    # --quick on CPU (measured 1.55-1.68 on 2026-12-02); without sharding the ratio would be ~1.
    assert cli.main(["bench", "fsdp", "--quick"]) == 0
    result = orjson.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["memory"] == "cpu" and result["held_ratio"] == 2.0
    assert result["one_rank_peak_bytes"] > result["one_rank_held_bytes"]
    assert result["two_rank_peak_bytes_per_rank"] > result["two_rank_held_bytes_per_rank"]
    # The peaks in parts: they add up, and each rank saves activations for its half of the batch only.
    one, two = result["one_rank_peak_parts"], result["two_rank_peak_parts_per_rank"]
    assert sum(one.values()) == result["one_rank_peak_bytes"] and sum(two.values()) == result["two_rank_peak_bytes_per_rank"]
    assert 0 < two["activations"] < one["activations"] and two["params"] * 2 >= one["params"]
    assert result["ratio"] >= FSDP_QUICK_RATIO_FLOOR, result


def _allowed_cores(pid: int) -> set[int]:
    return set(os.sched_getaffinity(pid))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning splits at least two cores")
def test_bench_async_pins_trainer_and_rollout_side_to_disjoint_cores(tmp_path: Path):
    from reel.runtime.bench.async_ import PinnedSupervisor, role_cores
    from reel.runtime.config.run import from_dict

    trainer_cores, rollout_cores = role_cores()
    assert trainer_cores and rollout_cores and not trainer_cores & rollout_cores
    assert trainer_cores | rollout_cores == _allowed_cores(0)
    (tmp_path / "roles").mkdir()
    supervisor = PinnedSupervisor(tmp_path, "redis://127.0.0.1:1/0", from_dict({}), live=False)
    before = _allowed_cores(0)
    try:
        for name, role in (("trainer", "trainer"), ("rollout-0", "rollout"), ("archiver", "archiver"),
                           ("mismatch", "mismatch")):
            supervisor._start(name, role)
        pinned = {name: _allowed_cores(p.popen.pid) for name, p in supervisor.roles.items()}
    finally:
        supervisor._stop_all()
    # The mismatch role, at the lowest CPU priority, takes what the rollout side leaves: the trainer's cores stay its own.
    assert pinned == {"trainer": trainer_cores, "rollout-0": rollout_cores, "archiver": rollout_cores,
                      "mismatch": rollout_cores}
    assert _allowed_cores(0) == before  # the bench process itself is left as it was


def test_bench_async_time_to_reward_is_when_each_run_first_reaches_a_shared_target():
    from reel.runtime.bench.async_ import reward_target

    # Both start at 0.1; sync climbs to 0.6 one step per 2 s, async to 0.5 one step per 1 s.
    sync = [(2.0 * (i + 1), min(0.6, 0.1 + 0.05 * i)) for i in range(20)]
    overlapped = [(1.0 * (i + 1), min(0.5, 0.1 + 0.05 * i)) for i in range(20)]
    target, (sync_s, async_s) = reward_target(sync, overlapped)
    # Running means of 5 steps: starts 0.1, the lower best 0.5; 80% of the way is 0.42.
    assert target == pytest.approx(0.42)
    assert (sync_s, async_s) == (2.0 * 10, 1.0 * 10)  # the 10th step's window (0.35 .. 0.55) is the first over
    flat = [(1.0 * (i + 1), 0.125) for i in range(5)]  # a run that never climbs caps the target at its level
    target, reached = reward_target(sync, flat)
    assert target == pytest.approx(0.12) and reached == (4.0, 1.0)


def test_bench_async_costs_per_token_and_the_core_the_trainer_got():
    from reel.bus.events import StepCommitted, StepTiming
    from reel.runtime.bench.async_ import _trainer_costs

    def step(cpu_s: float, compute: float, tokens: int) -> StepCommitted:
        return StepCommitted(run="r", producer="trainer:0", seq=1, step=1, version=1, groups=[], dropped=[], loss=0.0,
                             grad_norm=0.0, weights_sha256="", metrics={"tokens": tokens}, cpu_s=cpu_s,
                             timing=StepTiming(wait=0.5, compute=compute, publish=0.1, forward_backward=compute / 2))

    # 1.5 CPU s in 2.5 s of compute: the trainer got 60% of its core (another tenant took the rest).
    costs = _trainer_costs([step(0.5, 1.0, 100), step(1.0, 1.5, 400)])
    assert costs["trainer_cpu_s_per_token"] == pytest.approx(1.5 / 500)
    assert costs["trainer_core_share"] == pytest.approx(0.6)
    assert costs["trainer_phases_s"]["compute"] == 2.5 and costs["trainer_phases_s"]["forward_backward"] == 1.25
    assert _trainer_costs([step(0.0, 0.0, 10)])["trainer_core_share"] is None  # a log before the timings


def _bench_pair(sync_wall: float, async_wall: float, simulated: float | None, reached: tuple) -> dict:
    def run(wall: float, share: float) -> dict:
        return {"wall_s": wall, "trainer_core_share": share, "trainer_cpu_s_per_token": wall / 1000}

    return {"sync": run(sync_wall, 0.9), "async": run(async_wall, 0.8), "ideal": sync_wall / 4, "reward_target": 0.5,
            "time_to_reward_s": {"sync": reached[0], "async": reached[1]},
            "time_to_reward": reached[0] / reached[1] if None not in reached else None,
            "simulated": simulated, "simulated_dedicated": None,
            "cpu_per_token_ratio": async_wall / sync_wall, "ratio": sync_wall / async_wall}


def test_bench_async_repeats_report_medians_and_the_prediction_against_the_median_async_wall():
    from reel.runtime.bench.async_ import summarize

    pairs = [_bench_pair(10.0, 5.0, 5.5, (6.0, 3.0)), _bench_pair(12.0, 8.0, 4.0, (8.0, 2.0)),
             _bench_pair(8.0, 4.0, None, (4.0, None))]
    figures = summarize(pairs)
    # Walls: medians 10 and 5, each a run's own figures; ratio of the medians, not the median of the ratios (2.0 too).
    assert figures["sync"] is pairs[0]["sync"] and figures["async"] is pairs[0]["async"]
    assert figures["ratio"] == 2.0 and figures["ideal"] == 2.5 and figures["efficiency"] == 0.8
    # Two predictions (the third log could not be calibrated): their median against the median async wall.
    assert figures["simulated"] == 4.75 and figures["simulated_error"] == -0.05
    assert figures["simulated_dedicated"] is None
    assert figures["time_to_reward_s"] == {"sync": 6.0, "async": 2.5} and figures["time_to_reward"] == 3.0
    assert figures["async_wall_spread"] == 1.0  # 8 s over 4 s: one draw of the machine from another
    assert [r["simulated_error"] for r in figures["repeats"]] == [0.1, -0.5, None]
    assert figures["repeats"][1] == {"sync_wall_s": 12.0, "async_wall_s": 8.0, "ratio": 1.5, "simulated": 4.0,
                                     "simulated_error": -0.5, "trainer_core_share": [0.9, 0.8]}
    # Even counts take the lower middle run for the mode's figures, the mean of the middle two for the walls.
    two = summarize(pairs[:2])
    assert two["sync"] is pairs[0]["sync"] and two["ratio"] == round(11.0 / 6.5, 3)
    # One pair is reported as it was measured, with nothing about repeats.
    one = summarize(pairs[1:2])
    assert one["ratio"] == 1.5 and one["simulated_error"] == -0.5 and "repeats" not in one


def test_bench_async_refuses_no_pairs_no_timed_step_and_a_keep_dir_that_holds_a_repeat_already(tmp_path: Path):
    with pytest.raises(SystemExit, match="--repeats 0 runs nothing"):
        cli.main(["bench", "async", "--repeats", "0"])
    with pytest.raises(SystemExit, match="--steps 1 leaves no step to time after the first"):
        cli.main(["bench", "async", "--steps", "1"])  # step 1 waits for the processes to start: never timed
    (tmp_path / "async2-3").mkdir(parents=True)  # the third pair's asynchronous run, from an earlier bench
    with pytest.raises(SystemExit, match=r"already holds async2-3; pass an empty or new directory"):
        cli.main(["bench", "async", "--repeats", "3", "--keep", str(tmp_path)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["async2-3"]  # nothing run, nothing written
