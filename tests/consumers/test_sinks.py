"""W&B, TensorBoard and MLflow sinks: what each writes is read back with the library's own reader
and compared, step by step, with the StepCommitted and EvalResult events of the run's log."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reel.bus.events import EvalResult, MismatchSplit, StepCommitted, encode
from reel.bus.run_log import RunLog
from reel.runtime.config.keys import ConfigError
from reel.runtime.config.run import loads
from runbuilder import MISMATCH_ROLE, build_run, e2e_config

# The tracking extra is installed on the test path (ops/install.sh).
from mlflow.tracking import MlflowClient  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator  # noqa: E402

from reel.consumers.sinks.mlflow_sink import default_uri, find_run  # noqa: E402
from reel.consumers.sinks.wandb_records import history_rows, records  # noqa: E402
from reel.consumers.sinks.wandb_sink import run_files  # noqa: E402

STEPS = 60
EVAL_STEPS = (10, 20, 30, 40, 50, 60)
SINKS = ("tensorboard", "mlflow", "wandb")


def _reel(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "reel.runtime.launch.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def _expected(run_dir: Path) -> tuple[dict[int, dict[str, float]], ...]:
    """From the log, written out here from the event fields: step -> figures, eval step -> scores,
    step -> the mismatch role's split."""
    steps, evals, splits = {}, {}, {}
    with RunLog(run_dir, readonly=True) as log:
        for _, e in log.events("steps"):
            if isinstance(e, MismatchSplit):
                splits[e.step] = {f"mismatch/{k}": v for k, v in e.figures.items()} | {"mismatch/lag_steps": e.lag_steps}
            if isinstance(e, StepCommitted):
                figures = {"loss": e.loss, "grad_norm": e.grad_norm, "groups": len(e.groups), "dropped": len(e.dropped),
                           **e.metrics, **{f"staleness/{k}": n for k, n in e.staleness.items()}}
                tokens = sum(e.staleness.values())
                figures["staleness_mean"] = sum(k * n for k, n in e.staleness.items()) / tokens
                wall = e.timing.wait + e.timing.compute + e.timing.publish
                figures["tokens_per_s"] = tokens / wall
                figures["idle_share"] = e.timing.wait / wall
                steps[e.step] = figures
        for _, e in log.events("control"):
            if isinstance(e, EvalResult):
                evals[e.step] = {"eval/mean_reward": e.mean_reward, "eval/pass_at_1": e.pass_at_1,
                                 "eval/pass_at_k": e.pass_at_k, **{f"eval/task/{t}": v for t, v in e.per_task.items()}}
    return steps, evals, splits


def _splits_of(steps: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    """The mismatch/* figures of a tracker that writes them with the step's own (TensorBoard, MLflow)."""
    found = {step: {k: v for k, v in figures.items() if k.startswith("mismatch/")} for step, figures in steps.items()}
    return {step: figures for step, figures in found.items() if figures}


def _add_evals(run_dir: Path) -> None:
    """EvalResults as the eval role publishes them: each one behind the trainer (after step s + 2's commit)."""
    with RunLog(run_dir) as log:
        after = {e.step: entry for entry, e in log.events("steps") if isinstance(e, StepCommitted)}
        for i, step in enumerate(EVAL_STEPS):
            event = EvalResult(run="sinkrun", producer="eval", seq=i, version=step, step=step, env="reverse_text",
                               prompts=16, samples_per_prompt=4, mean_reward=0.1 + step / 100, pass_at_1=step / 200,
                               pass_at_k=step / 90, per_task={"short": step / 70})
            entry = after[min(step + 2, STEPS)].split("-")[0]
            log.stream("control").append_batch([(f"{entry}-1", encode(event))])


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = build_run(tmp_path_factory.mktemp("sinks") / "run",
                        {"run": {"name": "sinkrun", "steps": STEPS}, "trainer": {"checkpoint_every": STEPS}})
    _add_evals(run_dir)
    return run_dir


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-7)  # TensorBoard keeps float32


