"""`reel simulate` times decode steps by the groups of synchronous rounds (replay/decode_rounds.py).

A round whose groups start together and run alone on their worker tells what a decode step costs at
every batch size the round goes through; synthetic logs (tests/support/simulate_log.py) whose times
are the model's constants check that the rows it gives agree with them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from reel.bus.events import Tensor, Trajectory
from reel.replay.decode_rounds import round_groups
from reel.replay.workload import WorkloadError, extract
from simulate_log import A, B, P, X, sample, write_run


def _group(start_ms: float, turns: list[tuple[int, ...]], seconds: float) -> tuple[int, Trajectory]:
    return round(start_ms + 1000 * seconds), Trajectory(
        run="r", producer="rollout:0", seq=0, group_id="g", env="e", prompt=Tensor.from_numpy(np.zeros(P, np.int32)),
        samples=[sample(t) for t in turns], worker="rollout:0", generate_s=seconds)


# Long-tail rounds: most samples short, one long, so a round runs at 9 or 12 sequences, then at 1.
ROUNDS = [[[2, 3, 2], [3, 2, 9 + r % 4], [2, 2, 3]] + ([[3, 3, 2]] if r % 2 else []) for r in range(9)]


def test_a_round_alone_gives_each_group_its_steps_and_mean_batch() -> None:
    rows = round_groups([_group(1000, [(2,), (5,)], 0.5), _group(1001, [(3,), (3,)], 0.3),
                         # a group that starts while the next one runs: neither round ran alone
                         _group(3000, [(4,)], 0.2), _group(3100, [(4,)], 0.2),
                         # a multi-turn round: its batch sizes depend on the env's waits
                         _group(5000, [(2, 1, 2)], 0.1)])
    assert [(r.steps, r.batch, r.prefill, r.step_s) for r in rows] == pytest.approx(
        [(5, 13 / 5, 4 * (P - 1) / 5, 0.5 / 5), (3, 11 / 3, 4 * (P - 1) / 3, 0.3 / 3)])  # Σ_k B_k: 2+5+3+3, 2+3+3+3


def test_rounds_time_the_decode_steps_the_constants_give(tmp_path: Path) -> None:
    w = extract(write_run(tmp_path / "run", async_level=0, rounds=ROUNDS))
    assert w.decode.intervals == 9 + sum(map(len, ROUNDS))  # the WorkerStats intervals and every round's groups
    assert (w.decode.base_s, w.decode.per_seq_s, w.decode.per_prefill_token_s) == pytest.approx((A, B, X), abs=1e-9)


def test_a_groups_work_around_the_engine_is_not_taken_for_decode_steps(tmp_path: Path) -> None:
    # Each round's group also spends 4 ms scoring and publishing. Fitted as step time, that made a full
    # engine look dearer per sequence; fitted apart, the steps are the constants again.
    w = extract(write_run(tmp_path / "run", async_level=0, rounds=ROUNDS, around_s=0.004))
    d = w.decode
    assert (d.base_s, d.per_seq_s, d.per_prefill_token_s, d.group_s) == pytest.approx((A, B, X, 0.004), abs=1e-9)
    # These rounds alone cannot tell a group's own seconds from its steps (their rows are linearly
    # dependent): only the steps are fitted then, as before, and the table says nothing of it.
    run = write_run(tmp_path / "alone", async_level=0, rounds=ROUNDS)
    shutil.rmtree(run / "log" / "control")
    assert extract(run).decode.group_s == 0.0


def test_rounds_alone_calibrate_a_log_without_worker_stats(tmp_path: Path) -> None:
    # A run too short for the workers to report their engine counters (the long-tail bench's 6.5 s
    # synchronous run had 2 intervals): its rounds give the decode steps by themselves.
    run = write_run(tmp_path / "run", async_level=0, rounds=ROUNDS)
    shutil.rmtree(run / "log" / "control")
    w = extract(run)
    assert w.decode.intervals == sum(map(len, ROUNDS))
    assert (w.decode.base_s, w.decode.per_seq_s, w.decode.per_prefill_token_s) == pytest.approx((A, B, X), abs=1e-9)


def test_steps_timed_by_batch_size_replace_the_rounds_and_the_interval_means(tmp_path: Path) -> None:
    # The engine's own seconds at each batch size (WorkerStats.decode_batches): what a step costs with
    # nothing around it, so a round's group's work around the engine has no column left to hide in.
    w = extract(write_run(tmp_path / "run", async_level=0, rounds=ROUNDS, around_s=0.004, by_batch=True))
    d = w.decode
    assert d.intervals == 9 * 2  # 9 intervals after the first commit, two batch sizes in each; no round, no mean
    assert (d.base_s, d.per_seq_s, d.per_prefill_token_s, d.group_s) == pytest.approx((A, B, X, 0.0), abs=1e-9)
    # Without them the same log fits on the intervals' means and the rounds, as before.
    plain = extract(write_run(tmp_path / "plain", async_level=0, rounds=ROUNDS, around_s=0.004))
    assert plain.decode.intervals == 9 + sum(map(len, ROUNDS)) and plain.decode.group_s == pytest.approx(0.004)
    # Each batch size's row keeps its interval's overlap with the trainer: the slowdown is fitted as before.
    shared = extract(write_run(tmp_path / "shared", async_level=1, slowdown=0.3, by_batch=True)).decode
    assert (shared.base_s, shared.per_seq_s, shared.shared_slowdown) == pytest.approx((A, B, 0.3), abs=1e-9)


def test_two_intervals_timed_by_batch_size_calibrate_a_short_run(tmp_path: Path) -> None:
    # The long-tail bench's 40-step synchronous run reports twice after its first commit: two means are
    # too few to fit on, the same two intervals by batch size are not.
    w = extract(write_run(tmp_path / "run", async_level=0, worker_stats=4, by_batch=True))
    assert w.decode.intervals == 2 * 2
    assert (w.decode.base_s, w.decode.per_seq_s, w.decode.per_prefill_token_s) == pytest.approx((A, B, X), abs=1e-9)
    with pytest.raises(WorkloadError, match="has 2 WorkerStats intervals with decode timings"):
        extract(write_run(tmp_path / "means", async_level=0, worker_stats=4))
