"""`reel replay`: every step of a finished run re-executes bitwise; mismatch analysis; errors.

The runs are built in-process by tests/support/runbuilder.py (no Redis): a 4-step run with stale groups
(bf16 engine, fp32 trainer, checkpoints at steps 2 and 4), a run whose routers are undecided
(random init, 8 experts) so bf16 sampling flips some top-k choices, and an fp8 run.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import msgspec
import orjson
import pytest
import torch

from reel.bus.log import LogCorrupted
from reel.bus.run_log import RunLog
from reel.replay.analysis import Run, StepNotLogged, replay_step
from reel.runtime.launch.cli import main as reel
from reel.runtime.train.reexecute import ReplayMismatch
from runbuilder import build_run

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("replay")
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        mp.setenv("REEL_CACHE", str(root / "cache"))
        # producers/warmstart.py logs float(loss) of a tensor that requires grad; not replay's concern.
        warnings.filterwarnings("ignore", message="Converting a tensor with requires_grad", category=UserWarning)
        return {
            "main": build_run(root / "main"),
            "r3": build_run(root / "r3", {"init": {"warmup_steps": 0}, "model": {"num_experts": 8}}, stale=False),
            "fp8": build_run(root / "fp8", {"init": {"warmup_steps": 0}, "trainer": {"precision": "fp8"},
                                            "run": {"steps": 2}}, engine_precision="fp8", stale=False),
        }


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    code = reel(list(argv))
    return code, orjson.loads(capsys.readouterr().out)


def test_replay_of_one_step_takes_at_most_1_5x_its_original_compute(runs):
    """First in the file, so the run was built (and its steps timed) moments ago, under the same load."""
    run = Run(runs["main"])
    originals = sorted(c.timing.compute for c in run.commits.values())
    replays = [replay_step(run, 3)[0] for _ in range(10)]
    assert all(r.restored_from == 2 for r in replays)  # one step from the checkpoint of step 2
    # Wall times of ~20 ms on a shared machine: best of ten against the median of the run's steps.
    assert min(r.replay_seconds for r in replays) <= 1.5 * originals[len(originals) // 2]


def test_every_step_replays_bitwise_and_matches_the_logged_metrics(runs):
    run = Run(runs["main"])
    for step, restored_from in ((1, 0), (2, 0), (3, 2), (4, 2)):
        report, analysis = replay_step(run, step)
        commit = run.commits[step]
        assert report.bitwise and report.weights_sha256_match and report.mismatch is None, step
        assert report.restored_from == restored_from
        # The analysis scores π_old exactly as train_step did: the logged mismatch metrics, to the bit.
        assert (report.kl.k1, report.kl.k2, report.kl.k3) == (
            commit.metrics["kl_k1"], commit.metrics["kl_k2"], commit.metrics["kl_k3"])
        assert (report.ratio.mean, report.ratio.frac_outside) == (
            commit.metrics["ratio_mean"], commit.metrics["ratio_frac_outside"])
        assert report.staleness == commit.staleness
        # The numerics/drift split too (the sampling versions' weights come from the log's blobs): the same
        # figures, to the bit, as the MismatchSplit the mismatch role's function logged.
        assert report.kl_numerics is not None and report.kl_drift is not None
        assert report.split_logged == "event" and report.split_equal is True
        assert analysis.split == run.splits[step].figures
        assert (report.kl_numerics.k3, report.kl_drift.k3) == (
            run.splits[step].figures["numerics_k3"], run.splits[step].figures["drift_k3"])
        assert report.tokens == len(analysis.log_ratio_N) == sum(commit.staleness.values())
    assert any(behind > 0 for behind in run.commits[3].staleness)


def test_logs_from_before_the_mismatch_role_still_replay(tmp_path):
    """Older logs: the split inside StepCommitted.metrics (compared as before), or no split at all."""
    for where, expected in (("metrics", True), ("none", None)):
        run = Run(build_run(tmp_path / where, {"run": {"steps": 3}}, split=where))
        assert not run.splits
        report, analysis = replay_step(run, 3)
        assert report.bitwise and report.split_logged == ("metrics" if where == "metrics" else "")
        assert report.split_equal is expected and analysis.split is not None
        if where == "metrics":
            assert report.kl_drift.k3 == run.commits[3].metrics["drift_k3"] > 0


def test_a_logged_split_that_differs_is_reported(runs, tmp_path):
    run = Run(runs["main"])
    logged = run.splits[3]
    run.splits[3] = msgspec.structs.replace(logged, figures={**logged.figures, "drift_k3": logged.figures["drift_k3"] * 2})
    report, _ = replay_step(run, 3)
    assert report.bitwise and report.split_logged == "event" and report.split_equal is False


def test_json_output_schema(runs, capsys, tmp_path):
    png = tmp_path / "step.png"
    code, out = _json(capsys, "replay", "step", "3", "--run", str(runs["main"]), "--json", "--plot", str(png))
    assert code == 0
    floats = ("loss", "logged_loss", "grad_norm", "logged_grad_norm", "replay_seconds", "original_seconds")
    for key in floats:
        assert isinstance(out[key], float), key
    for key in ("step", "tokens", "restored_from"):
        assert isinstance(out[key], int) and not isinstance(out[key], bool), key
    for key in ("bitwise", "weights_sha256_match", "router_replay"):
        assert isinstance(out[key], bool), key
    for key in ("kl", "kl_without_router_replay"):
        assert set(out[key]) == {"k1", "k2", "k3"} and all(isinstance(v, float) for v in out[key].values())
    assert out["kl_without_fp8_alignment"] is None and out["mismatch"] is None and out["precision"] == "fp32"
    assert set(out["ratio"]) == {"mean", "min", "max", "frac_outside_0.5_2"}
    assert all(k.isdigit() and isinstance(v, int) for k, v in out["staleness"].items())
    assert len(out["router_agreement"]) == 2 and all(0.0 <= a <= 1.0 for a in out["router_agreement"])
    assert out["step"] == 3 and out["bitwise"] is True and out["loss"] == out["logged_loss"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tables_without_json(runs, capsys):
    assert reel(["replay", "step", "2", "--run", str(runs["main"])]) == 0
    out = capsys.readouterr().out
    assert "replay of step 2: bitwise" in out and "without router replay" in out and "versions behind" in out
    assert reel(["replay", "range", "1..4", "--run", str(runs["main"])]) == 0
    assert "steps 1..4 (logged)" in capsys.readouterr().out


def test_range_from_commits_and_recomputed(runs, capsys, tmp_path):
    png = tmp_path / "range.png"
    code, out = _json(capsys, "replay", "range", "2..4", "--run", str(runs["main"]), "--json", "--recompute",
                      "--plot", str(png))
    assert code == 0 and [row["step"] for row in out["steps"]] == [2, 3, 4]
    for row in out["steps"]:
        assert row["recomputed"]["bitwise"] is True
        assert row["recomputed"]["kl"] == row["kl"]  # recomputed from the log = what the trainer logged
        assert isinstance(row["reward_mean"], float) and row["staleness_mean"] >= 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, out = _json(capsys, "replay", "range", "1..2", "--run", str(runs["main"]), "--json")
    assert code == 0 and all(row["recomputed"] is None for row in out["steps"])


def test_mismatch_split_and_numerics_counterfactuals(runs):
    """Stale tokens split into numerics (at their sampling version's weights) and drift; the
    counterfactuals at those weights exist for an R3 run and, for fp8 runs, without alignment."""
    report, _ = replay_step(Run(runs["main"]), 3)
    assert report.kl_drift.k3 > 0 and report.kl_numerics.k3 > 0
    assert report.kl_numerics_without_router_replay is not None and report.kl_numerics_without_fp8_alignment is None
    fp8, _ = replay_step(Run(runs["fp8"]), 2)
    assert fp8.kl_numerics_without_fp8_alignment is not None
    # On-policy steps (no stale token): no drift, numerics = the whole mismatch.
    assert fp8.kl_drift.k3 == 0.0 and fp8.kl_numerics == fp8.kl


def test_bench_from_run_measures_a_runs_latest_weights(runs, capsys):
    for name in ("r3", "fp8"):
        assert reel(["bench", name, "--quick", "--from-run", str(runs["main"])]) == 0
        out = orjson.loads(capsys.readouterr().out)
        assert out["bench"] == name and out["from_run"] == str(runs["main"]) and out["version"] == 4
        assert out["tokens"] > 0 and out["ratio"] > 0
    assert reel(["bench", "r3", "--quick", "--from-run", str(runs["main"] / "nope")]) == 1
    assert "not a Reel run directory" in capsys.readouterr().err


def test_router_replay_brings_the_trainer_closer_to_inference(runs):
    """bf16 sampling flips some top-k choices of undecided routers; replaying them lowers the KL."""
    run = Run(runs["r3"])
    flipped = 0
    for step in sorted(run.commits):
        report, _ = replay_step(run, step)
        assert report.bitwise
        if min(report.router_agreement) < 1.0:
            flipped += 1
            assert report.kl_without_router_replay.k3 > report.kl.k3, step
        else:
            assert report.kl_without_router_replay == report.kl
    assert flipped >= 2


def test_fp8_counterfactual(runs):
    run = Run(runs["fp8"])
    report, _ = replay_step(run, 2)
    assert report.bitwise and report.precision == "fp8"
    # The engine sampled in fp8 too: scoring in bf16 instead moves the trainer away from it.
    assert report.kl_without_fp8_alignment is not None
    assert report.kl_without_fp8_alignment.k3 > report.kl.k3


def test_tampered_trajectory_is_detected_not_replayed(runs, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(runs["main"], run_dir)
    with RunLog(run_dir, readonly=True) as run_log:
        record = next(run_log.stream("trajectories").records())
    with open(record.segment, "r+b") as f:
        f.seek(record.offset + 8 + len(record.data) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(LogCorrupted, match=f"byte {record.offset} of segment {record.segment}"):
        replay_step(Run(run_dir), 1)  # read through the log index when step 1 needs the group
    for index in run_dir.glob("index.sqlite*"):
        index.unlink()
    # Indexing the log afresh finds the damage at open; the steps before it stay replayable
    # (tests/bus/test_log_damage.py), and a step that needs the damaged record is refused, naming it.
    assert f"byte {record.offset} of segment {record.segment}" in Run(run_dir).damage
    assert reel(["replay", "step", "1", "--run", str(run_dir), "--json"]) == 2  # an error, not "did not reproduce"
    captured = capsys.readouterr()
    assert captured.out == "" and "corrupted" in captured.err and record.segment.name in captured.err


def test_step_outside_the_log_names_the_range(runs, capsys):
    for step in ("0", "5"):
        assert reel(["replay", "step", step, "--run", str(runs["main"])]) == 2
        assert capsys.readouterr().err.strip() == (
            f"reel: step {step} is not in the log of {runs['main']}, which holds steps 1..4")
    assert reel(["replay", "range", "3..9", "--run", str(runs["main"])]) == 2
    assert "step 5 (of the range 3..9) is not in the log" in capsys.readouterr().err
    assert reel(["replay", "range", "3-4", "--run", str(runs["main"])]) == 2
    assert "must be A..B" in capsys.readouterr().err
    with pytest.raises(StepNotLogged):
        replay_step(Run(runs["main"]), 7)


def test_changed_config_is_named(runs, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(runs["main"], run_dir)
    config = run_dir / "config.toml"
    config.write_text(config.read_text().replace("lr = 0.001", "lr = 0.002"))
    # Step 3 starts from the checkpoint of step 2: it runs, and says why it differs.
    code = reel(["replay", "step", "3", "--run", str(run_dir), "--json"])
    captured = capsys.readouterr()
    out = orjson.loads(captured.out)
    assert code == 1 and out["bitwise"] is False and out["weights_sha256_match"] is False
    assert "config hash" in out["mismatch"] and out["logged_loss"] == out["loss"]  # lr acts after the loss
    assert captured.err.startswith("reel: step 3 did not reproduce: ") and "config hash" in captured.err
    # range --recompute: the same verdict, exit 1, the reason per step on stderr.
    code = reel(["replay", "range", "3..3", "--run", str(run_dir), "--recompute", "--json"])
    captured = capsys.readouterr()
    recomputed = orjson.loads(captured.out)["steps"][0]["recomputed"]
    assert code == 1 and recomputed["bitwise"] is False and "config hash" in recomputed["mismatch"]
    assert captured.err.startswith("reel: step 3 did not reproduce: ")
    # Step 4 needs step 3 re-executed first: that catch-up step must reproduce, so it raises.
    with pytest.raises(ReplayMismatch, match="step 3 re-executed to different weights .*config hash"):
        replay_step(Run(run_dir), 4)
    # A range that starts at the checkpoint runs, and exits 1 because its steps do not reproduce.
    code, out = _json(capsys, "replay", "range", "3..4", "--run", str(run_dir), "--json", "--recompute")
    assert code == 1 and [row["recomputed"]["bitwise"] for row in out["steps"]] == [False, False]
