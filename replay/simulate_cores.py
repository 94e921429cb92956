"""Shared hardware for `reel simulate`: the run's roles compete for the machine's cores.

Processor sharing: every runnable thread gets the same share of the C cores, at most one core,

    g(T, K) = min(1, C / (background + trainer_threads · T + worker_threads · K))

with T = 1 while the trainer computes and K the rollout workers decoding. A role running with
n threads does n · g cores of work per wall second, so while it shares the cores its time
stretches by g(alone) / g(shared). `background` counts the runnable threads of everything else
(other tenants of the machine, Redis, the archiver), held constant over the run.

Calibration (replay/workload.py) reads it from CPU time: C is RunStarted.cpu_count, the trainer's
threads are its config's, and each StepCommitted.cpu_s over its compute seconds, each worker's
ΔWorkerStats.cpu_s over its active seconds, is a measured `n · g` at a known overlap. The
background and the workers' threads are the pair that best explains those rates (a grid, relative
error). A synchronous log, in which the roles never overlap, so gives what overlapping will cost:
the cores each role used alone, and how busy the machine already was. Logs without CPU times
(written before Reel recorded them) cannot tell, and the calibration says so.
"""

from __future__ import annotations

import msgspec
import numpy as np

__all__ = ["Cores", "CpuRate", "Factors", "fit_cores", "factors"]

_BACKGROUND = np.linspace(0.0, 24.0, 481)  # runnable threads besides the run's roles
_WORKER_THREADS = np.linspace(0.05, 4.0, 80)


class Cores(msgspec.Struct, kw_only=True):
    cores: int  # RunStarted.cpu_count
    background: float  # runnable threads of other processes, fitted
    trainer_threads: float  # config trainer.threads
    worker_threads: float  # per rollout worker, fitted
    trainer_rate: float  # cores the trainer used while computing (measured mean)
    worker_rate: float  # cores a worker used while it had a group in flight (measured mean)

    def share(self, trainer: float, workers: float) -> float:
        """Cores per runnable thread while the trainer computes (0/1) and `workers` decode."""
        threads = self.background + self.trainer_threads * trainer + self.worker_threads * workers
        return min(1.0, self.cores / threads) if threads > 0 else 1.0

    def trainer_slowdown(self, workers: int) -> float:
        """Extra share of the trainer's compute while `workers` decode beside it."""
        return self.share(1, 0) / self.share(1, workers) - 1.0

    def decode_slowdown(self, workers: int) -> float:
        """Extra share of a decode step while the trainer computes beside `workers` decoding."""
        return self.share(0, workers) / self.share(1, workers) - 1.0


class Factors(msgspec.Struct, frozen=True):
    """How a scenario's machine changes each role's logged times."""

    decode_slowdown: float  # extra share of a decode step while the trainer computes
    trainer_slowdown: float  # extra share of the trainer's compute while every worker decodes
    decode_scale: float = 1.0  # a decode step's seconds on the scenario's machine / on the logged one
    trainer_scale: float = 1.0  # the trainer's compute and publish seconds, likewise


def factors(logged: Cores, logged_workers: int, workers: int, background: float | None) -> Factors:
    """Slowdowns for the scenario's workers and background, and each role alone rescaled from its
    logged share of the cores to the scenario's (more workers, or less other load)."""
    cores = logged if background is None else msgspec.structs.replace(logged, background=background)
    return Factors(decode_slowdown=cores.decode_slowdown(workers), trainer_slowdown=cores.trainer_slowdown(workers),
                   decode_scale=logged.share(0, logged_workers) / cores.share(0, workers),
                   trainer_scale=logged.share(1, 0) / cores.share(1, 0))


class CpuRate(msgspec.Struct, array_like=True):
    """One measured interval of a role: CPU seconds over wall seconds, and the share of those wall
    seconds the other role was running."""

    cpu_s: float
    wall_s: float
    overlap: float


def fit_cores(cores: int, trainer_threads: float, workers: int, trainer: list[CpuRate],
              rollout: list[CpuRate]) -> Cores:
    """The background and worker threads that best explain the measured rates (trainer steps,
    worker intervals); the smallest background among equals (a machine with cores to spare hides it)."""
    t = _rows(trainer)
    w = _rows(rollout)
    bg = _BACKGROUND[:, None, None]
    nw = _WORKER_THREADS[None, :, None]

    def share(on: float | np.ndarray, decoding: float | np.ndarray) -> np.ndarray:
        return np.minimum(1.0, cores / np.maximum(bg + trainer_threads * on + nw * decoding, 1e-9))

    # Time-weighted: a rate over an interval averages the share over its overlapped and lone parts.
    t_pred = trainer_threads * ((1 - t[2]) * share(1, 0) + t[2] * share(1, workers))
    w_pred = nw * ((1 - w[2]) * share(0, workers) + w[2] * share(1, workers))
    error = (np.sum(t[1] * (t_pred / _rate(t) - 1) ** 2, axis=2) + np.sum(w[1] * (w_pred / _rate(w) - 1) ** 2, axis=2))
    i, j = np.unravel_index(np.argmin(error + 1e-9 * bg[:, :, 0]), error.shape)
    return Cores(cores=cores, background=float(_BACKGROUND[i]), trainer_threads=trainer_threads,
                 worker_threads=float(_WORKER_THREADS[j]), trainer_rate=float(np.sum(t[0]) / np.sum(t[1])),
                 worker_rate=float(np.sum(w[0]) / np.sum(w[1])))


def _rows(rates: list[CpuRate]) -> np.ndarray:
    return np.array([[r.cpu_s for r in rates], [r.wall_s for r in rates], [r.overlap for r in rates]], dtype=float)


def _rate(rows: np.ndarray) -> np.ndarray:
    return np.maximum(rows[0] / rows[1], 1e-6)
