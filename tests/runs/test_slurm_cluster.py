"""`reel launch slurm` against a real Slurm cluster (marker `slurm`; start one on this host with
`ops/slurm/local_cluster.sh start`). These tests fail, never skip, when Slurm does not answer.

Trivial heterogeneous jobs drive the job script's supervision (ops/slurm/reel.sbatch): the run ends
when the finisher exits 0, a failing component ends the job with its code and name, `reel launch
cancel` stops every component with SIGTERM. Then the example run goes end to end through Slurm, once
with a rollout worker frozen (SIGSTOP) mid-run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reel.bus.events import EvalResult, RunFinished
from reel.bus.run_log import RunLog
from reel.runtime.heartbeat import read_beats
from reel.runtime.launch import slurm
from reel.runtime.launch import slurm_script
from reel.runtime.launch.cli import main
from paths import REPO
from stall_config import reverse_text_with_stall_bound

pytestmark = pytest.mark.slurm
ROOT = REPO
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL"}


@pytest.fixture(scope="module", autouse=True)
def cluster() -> None:
    try:
        done = subprocess.run(["sinfo", "-h", "-o", "%D %t"], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        pytest.fail("Slurm is not installed: run ops/slurm/local_cluster.sh start")
    assert done.returncode == 0 and done.stdout.strip(), \
        f"sinfo does not answer ({done.stderr.strip()}): run ops/slurm/local_cluster.sh start"


def components_state(job: str) -> list[tuple[str, str]]:
    """(JobState, ExitCode) of each component of a job."""
    shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, check=True).stdout
    return re.findall(r"JobState=(\S+).*?ExitCode=(\S+)", shown, re.S)


def wait_done(job: str, timeout: float) -> list[tuple[str, str]]:
    deadline = time.monotonic() + timeout
    while True:
        states = components_state(job)
        if states and all(state in FINAL for state, _ in states):
            return states
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job])
            pytest.fail(f"job {job} still {states} after {timeout:.0f} s")
        time.sleep(0.5)


def trivial_job(run_dir: Path, first: str, second: str, finisher: str = "second") -> str:
    """A two-component job: `first` on het group 0, `second` (2 tasks) on het group 1."""
    components = [slurm_script.Component("first", 1, ["--nodes=1", "--ntasks=1"], first),
                  slurm_script.Component("second", 1, ["--nodes=1", "--ntasks=2"], second)]
    body = "\n".join([
        slurm_script.start_line("first", 0, "first.log", ["--nodes=1", "--ntasks=1"], ["bash", "-c", first]),
        slurm_script.start_line("second", 1, "second-%t.log", ["--nodes=1", "--ntasks=2"], ["bash", "-c", second]),
    ])
    settings = {"RUN_DIR": str(run_dir), "RUN_NAME": "trivial", "PYTHON": sys.executable,
                "FINISHER": finisher, "DRAINER": ""}
    return slurm_script.job_script(header="# trivial two-component job", components=components,
                            opts=slurm_script.JobOptions(time="00:05:00"), job_name="reel-test",
                            output=f"{run_dir}/slurm/job-%j.out", chdir=str(run_dir), settings=settings, body=body)


SERVE = 'trap "echo stopped by TERM > MARKS/$SLURM_STEP_ID-$SLURM_PROCID; exit 0" TERM; echo "first on $SLURMD_NODENAME"; sleep 600 & wait'


def serving(tmp_path: Path) -> tuple[str, Path]:
    """A component that runs until TERM, and the folder where each of its tasks marks the TERM (its
    own file: a line on stdout can be lost when srun itself is being stopped)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    return SERVE.replace("MARKS", str(marks)), marks


def stopped_by_term(marks: Path) -> int:
    return sum(m.read_text() == "stopped by TERM\n" for m in marks.iterdir())


def test_finisher_exit_0_ends_the_job_and_stops_the_rest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    serve, marks = serving(tmp_path)
    job = slurm.submit(tmp_path, trivial_job(tmp_path, serve, 'sleep 2; echo "task $SLURM_PROCID of second"'))
    assert (tmp_path / "slurm_job_id").read_text().strip() == job
    assert main(["launch", "status", "--run", str(tmp_path)]) == 0
    assert f"job {job}" in capsys.readouterr().out
    states = wait_done(job, 60)
    assert states == [("COMPLETED", "0:0")] * 2
    out = (tmp_path / "slurm" / f"job-{job}.out").read_text()
    assert "reel: second finished" in out and "reel: run finished" in out
    assert stopped_by_term(marks) == 1
    assert [(tmp_path / "roles" / f"second-{t}.log").read_text().strip() for t in (0, 1)] == \
        ["task 0 of second", "task 1 of second"]
    assert main(["launch", "status", "--run", str(tmp_path)]) == 0
    assert "COMPLETED" in capsys.readouterr().out


