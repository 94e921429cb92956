"""examples/moe_mismatch.toml, cut to 3 steps and run for real (`reel run`: processes, Redis, the
built-in engine sampling in bf16 one version ahead of the fp32 trainer), then replayed.

On its trained steps (π_old after at least one update) the counterfactuals must show what the
example is for: KL without router replay above KL with it, and the logged mismatch split
(numerics at the sampling version's weights, drift from it to π_old) recomputed bitwise.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import orjson
import pytest

from reel.runtime.config import run as config_mod
from reel.runtime.launch.cli import main as reel
from paths import REPO

pytestmark = pytest.mark.slow
EXAMPLE = REPO / "examples" / "moe_mismatch.toml"


def test_trained_steps_show_more_kl_without_router_replay(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    example = config_mod.load(EXAMPLE)
    assert (example.engine.precision, example.trainer.precision) == ("bf16", "fp32")
    assert example.rollout.async_level >= 1 and example.trainer.router_replay
    short = msgspec.structs.replace(example, run=msgspec.structs.replace(example.run, steps=3))
    config = tmp_path / "moe_mismatch.toml"
    config.write_text(config_mod.to_toml(short))
    run_dir = tmp_path / "run"
    assert reel(["run", str(config), "--out", str(run_dir), "--no-live"]) == 0
    capsys.readouterr()

    assert reel(["replay", "range", "2..3", "--run", str(run_dir), "--recompute", "--json"]) == 0
    steps = orjson.loads(capsys.readouterr().out)["steps"]
    for row in steps:
        recomputed = row["recomputed"]
        assert recomputed["bitwise"], row["step"]
        with_r3, without_r3 = recomputed["kl"]["k3"], recomputed["kl_without_router_replay"]["k3"]
        assert without_r3 > with_r3 > 0, (row["step"], with_r3, without_r3)
        assert recomputed["router_agreement_mean"] < 1.0
        # The split the mismatch role logged (MismatchSplit) is what replay computes from the log's weights.
        assert recomputed["kl_numerics"] == row["kl_numerics"] and recomputed["kl_drift"] == row["kl_drift"]
        assert row["kl_numerics"]["k3"] > 0
    assert any(row["staleness_mean"] > 0 and row["kl_drift"]["k3"] > 0 for row in steps)
