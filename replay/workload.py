"""What `reel simulate` learns from a run's log: the workload, the measured speeds, the measured result.

From the log alone (entry ids carry the Redis server's millisecond clock, so every event has a time):

- group shapes: the prompt length and, per sample, the lengths of its turns (Trajectory): a
  one-turn sample is its completion length; a multi-turn episode alternates model turns and the
  env turns (tool results) appended between them (Sample.env_spans), and each env answer's wall
  time (Sample.env_s: a slow tool's wait). Kept per group, so a long-tail prompt stays long, and a
  long episode keeps all its turns and waits, when the simulation resamples it;
- decode speed: step_s = base_s + per_seq_s · B + per_prefill_token_s · X, fitted on the WorkerStats
  intervals (by batch size where the engine timed its steps so) or their means and the synchronous
  rounds' groups (replay/decode_fit.py);
- shared cores: a worker is active from a group's start to its publication (Trajectory.generate_s
  and the entry's time), the trainer computes over the span its StepCommitted timing gives. With
  CPU times in the log (StepCommitted.cpu_s, WorkerStats.cpu_s, RunStarted.cpu_count) the roles'
  measured CPU rates fit a processor-sharing model of the cores (replay/simulate_cores.py), which
  gives the slowdown of either while both run, even from a synchronous log that never overlapped.
  Without them, the share of each interval where both ran gives the slowdowns, fitted with the
  speeds above: 0 when they never overlapped, a log that cannot tell (`Workload.cores` is None);
- trainer speed: compute_s = base_s + per_position_s · positions + per_score_s · scores over the
  StepCommitted timings of steps 2..N: the forward and backward passes run over the batch's rows (its
  groups' prompts and completions) in micro-batches each padded to its longest row
  (runtime/train/batch.py), so over that many positions, and attention over rows times length²
  scores. A log whose commits do not name groups it holds gives base_s + per_token_s · tokens
  instead. publish_s is the mean publish time;
- weight swaps: the mean of WorkerStats.swap_s;
- the figures the run measured, defined as `reel bench async` defines them: wall time of steps
  2..N (step 1 also waits for the processes to start), trainer idle = wait / wall, rollout idle =
  mean WorkerStats.idle_share between the first and the last commit; plus the staleness histogram and the share
  of groups dropped as too stale.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import msgspec
import numpy as np

from reel.bus.errors import ReelError
from reel.bus.events import MismatchSplit, RunStarted, Sample, StepCommitted, Trajectory, WorkerStats
from reel.bus.log import LogError
from reel.bus.run_log import RunLog
from reel.replay.decode_fit import (DecodeRow, StepModel, batch_rows, fit_decode, interval_rows, round_rows,
                                    worker_spans)
from reel.replay.intervals import active_intervals, compute_intervals, intersection, split_intervals
from reel.replay.least_squares import fit_with_slowdown
from reel.replay.simulate_cores import Cores, CpuRate, fit_cores, layout_of
from reel.replay.simulate_split import SplitModel, fit_split, stretch
from reel.runtime.config.sections import Config
from reel.runtime.config.keys import ConfigError
from reel.runtime.config.run import load
from reel.runtime.train.batch import padded_work

__all__ = ["WorkloadError", "Pipeline", "GroupShape", "StepModel", "TrainerModel", "Measured", "Workload", "extract",
           "pipeline_of", "measured_of"]

T = TypeVar("T")

# Slowdown factors are fitted on this grid (0 = none, 3 = four times slower while shared).


class WorkloadError(ReelError):
    """A run directory whose log cannot calibrate a simulation; the message says what is missing."""


class Pipeline(msgspec.Struct, kw_only=True):
    """The configuration the simulation models (from the run's config.toml; scenarios override it)."""

    rollout_workers: int
    concurrency: int  # groups in flight per worker
    group_size: int
    max_batch: int  # engine KV slots: sequences decoded together
    async_level: int
    batch_groups: int
    max_off_policy: int
    steps: int
    trainer_ranks: int = 1
    micro_batch_tokens: int = 0  # trainer.micro_batch_tokens: how a batch's rows are padded


class GroupShape(msgspec.Struct, array_like=True):
    prompt: int  # prompt tokens (prefilled once per request: the engine shares no prefix)
    # Per sample, token counts of its turns: model, env, model, ..., model ([C] for one turn).
    samples: list[list[int]]
    env_s: list[list[float]] = []  # per sample, seconds of each env answer (Sample.env_s); [] = not logged

    def rows(self) -> list[int]:
        """Per sample, the length of its row in a training batch: prompt + completion - 1."""
        return [self.prompt + sum(turns) - 1 for turns in self.samples]


class TrainerModel(msgspec.Struct, kw_only=True):
    """Seconds of one trainer step's compute: (base_s + per_token_s · tokens + per_position_s · positions +
    per_score_s · scores) · (1 + shared), positions and attention scores padded (runtime/train/batch.py
    `padded_work`)."""

    base_s: float
    per_token_s: float  # 0 where the padded rows are known: they are the work
    # 0 where the log's commits do not name groups its trajectories hold: then tokens stand for the work.
    per_position_s: float = 0.0
    per_score_s: float = 0.0
    shared_slowdown: float  # extra share while a rollout worker decodes on the same machine
    publish_s: float  # writing the weights and committing, per step
    ranks: int = 1  # trainer ranks of the logged steps (StepCommitted.world_size): the fit is of that many


class Measured(msgspec.Struct, kw_only=True):
    """What the run itself measured (steps 2..N for times)."""

    steps: int
    wall_s: float
    steps_per_hour: float
    trainer_idle: float
    rollout_idle: float | None  # None: no WorkerStats after the first commit
    staleness: dict[int, int]  # versions behind -> tokens, over every step
    dropped_share: float


class Workload(msgspec.Struct, kw_only=True):
    run_dir: str
    pipeline: Pipeline
    groups: list[GroupShape]
    decode: StepModel
    trainer: TrainerModel
    swap_s: float  # mean seconds from a worker reading WeightsPublished to the weights being live
    measured: Measured
    cores: Cores | None = None  # the shared-cores model; None: the log has no CPU times to fit it
    split: SplitModel | None = None  # the mismatch role's splits; None: the log has none
    # The trainer split the mismatch inside its step (a log from before the mismatch role: no MismatchSplit
    # events while mismatch.every asks for them), which only an asynchronous step paid.
    split_in_step: bool = False


def extract(run_dir: Path) -> Workload:
    """Calibrate a workload on the log of `run_dir`; WorkloadError names what the log lacks."""
    run_dir = Path(run_dir)
    config = _config(run_dir)
    try:
        with RunLog(run_dir, readonly=True) as run_log:
            commits = _timed(run_log, "steps", StepCommitted)
            stats = _timed(run_log, "control", WorkerStats)
            trajectories = _timed(run_log, "trajectories", Trajectory)
            started = [e for _, e in _timed(run_log, "control", RunStarted)]
            splits = _timed(run_log, "steps", MismatchSplit)
    except LogError as exc:
        raise WorkloadError(f"cannot read the log of {run_dir}: {exc}") from exc
    if len(commits) < 3:
        raise WorkloadError(f"the log of {run_dir} has {len(commits)} committed steps; a simulation needs at "
                            "least 3 (step 1 includes process start-up)")
    if not trajectories:
        raise WorkloadError(f"the log of {run_dir} has no Trajectory events to take group shapes from")
    groups = [GroupShape(int(e.prompt.shape[0]), [_turns(s) for s in e.samples],
                         [list(s.env_s) for s in e.samples] if all(s.env_s for s in e.samples) else [])
              for _, e in trajectories]
    computing = compute_intervals(commits)
    active = active_intervals(trajectories)
    # Calibrate on the steady state, as the measured figures do: before the first commit the
    # engine also compiles kernels and warms caches.
    stats = [(ms, e) for ms, e in stats if commits[0][0] < ms <= commits[-1][0]]
    pipeline = pipeline_of(config)
    splitting = split_intervals(splits)
    spans = worker_spans(stats, computing, active, splitting)
    intervals = interval_rows(spans)
    # Steps timed by batch size are the engine's own seconds at each size: they replace the intervals' means
    # and the rounds (which stood in for the sizes the means lack, and hold each group's work around the
    # engine) in the decode fit; a short run's two intervals hold dozens of sizes. A log without them (vLLM,
    # or from before), or with under 3, fits on those, as before.
    by_batch = batch_rows(spans)
    by_batch = by_batch if len(by_batch) >= 3 else []
    rounds = [] if by_batch else round_rows(trajectories, computing, splitting)
    if not by_batch and len(intervals) + len(rounds) < 3:
        raise WorkloadError(f"the log of {run_dir} has {len(intervals)} WorkerStats intervals with decode timings "
                            f"after step 1 and {len(rounds)} groups of synchronous one-turn rounds; it needs at least "
                            "3 in all (logs written before Reel recorded WorkerStats.decode_steps cannot calibrate a "
                            "simulation: re-run the config)")
    steps = _trainer_steps(commits, active, splitting)
    k = pipeline.rollout_workers
    layout = layout_of(started, stats, splits, config.trainer.threads or 1, config.engine.threads or 1)
    cores = _fit_cores(layout, k, intervals, steps)
    return Workload(run_dir=str(run_dir), pipeline=pipeline, groups=groups,
                    decode=fit_decode(by_batch or intervals + rounds,
                                       cores and cores.decode_slowdown(k),
                                       cores.decode_slowdown(k, trainer=0, split=1) if cores else 0.0),
                    trainer=_fit_trainer(commits, _padded(commits, trajectories, groups, pipeline.micro_batch_tokens),
                                         steps, cores and cores.trainer_slowdown(k),
                                         cores.trainer_slowdown(0, split=1) if cores else 0.0),
                    swap_s=_mean([s for _, e in stats for s in e.swap_s]), measured=measured_of(commits, stats),
                    cores=cores, split=fit_split(commits, splits, config.mismatch.every,
                                                 stretch(splits, cores, computing, active, stats)),
                    split_in_step=not splits and config.mismatch.every > 0)


def pipeline_of(config: Config) -> Pipeline:
    r, t = config.rollout, config.trainer
    return Pipeline(rollout_workers=r.workers, concurrency=r.concurrency, group_size=r.group_size,
                    max_batch=config.engine.max_batch, async_level=r.async_level, batch_groups=t.batch_groups,
                    max_off_policy=t.max_off_policy_steps, steps=config.run.steps, trainer_ranks=t.ranks,
                    micro_batch_tokens=t.micro_batch_tokens)


def measured_of(commits: list[tuple[int, StepCommitted]], stats: list[tuple[int, WorkerStats]]) -> Measured:
    timed = [e for _, e in commits[1:]]
    wall = sum(_step_s(e) for e in timed)
    # Workers keep reporting after the last commit until the run stops them: those are not the RL loop.
    first_ms, last_ms = commits[0][0], commits[-1][0]
    idle = [e.idle_share for ms, e in stats if first_ms < ms <= last_ms]
    staleness: dict[int, int] = {}
    for _, e in commits:
        for behind, tokens in e.staleness.items():
            staleness[behind] = staleness.get(behind, 0) + tokens
    used = sum(len(e.groups) for _, e in commits)
    dropped = sum(len(e.dropped) for _, e in commits)
    return Measured(steps=len(commits), wall_s=wall, steps_per_hour=3600 * len(timed) / wall if wall else 0.0,
                    trainer_idle=sum(e.timing.wait for e in timed) / wall if wall else 0.0,
                    rollout_idle=_mean(idle) if idle else None, staleness=dict(sorted(staleness.items())),
                    dropped_share=dropped / (used + dropped) if used + dropped else 0.0)


def _turns(sample: Sample) -> list[int]:
    """Token counts of a sample's turns: the env's spans split its tokens into model and env turns."""
    out, at = [], 0
    for first, end in sample.env_spans:
        out += [first - at, end - first]
        at = end
    return [*out, int(sample.tokens.shape[0]) - at]


# ---- fitting ------------------------------------------------------------------------------------

def _trainer_steps(commits: list[tuple[int, StepCommitted]], active: dict[str, np.ndarray],
                   splitting: np.ndarray) -> list[CpuRate]:
    """Steps 2..N: CPU and compute seconds, the mean share of the compute each worker was active and
    the share the mismatch role computed."""
    rows = []
    for ms, e in commits[1:]:
        end = ms - 1000 * e.timing.publish
        span = np.array([[end - 1000 * e.timing.compute, end]])
        decoding = [intersection(a, span) / max(1.0, 1000 * e.timing.compute) for a in active.values()]
        rows.append(CpuRate(e.cpu_s, e.timing.compute, _mean(decoding),
                            intersection(span, splitting) / max(1.0, 1000 * e.timing.compute)))
    return rows


def _fit_cores(layout: Cores | None, workers: int, intervals: list[DecodeRow], steps: list[CpuRate]) -> Cores | None:
    """The shared-cores model, when the log has the core count and both roles' CPU times (one rate of
    each fits it: the unknowns are a background per pool). A worker's rate is over the seconds its
    engine decoded: waiting on a tool it is not runnable."""
    rollout = [CpuRate(i.cpu_s, i.step_s * i.steps, i.overlap, i.split) for i in intervals
               if i.cpu_s > 0 and i.step_s > 0]
    trainer = [s for s in steps if s.cpu_s > 0 and s.wall_s > 0]
    if layout is None or not rollout or not trainer:
        return None
    return fit_cores(layout, workers, trainer, rollout)


def _padded(commits: list[tuple[int, StepCommitted]], trajectories: list[tuple[int, Trajectory]],
            groups: list[GroupShape], micro_batch_tokens: int) -> np.ndarray:
    """Padded positions and attention scores of steps 2..N's batches, [steps, 2] (`groups` the shapes
    of `trajectories`); zeros when a step names no groups or one the log does not hold."""
    rows = {e.group_id: shape.rows() for (_, e), shape in zip(trajectories, groups, strict=True)}
    if any(g not in rows for _, e in commits[1:] for g in e.groups) or not all(e.groups for _, e in commits[1:]):
        return np.zeros((len(commits) - 1, 2))
    return np.array([padded_work([n for g in e.groups for n in rows[g]], micro_batch_tokens)
                     for _, e in commits[1:]], dtype=float)


def _fit_trainer(commits: list[tuple[int, StepCommitted]], padded: np.ndarray, steps: list[CpuRate],
                 slowdown: float | None, split_slowdown: float) -> TrainerModel:
    """Least squares of compute seconds on the padded positions and attention scores of the batch's rows,
    else (a log whose commits do not name its groups) on batch tokens; steps 2..N (step 1 pays one-off
    warm-ups)."""
    tokens = np.array([e.metrics.get("tokens", 0.0) for _, e in commits[1:]], dtype=float)
    seconds = np.array([s.wall_s for s in steps], dtype=float)
    shared = np.array([s.overlap for s in steps], dtype=float)
    if padded.any():  # the padded rows are the passes' work: tokens stand in only where the log cannot give them
        tokens = np.zeros_like(tokens)
    (base, per_token, per_position, per_score), k = fit_with_slowdown(
        np.ones_like(tokens), np.column_stack([np.ones_like(tokens), tokens, padded]), seconds, shared, slowdown,
        split_slowdown * np.array([s.split for s in steps], dtype=float))
    return TrainerModel(base_s=base, per_token_s=per_token, per_position_s=per_position, per_score_s=per_score,
                        shared_slowdown=k, publish_s=_mean([e.timing.publish for _, e in commits[1:]]),
                        ranks=max(e.world_size for _, e in commits[1:]))


# ---- small helpers ------------------------------------------------------------------------------

def _config(run_dir: Path) -> Config:
    path = run_dir / "config.toml"
    if not path.is_file():
        raise WorkloadError(f"{run_dir} is not a run directory (no config.toml); pass the directory `reel run` wrote")
    try:
        return load(path)
    except ConfigError as exc:
        raise WorkloadError(f"{path}: {exc}") from exc


def _timed(run_log: RunLog, stream: str, kind: type[T]) -> list[tuple[int, T]]:
    """(entry time in ms, event) of one kind; none when the stream was never logged."""
    if stream not in run_log.names():
        return []
    return [(_ms(i), e) for i, e in run_log.events(stream) if isinstance(e, kind)]


def _step_s(e: StepCommitted) -> float:
    return e.timing.wait + e.timing.compute + e.timing.publish


def _ms(entry_id: str) -> int:
    return int(entry_id.split("-")[0])


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