def test_a_failing_component_ends_the_job_with_its_code(tmp_path: Path) -> None:
    serve, marks = serving(tmp_path)
    job = slurm.submit(tmp_path, trivial_job(tmp_path, serve, "sleep 1; exit 3", finisher="third"))
    states = wait_done(job, 60)
    assert states[0] == ("FAILED", "3:0")
    out = (tmp_path / "slurm" / f"job-{job}.out").read_text()
    assert "reel: component second exited with code 3 before the run finished" in out
    assert stopped_by_term(marks) == 1


def test_cancel_stops_every_component_with_sigterm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    serve, marks = serving(tmp_path)
    job = slurm.submit(tmp_path, trivial_job(tmp_path, serve, serve.replace("first", "second")))
    logs = [tmp_path / "roles" / name for name in ("first.log", "second-0.log", "second-1.log")]
    deadline = time.monotonic() + 60
    while not all(log.exists() and " on " in log.read_text() for log in logs):  # printed after the trap is set
        assert time.monotonic() < deadline, "the components did not start"
        time.sleep(0.2)
    # The job script signals steps it finds with squeue: wait until Slurm lists both (a cancel in the
    # first instants after a step starts can miss it; known limitation, see the closing note).
    while not {"first", "second"} <= set(subprocess.run(["squeue", "-h", "-s", "-o", "%j"], capture_output=True,
                                                          text=True).stdout.split()):
        assert time.monotonic() < deadline, "Slurm never listed the job's steps"
        time.sleep(0.2)
    assert main(["launch", "cancel", "--run", str(tmp_path)]) == 0
    assert f"cancelled Slurm job {job}" in capsys.readouterr().out
    states = wait_done(job, 60)
    assert {state for state, _ in states} == {"CANCELLED"}
    assert stopped_by_term(marks) == 3


