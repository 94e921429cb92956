"""`reel simulate` and the roles beside the trainer and the workers: pinned cores, the mismatch role.

Synthetic logs (tests/support/simulate_log.py) whose times are the model's constants: roles whose
logged affinities share no core do not slow each other, and the mismatch role's splits are priced
from its events and slow decoding, while they run, by what processor sharing gives.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from reel.replay.simulate import Scenario, simulate
from reel.replay.simulate_cores import Cores, factors
from reel.replay.simulate_report import caveats
from reel.replay.simulate_split import SplitModel, passes
from reel.replay.workload import extract
from simulate_log import A, B, C0, C1, G, L, N, P, PUBLISH, SWAP, X, write_run

# The bench's layout: the trainer alone on core 0 beside one other runnable thread, a worker's one
# decoding thread on core 1 beside half a thread's worth of other work.
APART = Cores(cores=1, background=0.5, trainer_threads=1, worker_threads=1, trainer_rate=0, worker_rate=0,
              trainer_cores=1, trainer_background=1.0)


def test_roles_pinned_apart_are_fitted_on_their_own_cores_and_do_not_slow_each_other(tmp_path: Path) -> None:
    w = extract(write_run(tmp_path / "run", async_level=0, cores=APART))
    c = w.cores
    assert c is not None and c.apart and (c.trainer_cores, c.cores) == (1, 1)
    assert c.trainer_background == pytest.approx(1.0, abs=0.051)  # the trainer got half its core
    assert c.trainer_rate == pytest.approx(0.5, rel=1e-6)
    assert (c.background, c.worker_rate) == pytest.approx((0.5, 1 / 1.5), abs=0.011)
    assert c.trainer_slowdown(1) == c.decode_slowdown(1) == 0.0
    assert (w.decode.shared_slowdown, w.trainer.shared_slowdown) == (0.0, 0.0)
    assert (w.decode.base_s, w.trainer.base_s) == pytest.approx((A, C0), rel=1e-6)
    # So an asynchronous scenario overlaps them for free: as on dedicated hardware.
    pipeline = msgspec.structs.replace(w.pipeline, async_level=1)
    shared, dedicated = (simulate(w, Scenario(pipeline=pipeline, dedicated=d)).wall_s for d in (False, True))
    assert shared == pytest.approx(dedicated, rel=1e-12)
    # A background given for the machine spreads over its two cores: half a thread on each, so the
    # trainer (one beside it as logged) speeds up to 1/1.5 of its core, the worker stays as it was.
    f = factors(c, 1, 1, background=1.0)
    assert (f.trainer_scale, f.decode_scale) == pytest.approx((0.5 / (1 / 1.5), 1.0), rel=0.02)


def test_the_shared_layout_is_kept_for_logs_without_affinities(tmp_path: Path) -> None:
    shared = msgspec.structs.replace(APART, trainer_cores=0, cores=2, background=1.0)
    w = extract(write_run(tmp_path / "run", async_level=0, cores=shared))
    assert w.cores is not None and not w.cores.apart and w.cores.cores == 2
    assert w.cores.decode_slowdown(1) > 0 and w.cores.trainer_slowdown(1) > 0


def test_the_split_is_priced_from_the_roles_events_and_the_trainers_scoring_pass(tmp_path: Path) -> None:
    w = extract(write_run(tmp_path / "run", async_level=0, split=(0.03, 0.0002)))
    assert w.split is not None and w.split.splits == 7  # steps 2..8
    assert (w.split.base_s, w.split.pass_s_per_token) == pytest.approx((0.03, 0.0002), rel=1e-6)
    assert w.split.seconds(passes=3, tokens=100) == pytest.approx(0.03 + 3 * 0.0002 * 100)
    # pi_old, then one pass per older version with tokens in the batch.
    assert (passes({0: 10}), passes({0: 5, 1: 3, 2: 0}), passes({1: 4, 2: 4})) == (1, 2, 3)
    every3 = msgspec.structs.replace(w.split, every=3)
    assert [s for s in range(1, 11) if every3.due(s, last=10)] == [3, 6, 9, 10]
    assert not msgspec.structs.replace(w.split, every=0).due(10, last=10)
    # A log of the role says nothing about a split inside the trainer's step; one from before it does.
    scenario = Scenario(pipeline=msgspec.structs.replace(w.pipeline, async_level=2))
    assert not any("mismatch split" in c for c in caveats(w, scenario))
    old = extract(write_run(tmp_path / "old", async_level=0))
    assert old.split is None and any("mismatch split" in c for c in caveats(old, scenario))


def _rollout_s() -> float:
    return L * (A + B * G * N) + X * G * N * (P - 1)  # the round's prompts join in its first step


@pytest.mark.parametrize("with_workers", [True, False])
def test_a_split_running_beside_the_workers_slows_their_decoding(tmp_path: Path, with_workers: bool) -> None:
    w = extract(write_run(tmp_path / "run", async_level=0, steps=10))
    # One thread of the role beside the worker's one on their core: each gets half while both run,
    # a decode step takes twice as long. Splits of 0.3 s alone (longer beside decoding) follow each
    # other through every round from the first commit on; the trainer, on its own core, is not slowed.
    cores = Cores(cores=1, background=0.0, trainer_threads=1, worker_threads=1.0, trainer_rate=0, worker_rate=0,
                  trainer_cores=1, split_threads=1.0, split_with_workers=with_workers, split_with_trainer=False)
    w = msgspec.structs.replace(w, cores=cores, split=SplitModel(base_s=0.3, pass_s_per_token=0.0, every=1, splits=1))
    assert factors(cores, 1, 1, None).decode_split == (1.0 if with_workers else 0.0)
    train = C0 + C1 * G * N * L + PUBLISH
    rollout = _rollout_s() * (2 if with_workers else 1)
    assert simulate(w, Scenario(pipeline=w.pipeline)).wall_s == pytest.approx(9 * (SWAP + rollout + train), rel=1e-9)
    # On dedicated hardware nothing shares a core.
    assert simulate(w, Scenario(pipeline=w.pipeline, dedicated=True)).wall_s == \
        pytest.approx(9 * (SWAP + _rollout_s() + train), rel=1e-9)


def test_a_split_beside_the_trainer_slows_its_compute(tmp_path: Path) -> None:
    w = extract(write_run(tmp_path / "run", async_level=0, steps=10))
    # The role on the trainer's core, each split long enough to cover the next step's compute (and no
    # longer than a step, so none waits for the one before): the trainer gets half its core computing.
    cores = Cores(cores=1, background=0.0, trainer_threads=1, worker_threads=1.0, trainer_rate=0, worker_rate=0,
                  trainer_cores=1, split_threads=1.0, split_with_workers=False, split_with_trainer=True)
    w = msgspec.structs.replace(w, cores=cores, split=SplitModel(base_s=0.42, pass_s_per_token=0.0, every=1, splits=1))
    compute = C0 + C1 * G * N * L
    step = SWAP + _rollout_s() + 2 * compute + PUBLISH
    assert SWAP + _rollout_s() + 2 * compute < 0.42 < step  # the split outlasts the compute it slows
    assert simulate(w, Scenario(pipeline=w.pipeline)).wall_s == pytest.approx(9 * step, rel=1e-9)


def test_a_niced_mismatch_role_takes_little_of_a_shared_core(tmp_path: Path) -> None:
    # The role's threads weigh 1.25x less per nice level, as Linux's scheduler weighs them.
    for nice in (0, 19):
        w = extract(write_run(tmp_path / f"nice{nice}", async_level=0, cores=APART, split=(0.03, 0.0002), nice=nice))
        assert w.cores is not None and w.cores.split_threads == pytest.approx(1.25 ** -nice)
        # On the worker's core beside half a thread of other work: 1.5 threads, 1.5 + weight with the role.
        assert w.cores.decode_slowdown(1, trainer=0, split=1) == pytest.approx(1.25 ** -nice / 1.5, rel=0.04)


def test_a_split_goes_at_half_pace_beside_a_decoding_worker(tmp_path: Path) -> None:
    w = extract(write_run(tmp_path / "run", async_level=0, steps=10))
    cores = Cores(cores=1, background=0.0, trainer_threads=1, worker_threads=1.0, trainer_rate=0, worker_rate=0,
                  trainer_cores=1, split_threads=1.0, split_with_workers=True, split_with_trainer=False)
    assert cores.split_slowdown(1) == 1.0 and cores.split_slowdown(0, trainer=1) == 0.0
    w = msgspec.structs.replace(w, cores=cores, split=SplitModel(base_s=0.05, pass_s_per_token=0.0, every=1, splits=1))
    # After each commit the split runs alone while the worker swaps (4 ms), then at half pace beside
    # its decoding: 46 ms of work left take 92 ms, so it ends 96 ms after the commit. Decode steps
    # that start before then take twice as long: the first (with the prefill) 48.8 ms, the second
    # and third 36 ms; the last three 18 ms each.
    first, step = 2 * (A + B * G * N + X * G * N * (P - 1)), A + B * G * N
    assert SWAP + first + step < 0.096 < SWAP + first + 2 * step * 2
    rollout = first + 2 * (2 * step) + 3 * step
    train = C0 + C1 * G * N * L + PUBLISH
    assert simulate(w, Scenario(pipeline=w.pipeline)).wall_s == pytest.approx(9 * (SWAP + rollout + train), rel=1e-9)
