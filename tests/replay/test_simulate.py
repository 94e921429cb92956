"""`reel simulate`: calibration on a log, the discrete-event simulation against closed forms, the CLI.

A synthetic log with constant times (every sample L tokens, decode step a + b·B, trainer compute
c0 + c1·tokens) has closed-form answers: synchronous, a step is swap + rollout + compute + publish;
asynchronous, the period tends to the larger of rollout and trainer time. The end-to-end check of
the model against a real run is in test_simulate_real.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgspec
import pytest

from reel.replay.simulate import Scenario, SimulationError, simulate
from reel.replay.simulate_cores import Cores
from reel.replay.simulate_report import tv_distance
from reel.replay.workload import GroupShape, WorkloadError, extract
from reel.runtime.launch.cli import main as reel
from simulate_log import A, B, C0, C1, G, L, N, P, PUBLISH, SWAP, X, write_run

def test_calibration_recovers_the_constants(tmp_path: Path) -> None:
    w = extract(write_run(tmp_path / "run", async_level=0))
    d = w.decode
    assert (d.base_s, d.per_seq_s, d.per_prefill_token_s, d.shared_slowdown) == pytest.approx((A, B, X, 0.0), abs=1e-9)
    assert (w.trainer.base_s, w.trainer.per_token_s) == pytest.approx((C0, C1), abs=1e-9)
    assert w.trainer.publish_s == pytest.approx(PUBLISH)
    assert w.swap_s == pytest.approx(SWAP)
    assert {(g.prompt, tuple(map(tuple, g.samples))) for g in w.groups} == {(P, ((L,),) * N)}
    assert (w.pipeline.async_level, w.pipeline.batch_groups, w.pipeline.group_size) == (0, G, N)
    assert w.measured.wall_s == pytest.approx(7.0)


def test_calibration_finds_the_shared_core_slowdown(tmp_path: Path) -> None:
    w = extract(write_run(tmp_path / "run", async_level=2, slowdown=0.8))
    assert w.decode.shared_slowdown == pytest.approx(0.8, abs=0.011)
    assert w.decode.base_s == pytest.approx(A, rel=0.02)


def test_calibration_fits_the_shared_cores_from_cpu_times(tmp_path: Path) -> None:
    # 2 cores, 3 other runnable threads, a worker's one decoding thread (engine.threads): every role
    # is slowed by the other, and the log's CPU times say by how much.
    truth = Cores(cores=2, background=3.0, trainer_threads=1, worker_threads=1, trainer_rate=0, worker_rate=0)
    w = extract(write_run(tmp_path / "run", async_level=0, cores=truth))
    assert w.cores is not None and w.cores.cores == 2 and not w.cores.apart
    assert (w.cores.background, w.cores.worker_threads) == pytest.approx((3.0, 1), abs=0.051)
    assert w.cores.trainer_rate == pytest.approx(2 / 5, rel=1e-6)  # 1 thread of 5 on 2 cores
    # Times are taken back to the roles alone: the constants, and the model's slowdowns.
    assert w.decode.shared_slowdown == pytest.approx(truth.decode_slowdown(1), rel=0.05)
    assert w.trainer.shared_slowdown == pytest.approx(truth.trainer_slowdown(1), rel=0.05)
    assert (w.decode.base_s, w.trainer.base_s) == pytest.approx((A, C0), rel=0.05)
    # A second worker demands one thread more: the trainer slows further, a decode step less (the
    # trainer's thread is one of more).
    assert w.cores.decode_slowdown(2) < w.cores.decode_slowdown(1) and \
        w.cores.trainer_slowdown(1) < w.cores.trainer_slowdown(2)
    # A log without CPU times has no such model, and says so for an asynchronous scenario.
    assert extract(write_run(tmp_path / "old", async_level=0)).cores is None


def test_background_rescales_each_role_from_the_logged_machine_to_the_scenarios(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    truth = Cores(cores=2, background=3.0, trainer_threads=1, worker_threads=1, trainer_rate=0, worker_rate=0)
    run = write_run(tmp_path / "run", async_level=0, cores=truth)
    w = extract(run)
    walls = {bg: simulate(w, Scenario(pipeline=w.pipeline, dedicated=True, background=bg)).wall_s
             for bg in (None, 3.0, 0.0)}
    assert walls[3.0] == pytest.approx(walls[None], rel=1e-9)  # the logged machine
    # Alone on 2 cores the trainer's one thread and the worker's one each run at full speed: each
    # 2/4 -> 1 (2x faster); sync wall = sum of both sides.
    step = _rollout_s() / 2 + (C0 + C1 * G * N * L + PUBLISH) / 2 + SWAP
    assert walls[0.0] == pytest.approx(11 * step, rel=0.02)  # steps 2..12
    assert reel(["simulate", "--run", str(run), "--json", "--sweep", "background=0,3"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rows[0]["result"]["wall_s"] < rows[1]["result"]["wall_s"]
    old = write_run(tmp_path / "old", async_level=0)
    assert reel(["simulate", "--run", str(old), "--background", "0"]) != 0
    assert "needs a value of 0 or more and a log with CPU times" in capsys.readouterr().err


def _rollout_s(speedup: float = 1.0) -> float:
    return (L * (A + B * G * N) + X * G * N * (P - 1)) / speedup  # the round's prompts join in its first step


def _train_s(speedup: float = 1.0, ranks: int = 1, efficiency: float = 0.9, tokens: int = G * N * L) -> float:
    compute = (C0 + C1 * tokens) / speedup
    return (compute / (ranks * efficiency) if ranks > 1 else compute) + PUBLISH


def test_synchronous_wall_is_the_sum_of_rollout_and_training(tmp_path: Path) -> None:
    w = extract(write_run(tmp_path / "run", async_level=0, steps=10))
    r = simulate(w, Scenario(pipeline=w.pipeline))
    step = SWAP + _rollout_s() + _train_s()
    assert r.wall_s == pytest.approx(9 * step, rel=1e-9)
    assert r.trainer_idle == pytest.approx((SWAP + _rollout_s()) / step, rel=1e-9)
    assert r.rollout_idle == pytest.approx((_train_s() + SWAP) / step, rel=1e-9)  # no group in flight while swapping
    assert r.staleness == {0: 10 * G * N * L}
    assert r.dropped_share == 0.0


@pytest.mark.parametrize("speedup_rollout", [1.0, 0.25])
def test_asynchronous_period_is_the_slower_side(tmp_path: Path, speedup_rollout: float) -> None:
    w = extract(write_run(tmp_path / "run", async_level=1, steps=30))
    r = simulate(w, Scenario(pipeline=w.pipeline, speedup_rollout=speedup_rollout))
    rollout, train = _rollout_s(speedup_rollout), _train_s()
    # Trainer-bound (rollout + swap 0.118 s < train 0.166 s): the trainer never waits after step 1.
    # Rollout-bound (rollout 0.458 s): rounds run back to back, each paused once by a weight swap.
    period = train if rollout < train else rollout + SWAP
    assert r.wall_s / 29 == pytest.approx(period, rel=1e-6)
    assert r.trainer_idle == pytest.approx(1 - train / period, abs=1e-6)
    assert sum(r.staleness.values()) == 30 * G * N * L
    assert max(r.staleness) == 1  # a round overlaps one commit at most


# Two-turn episodes: model 6, tool 3, model 2 tokens; a long tail: one sample of four takes three turns.
TWO_TURNS = [(L, 3, 2)] * N
LONG_TAIL = [(L,)] * (N - 1) + [(L, 3, L, 2, L)]


def _episodes_rollout_s(episodes: list[tuple[int, ...]]) -> float:
    """One synchronous round of G groups: a model turn of every unfinished sample per decode step;
    each turn's request prefills the conversation so far (prompt and earlier turns, less the one
    token sampled from) when it joins. All samples here reach turn k together."""
    seconds = 0.0
    for k in range(0, max(len(e) for e in episodes), 2):
        live = [e for e in episodes if len(e) > k]
        steps = max(e[k] for e in live)
        assert all(e[k] == steps for e in live)
        seconds += steps * (A + B * G * len(live)) + X * G * sum(P + sum(e[:k]) - 1 for e in live)
    return seconds


@pytest.mark.parametrize("episodes", [TWO_TURNS, LONG_TAIL], ids=["two-turns", "long-tail"])
def test_synchronous_multi_turn_wall_is_the_sum_of_turns_and_training(tmp_path: Path,
                                                                     episodes: list[tuple[int, ...]]) -> None:
    w = extract(write_run(tmp_path / "run", async_level=0, steps=10, episodes=episodes))
    assert {tuple(map(tuple, g.samples)) for g in w.groups} == {tuple(episodes)}
    r = simulate(w, Scenario(pipeline=w.pipeline))
    sampled = G * sum(sum(e[::2]) for e in episodes)  # env tokens are not trained on
    step = SWAP + _episodes_rollout_s(episodes) + _train_s(tokens=sampled)
    assert r.wall_s == pytest.approx(9 * step, rel=1e-9)
    assert r.trainer_idle == pytest.approx((SWAP + _episodes_rollout_s(episodes)) / step, rel=1e-9)
    assert r.staleness == {0: 10 * sampled}


def test_asynchronous_multi_turn_period_is_the_slower_side(tmp_path: Path) -> None:
    w = extract(write_run(tmp_path / "run", async_level=1, steps=30, episodes=LONG_TAIL))
    r = simulate(w, Scenario(pipeline=w.pipeline, speedup_rollout=0.25))
    # Rollout-bound (a round 1.13 s against 0.21 s of training): rounds back to back, one swap each.
    assert r.wall_s / 29 == pytest.approx(_episodes_rollout_s(LONG_TAIL) / 0.25 + SWAP, rel=1e-6)
    assert max(r.staleness) == 1


@pytest.mark.parametrize("async_level", [0, 1])
def test_a_tool_wait_holds_up_its_episode_not_the_engine(tmp_path: Path, async_level: int) -> None:
    # Every sample's tool call answers in 0.5 s, the final reward at once (Sample.env_s).
    w = extract(write_run(tmp_path / "run", async_level=async_level, steps=12, episodes=TWO_TURNS,
                           env_s=(0.5, 0.0)))
    assert {tuple(map(tuple, g.env_s)) for g in w.groups} == {((0.5, 0.0),) * N}
    r = simulate(w, Scenario(pipeline=w.pipeline))
    sampled = G * sum(sum(e[::2]) for e in TWO_TURNS)
    round_ = _episodes_rollout_s(TWO_TURNS) + 0.5  # all samples wait side by side: once per round
    # Synchronous: the round, then training. Asynchronous with one round in flight (concurrency = a
    # batch): rollout-bound, rounds back to back; the weight swap lands while the engine waits on
    # the tools, so it costs nothing.
    step = SWAP + round_ + _train_s(tokens=sampled) if async_level == 0 else round_
    assert r.wall_s == pytest.approx(11 * step, rel=1e-6)


def test_speedups_and_trainer_ranks_scale_the_closed_form(tmp_path: Path) -> None:
    w = extract(write_run(tmp_path / "run", async_level=0, steps=6))
    pipeline = msgspec.structs.replace(w.pipeline, trainer_ranks=4)
    r = simulate(w, Scenario(pipeline=pipeline, speedup_rollout=2.0, speedup_trainer=3.0, rank_efficiency=0.8))
    assert r.wall_s == pytest.approx(5 * (SWAP + _rollout_s(2.0) + _train_s(3.0, 4, 0.8)), rel=1e-9)


def test_redis_thread_saturates_with_many_workers(tmp_path: Path) -> None:
    w = extract(write_run(tmp_path / "run", async_level=2, steps=20))
    pipeline = msgspec.structs.replace(w.pipeline, rollout_workers=8, batch_groups=8 * G)
    r = simulate(w, Scenario(pipeline=pipeline, speedup_trainer=100.0, redis_s_per_event=0.02, dedicated=True))
    assert r.redis_busy > 0.8 and r.bottleneck == "redis"


def test_tight_off_policy_limit_drops_groups(tmp_path: Path) -> None:
    w = extract(write_run(tmp_path / "run", async_level=3, steps=20))
    pipeline = msgspec.structs.replace(w.pipeline, max_off_policy=0, concurrency=3 * G)
    r = simulate(w, Scenario(pipeline=pipeline, speedup_rollout=4.0))
    assert 0.0 < r.dropped_share < 1.0
    assert set(r.staleness) == {0}


def test_a_dropped_group_is_replaced_as_the_async_gate_does(tmp_path: Path) -> None:
    # Every group of the round sampled ahead finishes a version late and is dropped (max_off_policy 0).
    # The gate (producers/async_gate.py) starts a replacement for each: counted, the drops would
    # use up the rounds the gate allows and the worker would stop for good.
    w = extract(write_run(tmp_path / "run", async_level=1, steps=20))
    pipeline = msgspec.structs.replace(w.pipeline, max_off_policy=0, concurrency=2 * G)
    r = simulate(w, Scenario(pipeline=pipeline))
    assert r.dropped_share > 0.2
    assert r.staleness == {0: 20 * G * N * L}  # every step trained a full batch of fresh groups


def test_calibration_fits_the_trainers_padded_positions_and_attention_scores(tmp_path: Path) -> None:
    w = extract(write_run(tmp_path / "run", async_level=0, padded=(1e-3, 2e-5)))
    t = w.trainer
    assert (t.base_s, t.per_token_s, t.per_position_s, t.per_score_s) == pytest.approx((C0, 0.0, 1e-3, 2e-5), abs=1e-9)
    assert [g.rows() for g in w.groups[:3]] == [[P + L - 1] * N, [P + L] * N, [P + L + 1] * N]


@pytest.mark.parametrize("micro_batch_tokens", [0, G * (N - 1) * (P + L - 1)])
def test_trainer_compute_follows_the_padded_rows_of_its_micro_batches(tmp_path: Path,
                                                                            micro_batch_tokens: int) -> None:
    w = extract(write_run(tmp_path / "run", async_level=0, steps=10))
    w = msgspec.structs.replace(w, groups=[GroupShape(P, [[L]] * (N - 1) + [[3 * L]])],  # one long row a group
                                trainer=msgspec.structs.replace(w.trainer, base_s=0.0, per_token_s=0.0,
                                                                per_position_s=1e-3, per_score_s=2e-5))
    pipeline = msgspec.structs.replace(w.pipeline, micro_batch_tokens=micro_batch_tokens)
    r = simulate(w, Scenario(pipeline=pipeline))
    long_row, short_row = P + 3 * L - 1, P + L - 1
    # One micro-batch pads every row to the long one; rows by length in two, the short rows pad to their own.
    parts = [(G * N, long_row)] if not micro_batch_tokens else [(G * (N - 1), short_row), (G, long_row)]
    train = sum(1e-3 * n * t + 2e-5 * n * t * t for n, t in parts)
    rollout = L * (A + B * G * N) + 2 * L * (A + B * G) + X * G * N * (P - 1)
    assert r.wall_s == pytest.approx(9 * (SWAP + rollout + train + PUBLISH), rel=1e-9)


def test_a_gate_that_cannot_fill_a_batch_is_an_error(tmp_path: Path) -> None:
    w = extract(write_run(tmp_path / "run", async_level=0))
    pipeline = msgspec.structs.replace(w.pipeline, concurrency=1)
    with pytest.raises(SimulationError, match="raise rollout.concurrency"):
        simulate(w, Scenario(pipeline=pipeline))


def test_tv_distance() -> None:
    assert tv_distance({0: 10}, {0: 3}) == 0.0
    assert tv_distance({0: 1}, {1: 5}) == 1.0
    assert tv_distance({0: 3, 1: 1}, {0: 1, 1: 1}) == pytest.approx(0.25)


def test_cli_sweep_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path / "run", async_level=1)
    png = tmp_path / "sweep.png"
    assert reel(["simulate", "--run", str(run), "--sweep", "rollout-workers=1,2,4", "--json", "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    rates = [row["result"]["steps_per_hour"] for row in out["rows"]]
    assert [row["label"] for row in out["rows"]] == ["rollout-workers=1", "rollout-workers=2", "rollout-workers=4"]
    assert rates[0] <= rates[1] <= rates[2]
    assert png.stat().st_size > 10_000


def test_cli_sweeps_make_a_grid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path / "run", async_level=1)
    assert reel(["simulate", "--run", str(run), "--sweep", "rollout-workers=1,2", "--sweep", "trainer-ranks=1,4",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [row["label"] for row in rows] == ["rollout-workers=1 trainer-ranks=1", "rollout-workers=1 trainer-ranks=4",
                                              "rollout-workers=2 trainer-ranks=1", "rollout-workers=2 trainer-ranks=4"]
    assert rows[1]["scenario"]["pipeline"]["trainer_ranks"] == 4 and rows[2]["scenario"]["pipeline"]["rollout_workers"] == 2


def test_cli_as_logged_shows_the_measured_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path / "run", async_level=0)
    assert reel(["simulate", "--run", str(run)]) == 0
    out = capsys.readouterr().out
    assert "as logged" in out and "measured" in out and "TV" in out
    assert "model turns" not in out


def test_cli_shows_the_turns_of_multi_turn_episodes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path / "run", async_level=0, episodes=LONG_TAIL)
    assert reel(["simulate", "--run", str(run)]) == 0
    assert "1.50 model turns per episode (at most 3)" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("argv, message", [
    (["--sweep", "workers=1,2"], "KEY=V1,V2"),
    (["--sweep", "rollout-workers=1,x"], "must be an integer"),
    (["--rollout-workers", "0"], "rollout workers = 0 must be positive"),
])
def test_cli_bad_input_is_one_sentence(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                       message: str) -> None:
    run = write_run(tmp_path / "run", async_level=0)
    assert reel(["simulate", "--run", str(run), *argv]) == 1
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_not_a_run_directory(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="no config.toml"):
        extract(tmp_path)


def test_a_log_without_decode_timings_says_so(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", async_level=0)
    shutil.rmtree(run / "log" / "control")  # as if no worker had reported its engine counters
    with pytest.raises(WorkloadError, match="0 WorkerStats intervals with decode timings.*re-run the config"):
        extract(run)


def test_trainer_compute_is_calibrated_per_logged_rank(tmp_path: Path) -> None:
    # The same step timings logged by one process and by two ranks: simulated as logged, both give
    # those timings back; the 2-rank log is not divided by its ranks a second time.
    one = extract(write_run(tmp_path / "one", async_level=0, world_size=1))
    two = extract(write_run(tmp_path / "two", async_level=0, world_size=2))
    assert (one.trainer.ranks, two.trainer.ranks, two.pipeline.trainer_ranks) == (1, 2, 2)
    as_logged = [simulate(w, Scenario(pipeline=w.pipeline, dedicated=True)).wall_s for w in (one, two)]
    assert as_logged[1] == pytest.approx(as_logged[0], rel=1e-9)
    # From two ranks to one at rank_efficiency 0.5 (two ranks worth one process): the same wall time.
    one_rank = msgspec.structs.replace(two.pipeline, trainer_ranks=1)
    slower = simulate(two, Scenario(pipeline=one_rank, dedicated=True, rank_efficiency=0.5)).wall_s
    assert slower == pytest.approx(as_logged[0], rel=1e-9)


def test_rank_efficiency_is_fitted_from_bench_fsdp_and_says_where_it_came_from(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path / "run", async_level=0)
    bench = tmp_path / "fsdp.json"
    bench.write_text(json.dumps({"bench": "fsdp", "one_rank_step_s": 0.36, "two_rank_step_s": 0.3, "ratio": 1.3}))
    runs = {}
    for name, extra in (("assumed", []), ("fitted", ["--rank-efficiency-from", str(bench)]),
                        ("given", ["--rank-efficiency", "0.75"])):
        assert reel(["simulate", "--run", str(run), "--trainer-ranks", "2", "--dedicated", "--json", *extra]) == 0
        runs[name] = json.loads(capsys.readouterr().out)
    assert runs["assumed"]["rank_efficiency"] == 0.9
    assert "assumed, not measured" in runs["assumed"]["rank_efficiency_source"]
    assert runs["fitted"]["rank_efficiency"] == pytest.approx(0.36 / (2 * 0.3))
    assert runs["fitted"]["rank_efficiency_source"].startswith(f"fitted from {bench}: 1 process 0.360 s/step")
    assert runs["given"]["rank_efficiency_source"] == "given (--rank-efficiency)"
    walls = {name: r["rows"][0]["result"]["wall_s"] for name, r in runs.items()}
    assert walls["fitted"] > walls["given"] > walls["assumed"]  # 2 x 0.6 < 2 x 0.75 < 2 x 0.9
    bench.write_text("not json")
    assert reel(["simulate", "--run", str(run), "--rank-efficiency-from", str(bench)]) != 0
    assert "not a `reel bench fsdp` JSON line" in capsys.readouterr().err


def test_rank_efficiency_is_fitted_from_a_one_rank_and_a_two_rank_run(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    # The synthetic logs' steps take the same compute seconds on 1 rank and on 2: efficiency 1/2.
    one = write_run(tmp_path / "one", async_level=0, world_size=1)
    two = write_run(tmp_path / "two", async_level=0, world_size=2)
    assert reel(["simulate", "--run", str(one), "--trainer-ranks", "2", "--dedicated", "--json",
                 "--rank-efficiency-from", str(two), str(one)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rank_efficiency"] == pytest.approx(0.5)
    source = out["rank_efficiency_source"]
    assert source.startswith(f"fitted from the run logs {one} (1 rank") and f"{two} (2 ranks" in source
    for wrong in ([str(one), str(one)], [str(one), str(tmp_path / "none")], [str(one), str(two), str(one)]):
        assert reel(["simulate", "--run", str(one), "--rank-efficiency-from", *wrong]) != 0
        err = capsys.readouterr().err
        assert "--rank-efficiency-from" in err and "Traceback" not in err


def test_a_synchronous_log_says_it_cannot_tell_what_sharing_costs(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path / "run", async_level=0)
    notes = {}
    for name, extra in (("async", ["--async-level", "2"]), ("dedicated", ["--async-level", "2", "--dedicated"]),
                        ("as logged", [])):
        assert reel(["simulate", "--run", str(run), "--json", *extra]) == 0
        notes[name] = json.loads(capsys.readouterr().out)["caveats"]
    assert len(notes["async"]) == 2 and "what sharing cores costs is unknown" in notes["async"][1]
    assert "mismatch split" in notes["async"][0] and notes["dedicated"] == notes["async"][:1]
    assert notes["as logged"] == []
    assert reel(["simulate", "--run", str(run), "--async-level", "1"]) == 0
    assert "note: calibrated on a synchronous log" in capsys.readouterr().out


def test_repeats_report_the_mean_of_their_draws(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    w = extract(write_run(tmp_path / "run", async_level=1, steps=10))
    w = msgspec.structs.replace(w, groups=[w.groups[0], GroupShape(P, [[3 * L]] * N)])  # a short and a long group
    one = [simulate(w, Scenario(pipeline=w.pipeline, seed=s, repeats=1)) for s in range(4)]
    assert len({r.wall_s for r in one}) > 1  # the draws differ
    mean = simulate(w, Scenario(pipeline=w.pipeline, seed=0, repeats=4))
    assert mean.wall_s == pytest.approx(sum(r.wall_s for r in one) / 4, rel=1e-12)
    assert mean.trainer_idle == pytest.approx(sum(r.trainer_idle for r in one) / 4, rel=1e-12)
    assert mean.steps_per_hour == pytest.approx(3600 * 9 / mean.wall_s)
    assert sum(mean.staleness.values()) == pytest.approx(sum(sum(r.staleness.values()) for r in one) / 4, abs=2)
    run = write_run(tmp_path / "cli", async_level=1)
    assert reel(["simulate", "--run", str(run), "--repeats", "0"]) != 0
    assert "--repeats = 0 must be 1 or more" in capsys.readouterr().err