@pytest.mark.slow
def test_reverse_text_runs_end_to_end_through_slurm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With [eval]: the eval role runs as a step of its own and scores the last version before the end."""
    text = (ROOT / "examples" / "reverse_text.toml").read_text()
    text = re.sub(r"(?m)^steps = \d+", "steps = 2", text)
    text = re.sub(r"(?m)^warmup_steps = \d+", "warmup_steps = 5", text)
    text += "\n[eval]\nevery = 2\nprompts = 4\nsamples_per_prompt = 2\n"
    path = tmp_path / "reverse_text.toml"
    path.write_text(text)
    run_dir = tmp_path / "run"
    assert main(["launch", "slurm", str(path), "--run-dir", str(run_dir), "--time", "00:10:00"]) == 0
    job = (run_dir / "slurm_job_id").read_text().strip()
    states = wait_done(job, 300)
    out = (run_dir / "slurm" / f"job-{job}.out").read_text()
    assert states == [("COMPLETED", "0:0")] * 3, out
    assert "reel: run finished" in out
    assert "reel: one Redis user per role" in out  # the roles ran on their own users (no URL is exported)
    assert "reel: started eval (het group 1)" in out
    assert not (run_dir / "bus_url").exists() and not list(run_dir.glob("bus_url.*"))
    with RunLog(run_dir, readonly=True) as log:
        evaluated = [e.version for _, e in log.events("control") if isinstance(e, EvalResult)]
    assert evaluated and evaluated[-1] == 2, (run_dir / "roles" / "eval.log").read_text()
    capsys.readouterr()
    assert main(["log", "verify", "--run", str(run_dir)]) == 0
    verified = capsys.readouterr().out
    assert re.search(r"steps\s+4 records", verified), verified  # 2 StepCommitted + the mismatch role's 2 MismatchSplit
    for step in (1, 2):  # the run replays bit for bit from its log, like a local one
        assert main(["replay", "step", str(step), "--run", str(run_dir), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["bitwise"] is True


@pytest.mark.slow
def test_a_frozen_rollout_worker_is_restarted_in_its_pool_and_the_run_finishes(tmp_path: Path,
                                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """SIGSTOP of rollout worker 0 mid-run: the job's watcher names it, its task's watcher kills it and
    starts it again in place (the step and the job never see it), and the run completes and verifies."""
    path = reverse_text_with_stall_bound(tmp_path, steps=10, stall_s=15)
    run_dir = tmp_path / "run"
    assert main(["launch", "slurm", str(path), "--run-dir", str(run_dir), "--time", "00:10:00"]) == 0
    job = (run_dir / "slurm_job_id").read_text().strip()
    deadline = time.monotonic() + 240
    while True:  # worker 0 under way: it has published groups
        beats = read_beats(run_dir / "roles")
        if beats.get("rollout-0") is not None and beats["rollout-0"].progress_count >= 2:
            break
        assert time.monotonic() < deadline and not all(s in FINAL for s, _ in components_state(job)), \
            "rollout worker 0 never published"
        time.sleep(0.2)
    frozen = int((run_dir / "roles" / "rollout-0.pid").read_text())
    os.kill(frozen, signal.SIGSTOP)
    states = wait_done(job, 300)
    out = (run_dir / "slurm" / f"job-{job}.out").read_text()
    worker_log = (run_dir / "roles" / "rollout-0.log").read_text()
    assert states == [("COMPLETED", "0:0")] * 3, out + worker_log
    assert "reel: rollout-0 was killed, which had stalled, and started again by its task's watcher (restart 1)" \
        in out  # said in the job's output
    assert "reel: rollout-0 has made no progress for " in worker_log
    assert worker_log.count("reel: killed rollout-0, which had stalled, and started it again") == 1, worker_log
    assert int((run_dir / "roles" / "rollout-0.pid").read_text()) != frozen
    assert "reel: run finished" in out
    assert main(["log", "verify", "--run", str(run_dir)]) == 0
    capsys.readouterr()
    assert main(["replay", "step", "10", "--run", str(run_dir), "--json"]) == 0  # a step after the restart
    assert json.loads(capsys.readouterr().out)["bitwise"] is True


def _trainer_pid(run_dir: Path) -> int | None:
    """The trainer role's process (torchrun's child), found by its command line."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"trainer" in argv and str(run_dir).encode() in argv and not any(b"torchrun" in a for a in argv):
            return int(proc.name)
    return None


@pytest.mark.slow
def test_a_frozen_trainer_stops_the_job_with_the_resume_command_and_the_resume_completes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = reverse_text_with_stall_bound(tmp_path, steps=40, stall_s=5)
    run_dir = tmp_path / "run"
    assert main(["launch", "slurm", str(path), "--run-dir", str(run_dir), "--time", "00:10:00"]) == 0
    job = (run_dir / "slurm_job_id").read_text().strip()
    deadline = time.monotonic() + 240
    while (beat := read_beats(run_dir / "roles").get("trainer")) is None or beat.progress_count < 6:
        assert time.monotonic() < deadline, "the trainer never trained"
        time.sleep(0.2)
    trainer = _trainer_pid(run_dir)
    assert trainer is not None
    os.kill(trainer, signal.SIGSTOP)
    states = wait_done(job, 300)
    out = (run_dir / "slurm" / f"job-{job}.out").read_text()
    assert states[0] == ("FAILED", "1:0"), out
    assert "reel: trainer has made no progress for " in out
    assert "reel: trainer stalled (output: " in out and "killing it and stopping the run" in out
    resume = f"reel run {run_dir}/config.toml --resume --out {run_dir}"
    assert f"`{resume}` continues this run from its log" in out
    assert not Path(f"/proc/{trainer}").exists()
    capsys.readouterr()
    assert main(["log", "verify", "--run", str(run_dir)]) == 0
    with RunLog(run_dir, readonly=True) as log:
        ends = [e.reason for _, e in log.events("control") if isinstance(e, RunFinished)]
    assert ends == ["failed: trainer stalled"]
    assert main(resume.split()[1:] + ["--no-live"]) == 0  # the command it printed, on this host
    assert main(["log", "verify", "--run", str(run_dir)]) == 0
    capsys.readouterr()
    assert main(["replay", "step", "40", "--run", str(run_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bitwise"] is True
