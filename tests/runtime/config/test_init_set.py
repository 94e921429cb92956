"""`reel init` writes a config that loads (for each task, and on an HF model directory), and
`--set section.key=value` overrides keys of run, retrain and simulate, recorded in the config
the run keeps; an empty config is refused unless --defaults."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from reel.bus.events import RunStarted, StepCommitted
from reel.bus.run_log import RunLog
from reel.replay.export import export
from reel.runtime.config import run as config_mod
from reel.replay.simulate_cli import _scenario
from reel.replay.workload import Pipeline
from reel.runtime.launch.cli import main
from reel.runtime.launch.cli_commands import build_parser
from runbuilder import build_run, e2e_config


@pytest.fixture(scope="module")
def source_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_run(tmp_path_factory.mktemp("init-set") / "run", {"run": {"name": "setsource"}})


@pytest.mark.parametrize("task", ["reverse_text", "sort_digits", "arith", "calc_tool"])
def test_init_writes_a_config_that_loads(tmp_path: Path, task: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "c.toml"
    assert main(["init", "--task", task, "--out", str(out)]) == 0
    config = config_mod.load(out)
    assert (config.env.name, config.run.name) == (task, task)
    assert f"reel run {out}" in capsys.readouterr().out
    assert main(["init", "--task", task, "--out", str(out)]) == 2  # never overwrites
    assert "already exists" in capsys.readouterr().err


def test_init_from_an_hf_model_directory(source_run: Path, tmp_path: Path) -> None:
    model_dir = export(source_run, None, tmp_path / "model")
    out = tmp_path / "c.toml"
    assert main(["init", "--from-model", str(model_dir), "--task", "reverse_text", "--out", str(out)]) == 0
    config = config_mod.load(out)
    assert config.model.path == str(model_dir.resolve()) and config.init.warmup_steps == 0
    assert main(["init", "--from-model", str(tmp_path), "--out", str(tmp_path / "d.toml")]) == 2


@pytest.mark.slow  # a whole `reel run` (the quick tier leaves it to CI)
def test_run_set_overrides_are_recorded_and_an_empty_config_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.toml"
    empty.write_text("# nothing yet\n")
    reel = [sys.executable, "-m", "reel.runtime.launch.cli", "run"]
    refused = subprocess.run([*reel, str(empty), "--no-live"], capture_output=True, text=True, cwd=tmp_path)
    assert refused.returncode == 2 and "sets no key" in refused.stderr and "--defaults" in refused.stderr
    assert not (tmp_path / "runs").exists()
    (tmp_path / "runs" / "run").mkdir(parents=True)  # --defaults gets past the check (and stops at this one)
    accepted = subprocess.run([*reel, str(empty), "--defaults"], capture_output=True, text=True, cwd=tmp_path)
    assert accepted.returncode == 1 and "already exists" in accepted.stderr

    config = e2e_config(tmp_path / "c.toml", "setrun", 5)
    run_dir = tmp_path / "run"
    done = subprocess.run([*reel, str(config), "--out", str(run_dir), "--no-live", "--set", "run.steps=2",
                           "--set", "rollout.temperature=0.9"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    recorded = tomllib.loads((run_dir / "config.toml").read_text())
    assert recorded["run"]["steps"] == 2 and recorded["rollout"]["temperature"] == 0.9
    with RunLog(run_dir, readonly=True) as log:
        assert [e.step for _, e in log.events("steps") if isinstance(e, StepCommitted)] == [1, 2]
        started = [e for _, e in log.events("control") if isinstance(e, RunStarted)]
    assert "temperature = 0.9" in started[0].config_toml
    bad = subprocess.run([*reel, str(config), "--set", "trainer.lr"], capture_output=True, text=True)
    assert bad.returncode == 2 and "must be section.key=value" in bad.stderr


def test_retrain_set_overrides_the_new_runs_config(source_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "b"
    assert main(["retrain", "--from", str(source_run), "--out", str(out), "--steps", "1",
                 "--set", "trainer.lr=0.01"]) == 0
    assert config_mod.load(out / "config.toml").trainer.lr == 0.01


def test_simulate_set_gives_the_scenario_its_flag_gives(capsys: pytest.CaptureFixture[str]) -> None:
    logged = Pipeline(rollout_workers=1, concurrency=4, group_size=4, max_batch=8, async_level=1, batch_groups=4,
                      max_off_policy=2, steps=10)
    parse = build_parser().parse_args
    by_flag = _scenario(parse(["simulate", "--run", "r", "--async-level", "2", "--steps", "30"]), logged)
    by_set = _scenario(parse(["simulate", "--run", "r", "--set", "rollout.async_level=2", "--set", "run.steps=30"]),
                       logged)
    assert by_set == by_flag and by_set.pipeline.async_level == 2 and by_set.pipeline.steps == 30
    assert main(["simulate", "--run", "r", "--set", "model.hidden_size=8"]) == 1
    assert "simulate models only rollout.workers" in capsys.readouterr().err