def _assert_matches(got: dict[int, dict[str, float]], want: dict[int, dict[str, float]], what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: steps {sorted(set(got) ^ set(want))} differ"
    for step, figures in want.items():
        for name, value in figures.items():
            assert name in got[step], f"{what}: step {step} lacks {name}"
            assert _close(got[step][name], value), f"{what}: step {step} {name} = {got[step][name]}, log {value}"


# ------------------------------------------------------------ readers: each library's own


def _tensorboard(directory: Path) -> tuple[dict[int, dict[str, float]], int]:
    """step -> tag -> value, and how many points were written more than once."""
    accumulator = EventAccumulator(str(directory), size_guidance={SCALARS: 0})
    accumulator.Reload()
    by_step: dict[int, dict[str, float]] = {}
    repeats = 0
    for tag in accumulator.Tags()["scalars"]:
        points = accumulator.Scalars(tag)
        repeats += len(points) - len({p.step for p in points})
        for p in points:
            by_step.setdefault(p.step, {})[tag] = p.value
    return by_step, repeats


def _read_tensorboard(run_dir: Path) -> tuple[dict, dict, dict, int]:
    steps, repeats = _tensorboard(run_dir / "tracking" / "tensorboard")
    evals, eval_repeats = _tensorboard(run_dir / "tracking" / "tensorboard" / "eval")
    return steps, evals, _splits_of(steps), repeats + eval_repeats


def _read_mlflow(run_dir: Path, name: str) -> tuple[dict, dict, dict, int]:
    client = MlflowClient(default_uri(run_dir))
    run = find_run(client, client.get_experiment_by_name("reel").experiment_id, name)
    steps: dict[int, dict[str, float]] = {}
    evals: dict[int, dict[str, float]] = {}
    repeats = 0
    for key in run.data.metrics:
        history = client.get_metric_history(run.info.run_id, key)
        repeats += len(history) - len({m.step for m in history})
        for m in history:
            (evals if key.startswith("eval/") else steps).setdefault(m.step, {})[key] = m.value
    assert run.data.params["run.name"] == name and run.data.tags["reel.code_version"] != "unknown"
    return steps, evals, _splits_of(steps), repeats


def _read_wandb(run_dir: Path, name: str) -> tuple[dict, dict, dict, int]:
    steps: dict[int, dict[str, float]] = {}
    lagging: dict[str, dict[int, dict[str, float]]] = {"eval/": {}, "mismatch/": {}}  # on their own axes
    repeats = 0
    for path in run_files(run_dir / "tracking", name):
        for step, row in history_rows(path):
            train = {k: v for k, v in row.items() if not k.startswith(("eval/", "mismatch/"))}
            if train:
                repeats += step in steps
                steps[step] = train
            for prefix, by_step in lagging.items():
                if f"{prefix}step" in row:
                    at = int(row[f"{prefix}step"])
                    repeats += at in by_step
                    by_step[at] = {k: v for k, v in row.items() if k.startswith(prefix) and k != f"{prefix}step"}
    configs = [r for path in run_files(run_dir / "tracking", name) for r in records(path)
               if r.WhichOneof("record_type") == "config"]
    assert any(item.key == "code_version" for r in configs for item in r.config.update)
    return steps, lagging["eval/"], lagging["mismatch/"], repeats


def _read(sink: str, run_dir: Path, name: str) -> tuple[dict, dict, dict, int]:
    if sink == "tensorboard":
        return _read_tensorboard(run_dir)
    return (_read_mlflow if sink == "mlflow" else _read_wandb)(run_dir, name)


# ------------------------------------------------------------ tests


@pytest.mark.slow
@pytest.mark.parametrize("sink", SINKS)
def test_a_finished_run_is_backfilled_whole_and_a_rerun_adds_nothing(finished_run: Path, sink: str) -> None:
    first = _reel("metrics", sink, "--run", str(finished_run))
    assert first.returncode == 0, first.stderr
    assert f"wrote {STEPS} new steps" in first.stdout
    again = _reel("metrics", sink, "--run", str(finished_run))
    assert again.returncode == 0 and "wrote 0 new steps" in again.stdout, again.stderr
    steps, evals, splits, repeats = _read(sink, finished_run, "sinkrun")
    want_steps, want_evals, want_splits = _expected(finished_run)
    assert len(want_steps) == STEPS and sorted(want_evals) == list(EVAL_STEPS) and len(want_splits) == STEPS
    _assert_matches(steps, want_steps, sink)
    _assert_matches(evals, want_evals, f"{sink} evals")
    _assert_matches(splits, want_splits, f"{sink} mismatch splits")
    assert repeats == 0


def test_an_unknown_sink_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"metrics\.sinks"):
        loads('[metrics]\nsinks = ["neptune"]\n')


