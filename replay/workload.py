"""What `reel simulate` learns from a run's log: the workload, the measured speeds, the measured result.

From the log alone (entry ids carry the Redis server's millisecond clock, so every event has a time):

- group shapes: the completion length of every sample of every group (Trajectory), kept per group,
  so a long-tail prompt stays long for all of its samples when the simulation resamples it;
- decode speed: between two WorkerStats of a worker, Δbusy_s / Δdecode_steps is the mean decode-step
  time and Δdecode_tokens / Δdecode_steps the mean batch occupancy B; least squares gives
  step_s(B) = base_s + per_seq_s · B. Intervals are also weighed by how much of them the trainer
  spent computing, which gives the slowdown of a step while trainer and rollout share cores;
- trainer speed: compute_s = base_s + per_token_s · tokens over the StepCommitted timings, with the
  slowdown while a worker decodes fitted the same way; publish_s is the mean publish time;
- weight swaps: the mean of WorkerStats.swap_s;
- the figures the run measured, defined as `reel bench async` defines them: wall time of steps
  2..N (step 1 also waits for the processes to start), trainer idle = wait / wall, rollout idle =
  mean WorkerStats.idle_share after the first commit; plus the staleness histogram and the share
  of groups dropped as too stale.
"""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import numpy as np

from bus.errors import ReelError
from bus.events import StepCommitted, Trajectory, WorkerStats
from bus.log import LogError, RunLog
from runtime.config import Config, ConfigError, load

__all__ = ["WorkloadError", "Pipeline", "StepModel", "TrainerModel", "Measured", "Workload", "extract",
           "pipeline_of", "measured_of"]

# Slowdown factors are fitted on this grid (0 = none, 3 = four times slower while shared).
_SLOWDOWN_GRID = np.linspace(0.0, 3.0, 301)


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


class StepModel(msgspec.Struct, kw_only=True):
    """Seconds of one decode step with B running sequences: (base_s + per_seq_s · B) · (1 + shared)."""

    base_s: float
    per_seq_s: float
    shared_slowdown: float  # extra share of a step's time while the trainer computes on the same machine
    intervals: int  # WorkerStats intervals fitted


class TrainerModel(msgspec.Struct, kw_only=True):
    """Seconds of one trainer step's compute: (base_s + per_token_s · tokens) · (1 + shared)."""

    base_s: float
    per_token_s: float
    shared_slowdown: float  # extra share while a rollout worker decodes on the same machine
    publish_s: float  # writing the weights and committing, per step


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
    groups: list[list[int]]  # completion lengths of each logged group's samples
    decode: StepModel
    trainer: TrainerModel
    swap_s: float  # mean seconds from a worker reading WeightsPublished to the weights being live
    measured: Measured


def extract(run_dir: Path) -> Workload:
    """Calibrate a workload on the log of `run_dir`; WorkloadError names what the log lacks."""
    run_dir = Path(run_dir)
    config = _config(run_dir)
    try:
        with RunLog(run_dir, readonly=True) as run_log:
            commits = [(_ms(i), e) for i, e in run_log.events("steps") if isinstance(e, StepCommitted)]
            stats = [(_ms(i), e) for i, e in run_log.events("control") if isinstance(e, WorkerStats)]
            groups = [[int(s.tokens.shape[0]) for s in e.samples]
                      for _, e in run_log.events("trajectories") if isinstance(e, Trajectory)]
    except LogError as exc:
        raise WorkloadError(f"cannot read the log of {run_dir}: {exc}") from exc
    if len(commits) < 3:
        raise WorkloadError(f"the log of {run_dir} has {len(commits)} committed steps; a simulation needs at "
                            "least 3 (step 1 includes process start-up)")
    if not groups:
        raise WorkloadError(f"the log of {run_dir} has no Trajectory events to take group shapes from")
    computing = _compute_intervals(commits)
    return Workload(run_dir=str(run_dir), pipeline=pipeline_of(config), groups=groups,
                    decode=_fit_decode(run_dir, stats, computing), trainer=_fit_trainer(commits, stats),
                    swap_s=_mean([s for _, e in stats for s in e.swap_s]), measured=measured_of(commits, stats))


def pipeline_of(config: Config) -> Pipeline:
    r, t = config.rollout, config.trainer
    return Pipeline(rollout_workers=r.workers, concurrency=r.concurrency, group_size=r.group_size,
                    max_batch=config.engine.max_batch, async_level=r.async_level, batch_groups=t.batch_groups,
                    max_off_policy=t.max_off_policy_steps, steps=config.run.steps)


def measured_of(commits: list[tuple[int, StepCommitted]], stats: list[tuple[int, WorkerStats]]) -> Measured:
    timed = [e for _, e in commits[1:]]
    wall = sum(_step_s(e) for e in timed)
    first_ms = commits[0][0]
    idle = [e.idle_share for ms, e in stats if ms > first_ms]
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


# ---- fitting ------------------------------------------------------------------------------------

def _fit_decode(run_dir: Path, stats: list[tuple[int, WorkerStats]], computing: np.ndarray) -> StepModel:
    """Least squares of the mean step time on the mean batch over WorkerStats intervals."""
    rows = []  # (steps, mean batch, mean step seconds, share of the interval the trainer computed)
    last: dict[str, tuple[int, WorkerStats]] = {}
    for ms, e in stats:
        prev = last.get(e.worker)
        last[e.worker] = (ms, e)
        if prev is None or e.decode_steps <= prev[1].decode_steps:
            continue
        steps = e.decode_steps - prev[1].decode_steps
        busy = e.busy_s - prev[1].busy_s
        rows.append((steps, (e.decode_tokens - prev[1].decode_tokens) / steps, busy / steps,
                     _overlap(prev[0], ms, computing) / max(ms - prev[0], 1)))
    if len(rows) < 2:
        raise WorkloadError(f"the log of {run_dir} has {len(rows)} WorkerStats intervals with decode timings; "
                            "it needs at least 2 (logs written before Reel recorded WorkerStats.decode_steps "
                            "cannot calibrate a simulation: re-run the config)")
    w, b, s, o = (np.array(c, dtype=float) for c in zip(*rows))
    base, per_seq, shared = _fit_linear_with_slowdown(w, b, s, o)
    return StepModel(base_s=base, per_seq_s=per_seq, shared_slowdown=shared, intervals=len(rows))


