"""`reel launch slurm|status|cancel`: a whole run as one Slurm heterogeneous job.

`reel launch slurm CONFIG` renders ops/slurm/reel.sbatch into RUN_DIR/slurm/job.sbatch and
submits it (with --dry-run it prints the script and touches nothing). One het group per pool:
    0 control    Redis (ops/redis/redis.conf), the archiver, the metrics exporter; with vLLM also
                 the rollout workers (HTTP clients), the P/D router and the Mooncake master
    1.. rollout  built-in engine: the rollout workers; vLLM: one pool (`rollout`) or two
                 (`prefill`, `decode`) of `vllm serve` nodes (runtime/launch/vllm_args.py)
    eval         with [eval] and vLLM: the eval role and its own in-process vLLM on one node (with the
                 built-in engine the eval role runs on the first rollout node instead)
                 (the mismatch role, [mismatch] every > 0, runs on the control node: CPU, trainer.threads)
    last trainer one torchrun over its nodes = ONE logical trainer (`reel role trainer`): rank 0
                 alone talks to the bus (one producer id, one consumer), the other ranks follow
                 it (runtime/train/trainer_group.py); ranks = nodes x (GPUs per node, or
                 trainer.ranks / nodes on CPU nodes)
The job id goes to RUN_DIR/slurm_job_id; `reel launch status|cancel --run RUN_DIR` wrap squeue/scancel.

Errors: a config or flag combination that cannot run is a ConfigError (exit 2) naming the key or
flag; a Slurm command that is missing or fails is a SlurmError (exit 1).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from pathlib import Path

from reel.bus.errors import ReelError
from reel.runtime.config import run as config_mod
from reel.runtime.launch.slurm_job import JobOptions
from reel.runtime.launch.slurm_script import render
from reel.producers.envs.registry import check_config


class SlurmError(ReelError):
    """A Slurm command is missing or failed, or a run directory has no submitted job."""


# ---- handlers -------------------------------------------------------------------------------


def main_submit(args: argparse.Namespace) -> int:
    config = config_mod.load(args.config)
    check_config(config, args.config)
    run_dir = Path(args.run_dir or Path(config.run.out_dir) / config.run.name).absolute()
    script = render(config, run_dir, JobOptions.from_args(args))
    if args.dry_run:
        print(script, end="")
        return 0
    _which("sbatch")
    from reel.runtime.launch.run_dir import prepare_run_dir  # the run directory layout is the local launcher's

    prepare_run_dir(run_dir, Path(args.config).read_text(), config, resume=False)
    try:
        job = submit(run_dir, script)
    except SlurmError:
        shutil.rmtree(run_dir)  # made by this call and holds nothing else: let a fixed retry reuse it
        raise
    print(f"reel: submitted Slurm job {job}; run directory {run_dir}\n"
          f"reel: follow it with `reel launch status --run {run_dir}`; its output is {run_dir}/slurm/job-{job}.out")
    return 0


def submit(run_dir: Path, script: str) -> str:
    """Write the script to RUN_DIR/slurm/job.sbatch, sbatch it, record the job id; returns the id."""
    (run_dir / "slurm").mkdir(parents=True, exist_ok=True)
    path = run_dir / "slurm" / "job.sbatch"
    path.write_text(script)
    job = _run(["sbatch", "--parsable", str(path)]).strip().split(";")[0]
    (run_dir / "slurm_job_id").write_text(job + "\n")
    return job


def main_status(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    job = job_id(run_dir)
    _which("squeue")
    queued = subprocess.run(["squeue", "-h", "-j", job, "-o", "%i|%T|%M|%D|%R"], capture_output=True, text=True)
    rows = [line.split("|") for line in queued.stdout.splitlines() if line.strip()]
    if queued.returncode == 0 and rows:
        print(f"job {job} ({run_dir}):")
        for component, state, elapsed, nodes, where in rows:
            print(f"  {component:<10} {state:<12} {elapsed:>10}  {nodes} node(s)  {where}")
    else:
        shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True)
        states = re.findall(r"HetJobOffset=(\d+).*?JobState=(\S+).*?ExitCode=(\S+)", shown.stdout, re.S)
        if shown.returncode == 0 and states:
            print(f"job {job} ({run_dir}) has left the queue:")
            for offset, state, code in states:
                print(f"  {job}+{offset:<8} {state:<12} exit code {code}")
        else:
            print(f"job {job} ({run_dir}) is no longer known to Slurm")
    print(f"output: {run_dir}/slurm/job-{job}.out")
    return 0


def main_cancel(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    job = job_id(run_dir)
    _which("scancel")
    # Only the job script is signalled: it stops the components in order (SIGTERM, then SIGKILL
    # after its stop timeout) and then cancels the job. A plain `scancel` would signal every step
    # at once, and srun SIGKILLs its tasks on a second signal, leaving them no time to drain.
    _run(["scancel", "--batch", "--signal=TERM", job])
    print(f"reel: cancelled Slurm job {job}: the job script stops every component with SIGTERM, in order, "
          f"then ends the job (`scancel {job}` kills it at once)")
    return 0


def job_id(run_dir: Path) -> str:
    try:
        return (run_dir / "slurm_job_id").read_text().strip()
    except FileNotFoundError:
        raise SlurmError(f"{run_dir} has no slurm_job_id: it was not submitted with `reel launch slurm`") from None


# ---- rendering ------------------------------------------------------------------------------


def _which(command: str) -> None:
    if shutil.which(command) is None:
        raise SlurmError(f"{command} is not on PATH: run this where Slurm's commands are (or use --dry-run)")


def _run(argv: list[str]) -> str:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        why = done.stderr.strip() or done.stdout.strip()
        raise SlurmError(f"{' '.join(argv[:2])} failed (exit {done.returncode}): {why}")
    return done.stdout


