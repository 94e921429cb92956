"""The instability debugger: `reel replay bisect` on a run made unstable on purpose, `reel compare`.

One run built in-process (tests/support/runbuilder.py: bf16 engine, fp32 trainer, every other group one
version stale) whose step 5 trains with a 30x learning rate (trainer.lr_spike_step). The spike
moves the policy at step 5, so step 6, trained on rollouts sampled before it, is the first whose
mismatch KL jumps, through policy drift (staleness).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import orjson
import pytest
import torch

from reel.replay.analysis import Run
from reel.replay.bisect import bisect
from reel.runtime.launch.cli import main as reel
from runbuilder import build_run

pytestmark = pytest.mark.slow
torch.set_num_threads(1)
SPIKE = 5


@pytest.fixture(scope="module")
def spiked(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("debugger")
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        mp.setenv("REEL_CACHE", str(root / "cache"))
        warnings.filterwarnings("ignore", message="Converting a tensor with requires_grad", category=UserWarning)
        return build_run(root / "spiked", {"run": {"steps": 7},
                                           "trainer": {"lr_spike_step": SPIKE, "lr_spike_factor": 30.0}})


def _threshold(run: Run) -> float:
    """Ten times the largest mismatch KL logged before the spike could show."""
    return 10 * max(run.commits[s].metrics["kl_k3"] for s in range(1, SPIKE + 1))


def test_bisect_finds_the_injected_step_and_names_staleness_first(spiked: Path) -> None:
    run = Run(spiked)
    report = bisect(run, "kl_k3", _threshold(run), above=True)
    assert report.first_crossing == SPIKE + 1  # the first step trained on rollouts from before the spike
    assert report.culprit_update == SPIKE
    assert [w.step for w in report.window] == [SPIKE - 2, SPIKE - 1, SPIKE, SPIKE + 1, SPIKE + 2]
    assert all(w.bitwise for w in report.window)
    assert report.causes[0].name == "staleness"
    assert report.causes[0].growth > 10 * max(c.growth for c in report.causes[1:] if c.name != "tail")
    at = next(w for w in report.window if w.step == SPIKE + 1)
    assert at.staleness > 0.5 * at.kl_k3  # drift carries most of the mismatch at the crossing


def test_bisect_cli_json_plot_and_exit_codes(spiked: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    threshold = _threshold(Run(spiked))
    png = tmp_path / "bisect.png"
    assert reel(["replay", "bisect", "--run", str(spiked), "--metric", "kl_k3", "--above", str(threshold),
                 "--before", "1", "--after", "0", "--json", "--plot", str(png)]) == 0
    out = orjson.loads(capsys.readouterr().out)
    assert out["first_crossing"] == SPIKE + 1 and [w["step"] for w in out["window"]] == [SPIKE, SPIKE + 1]
    assert out["causes"][0]["name"] == "staleness"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Never crossing is an answer, not an error: the table says so, exit 1 like grep.
    assert reel(["replay", "bisect", "--run", str(spiked), "--metric", "kl_k3", "--above", "1e9"]) == 1
    assert "never goes above" in capsys.readouterr().out
    assert reel(["replay", "bisect", "--run", str(spiked), "--metric", "kl_k4", "--above", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "kl_k4" in err and "kl_k3" in err


def test_compare_finds_where_a_retrain_with_another_lr_parts(spiked: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    plain, lower = tmp_path / "plain", tmp_path / "lower"
    assert reel(["retrain", "--from", str(spiked), "--out", str(plain)]) == 0
    override = tmp_path / "lr.toml"
    override.write_text("[trainer]\nlr = 3e-4\n")
    assert reel(["retrain", "--from", str(spiked), "--out", str(lower), "--config", str(override)]) == 0
    capsys.readouterr()

    assert reel(["compare", str(spiked), str(plain), "--json"]) == 0
    same = orjson.loads(capsys.readouterr().out)
    assert same["first_differing_step"] is None
    assert len(same["steps"]) == 7 and all(s["same_weights"] for s in same["steps"])

    png = tmp_path / "compare.png"
    assert reel(["compare", str(spiked), str(lower), "--json", "--plot", str(png)]) == 0
    parted = orjson.loads(capsys.readouterr().out)
    assert parted["first_differing_step"] == 1
    assert [s["a"]["reward"] for s in parted["steps"]] == [s["b"]["reward"] for s in parted["steps"]]  # same batches
    assert parted["steps"][-1]["a"]["grad_norm"] != parted["steps"][-1]["b"]["grad_norm"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert reel(["compare", str(spiked), str(tmp_path / "nope")]) == 1
    assert "not a Reel run directory" in capsys.readouterr().err