def _fit_trainer(commits: list[tuple[int, StepCommitted]], stats: list[tuple[int, WorkerStats]]) -> TrainerModel:
    """Least squares of compute seconds on batch tokens; steps 2..N (step 1 pays one-off warm-ups)."""
    busy = _busy_intervals(stats)
    rows = []
    for ms, e in commits[1:]:
        end = ms - 1000 * e.timing.publish
        start = end - 1000 * e.timing.compute
        rows.append((e.metrics.get("tokens", 0.0), e.timing.compute, _busy_share(start, end, busy)))
    tokens, seconds, shared = (np.array(c, dtype=float) for c in zip(*rows))
    base, per_token, slowdown = _fit_linear_with_slowdown(np.ones_like(tokens), tokens, seconds, shared)
    return TrainerModel(base_s=base, per_token_s=per_token, shared_slowdown=slowdown,
                        publish_s=_mean([e.timing.publish for _, e in commits[1:]]))


def _fit_linear_with_slowdown(weight: np.ndarray, x: np.ndarray, y: np.ndarray,
                              shared: np.ndarray) -> tuple[float, float, float]:
    """y ≈ (a + b·x)(1 + k·shared): weighted least squares for a, b at each k of a grid, best k.

    When `shared` does not vary (a synchronous run never overlaps) every k fits alike and the
    smallest, 0, is kept: such a log cannot tell what sharing costs."""
    best = (math.inf, 0.0, 0.0, 0.0)
    root_w = np.sqrt(weight)
    for k in _SLOWDOWN_GRID:
        factor = 1.0 + k * shared
        design = np.stack([factor, factor * x], axis=1) * root_w[:, None]
        if np.ptp(x) == 0:  # one batch size (or one token count): only the mean is identifiable
            design = design[:, :1]
        coef, *_ = np.linalg.lstsq(design, y * root_w, rcond=None)
        a, b = float(coef[0]), float(coef[1]) if coef.size > 1 else 0.0
        a, b = _non_negative(a, b, x, y, factor, weight)
        residual = float(np.sum(weight * (y - (a + b * x) * factor) ** 2))
        if residual < best[0] - 1e-15:
            best = (residual, a, b, float(k))
    return best[1], best[2], best[3]


def _non_negative(a: float, b: float, x: np.ndarray, y: np.ndarray, factor: np.ndarray,
                  weight: np.ndarray) -> tuple[float, float]:
    """A fit with a negative term (noise on a few points) falls back to the other term alone."""
    if a >= 0 and b >= 0:
        return a, b
    if b < 0 or not np.any(x):
        return float(np.sum(weight * y * factor) / np.sum(weight * factor * factor)), 0.0
    fx = factor * x
    return 0.0, float(np.sum(weight * y * fx) / np.sum(weight * fx * fx))


# ---- intervals ----------------------------------------------------------------------------------

def _compute_intervals(commits: list[tuple[int, StepCommitted]]) -> np.ndarray:
    """[start_ms, end_ms] of each step's compute (a commit's entry id is stamped after its publish)."""
    out = []
    for ms, e in commits:
        end = ms - 1000 * e.timing.publish
        out.append((end - 1000 * e.timing.compute, end))
    return np.array(out, dtype=float).reshape(-1, 2)


def _overlap(start: float, end: float, intervals: np.ndarray) -> float:
    """Milliseconds of [start, end] inside the union of disjoint `intervals`."""
    return float(np.clip(np.minimum(intervals[:, 1], end) - np.maximum(intervals[:, 0], start), 0, None).sum())


def _busy_intervals(stats: list[tuple[int, WorkerStats]]) -> list[tuple[float, float, float]]:
    """(start_ms, end_ms, share of the interval some engine was decoding) per WorkerStats interval."""
    out = []
    last: dict[str, tuple[int, WorkerStats]] = {}
    for ms, e in stats:
        prev = last.get(e.worker)
        last[e.worker] = (ms, e)
        if prev is not None and ms > prev[0]:
            out.append((prev[0], ms, min(1.0, 1000 * (e.busy_s - prev[1].busy_s) / (ms - prev[0]))))
    return out


def _busy_share(start: float, end: float, busy: list[tuple[float, float, float]]) -> float:
    """Share of [start, end] some worker spent decoding, from the intervals that cover it."""
    covered = weighted = 0.0
    for a, b, share in busy:
        overlap = min(b, end) - max(a, start)
        if overlap > 0:
            covered += overlap
            weighted += overlap * share
    return min(1.0, weighted / covered) if covered else 0.0


# ---- small helpers ------------------------------------------------------------------------------

def _config(run_dir: Path) -> Config:
    path = run_dir / "config.toml"
    if not path.is_file():
        raise WorkloadError(f"{run_dir} is not a run directory (no config.toml); pass the directory `reel run` wrote")
    try:
        return load(path)
    except ConfigError as exc:
        raise WorkloadError(f"{path}: {exc}") from exc


def _step_s(e: StepCommitted) -> float:
    return e.timing.wait + e.timing.compute + e.timing.publish


def _ms(entry_id: str) -> int:
    return int(entry_id.split("-")[0])


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