def test_a_missing_library_names_the_extra(tmp_path: Path) -> None:
    config = e2e_config(tmp_path / "c.toml", "nolib", 2, {"metrics": {"sinks": ["wandb"]}})
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['wandb'] = None  # as if not installed\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "reel.runtime.launch.cli", "run", str(config), "--out",
                             str(tmp_path / "run"), "--no-live"], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "the wandb sink needs wandb" in result.stderr and "pip install 'reel-rl[tracking]'" in result.stderr
    assert not (tmp_path / "run").exists()


def _steps_in_tensorboard(run_dir: Path) -> int:
    directory = run_dir / "tracking" / "tensorboard"
    return len(_tensorboard(directory)[0]) if directory.is_dir() else 0


@pytest.mark.slow
def test_sink_roles_killed_mid_run_and_restarted_leave_no_gap_and_no_duplicate(tmp_path: Path) -> None:
    """`reel run` with every sink as a role; each is killed with SIGKILL mid-run (training goes on)
    and restarted with `reel metrics NAME --follow`, as the supervisor's message says."""
    steps = 16
    run_dir = tmp_path / "run"
    config = e2e_config(tmp_path / "c.toml", "sinklive", steps, {"metrics": {"sinks": list(SINKS)}, **MISMATCH_ROLE})
    launcher = subprocess.Popen([sys.executable, "-m", "reel.runtime.launch.cli", "run", str(config), "--out",
                                 str(run_dir), "--no-live"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    followers = []
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and _steps_in_tensorboard(run_dir) < 2:
            assert launcher.poll() is None, launcher.communicate()
            time.sleep(0.5)
        for sink in SINKS:
            pid = int((run_dir / "roles" / f"sink-{sink}.pid").read_text())
            os.kill(pid, signal.SIGKILL)
        # The event file is written in order, so every step below the last one on disk is whole; the last
        # may have been cut between two of its scalars, and the restart completes it.
        whole_in_tensorboard = _steps_in_tensorboard(run_dir) - 1
        with RunLog(run_dir, readonly=True) as log:
            committed = sum(isinstance(e, StepCommitted) for _, e in log.events("steps"))
        assert committed < steps, "the run finished before the sinks were killed; lengthen it"
        time.sleep(2)
        for sink in SINKS:
            followers.append(subprocess.Popen([sys.executable, "-m", "reel.runtime.launch.cli", "metrics", sink, "--run",
                                               str(run_dir), "--follow"], stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True))
        out, err = launcher.communicate(timeout=600)
        assert launcher.returncode == 0, err
        assert "role sink-tensorboard stopped" in err and "training goes on" in err
        for sink, follower in zip(SINKS, followers):
            f_out, f_err = follower.communicate(timeout=300)
            assert follower.returncode == 0, f_err
            resumed = int(re.search(r"wrote (\d+) new steps", f_out).group(1))
            # TensorBoard held >= 1 whole step when it was killed: the restart wrote only the rest.
            assert resumed <= (steps - whole_in_tensorboard if sink == "tensorboard" else steps), f_out
    finally:
        for process in (launcher, *followers):
            if process.poll() is None:
                process.kill()
    want_steps, _, _ = _expected(run_dir)
    assert sorted(want_steps) == list(range(1, steps + 1))
    for sink in SINKS:
        got, _, _, repeats = _read(sink, run_dir, "sinklive")
        _assert_matches(got, want_steps, sink)
        assert repeats == 0, f"{sink} wrote {repeats} points twice"
