"""Shared hardware for `reel simulate`: the run's roles compete for the machine's cores.

Processor sharing: every runnable thread gets the same share of the C cores, at most one core,

    g(T, K, S) = min(1, C / (background + trainer_threads · T + worker_threads · K + split_threads · S))

with T = 1 while the trainer computes, K the rollout workers decoding and S = 1 while the mismatch
role computes a split (replay/simulate_split.py). A role running with n threads does n · g cores of
work per wall second, so while it shares the cores its time stretches by g(alone) / g(shared).
`background` counts the runnable threads of everything else (other tenants of the machine, Redis,
the archiver), held constant over the run.

Roles pinned to disjoint cores (each logs its affinity: RunStarted.cpus for the trainer,
WorkerStats.cpus, MismatchSplit.cpus) share nothing: with the trainer `apart` from the workers
(`reel bench async` pins it so) neither slows the other, the trainer's C and background are those
of its own cores (its pool), the workers' those of theirs, and the mismatch role counts only in the
pool whose cores it shares. A log without affinities is one pool, as before they were recorded.

Calibration (replay/workload.py) reads it from CPU time: C is RunStarted.cpu_count (or the logged
affinities' cores), the trainer's and the mismatch role's threads are trainer.threads, a decoding
worker's its engine's step thread (engine.threads), and each StepCommitted.cpu_s over its compute
seconds, each worker's ΔWorkerStats.cpu_s over its decoding seconds (ΔWorkerStats.busy_s: waiting
on a tool it is not runnable), is a measured `n · g` at a known overlap with the other roles. The
background (of each pool) is the one that best explains those rates (a grid, relative error). A
synchronous log, in which the roles never overlap, so gives what overlapping will cost: the cores
each role used alone, and how busy the machine already was. Logs without CPU times
(written before Reel recorded them) cannot tell, and the calibration says so.
"""

from __future__ import annotations

import msgspec
import numpy as np

from reel.bus.events import MismatchSplit, RunStarted, WorkerStats

__all__ = ["Cores", "CpuRate", "Factors", "fit_cores", "factors", "layout_of", "NICE_WEIGHT"]

_BACKGROUND = np.linspace(0.0, 24.0, 481)  # runnable threads besides the run's roles
# Linux CFS weighs a thread's share of a contended core 1.25x less per nice level (sched_prio_to_weight).
NICE_WEIGHT = 1.25


class Cores(msgspec.Struct, kw_only=True):
    cores: int  # the workers' cores (RunStarted.cpu_count when the roles share them)
    background: float  # runnable threads of other processes on those, fitted
    trainer_threads: float  # config trainer.threads
    worker_threads: float  # per rollout worker decoding: its engine's step thread (config engine.threads)
    trainer_rate: float  # cores the trainer used while computing (measured mean)
    worker_rate: float  # cores a worker used while decoding (measured mean)
    # Pinned apart: the trainer's own cores and their other runnable threads (0 cores: it shares the workers').
    trainer_cores: int = 0
    trainer_background: float = 0.0
    split_threads: float = 0.0  # the mismatch role's threads while it computes (trainer.threads; 0: no role)
    split_with_workers: bool = True  # the role shares the workers' cores
    split_with_trainer: bool = True  # the role shares the trainer's cores

    @property
    def apart(self) -> bool:
        return self.trainer_cores > 0

    def share(self, trainer: float, workers: float, split: float = 0.0) -> float:
        """Cores per runnable thread on the workers' cores while the trainer computes (0/1), `workers`
        decode and the mismatch role computes (0/1)."""
        threads = self.background + self.worker_threads * workers
        threads += self.split_threads * split * self.split_with_workers
        if not self.apart:
            threads += self.trainer_threads * trainer
        return min(1.0, self.cores / threads) if threads > 0 else 1.0

    def trainer_share(self, workers: float, split: float = 0.0) -> float:
        """Cores per runnable thread on the trainer's cores while it computes."""
        if not self.apart:
            return self.share(1, workers, split)
        threads = self.trainer_background + self.trainer_threads
        threads += self.split_threads * split * self.split_with_trainer
        return min(1.0, self.trainer_cores / threads)

    def trainer_slowdown(self, workers: int, split: float = 0.0) -> float:
        """Extra share of the trainer's compute while `workers` decode (and the role splits) beside it."""
        return self.trainer_share(0) / self.trainer_share(workers, split) - 1.0

    def decode_slowdown(self, workers: int, trainer: float = 1.0, split: float = 0.0) -> float:
        """Extra share of a decode step while the trainer computes (and the role splits) beside `workers`."""
        return self.share(0, workers) / self.share(trainer, workers, split) - 1.0

    def split_rate(self, trainer: float, workers: float) -> float:
        """Cores per thread of the mismatch role (weighed by its priority) while splitting beside the
        trainer computing (0/1) and `workers` decoding, on the pool whose cores it shares."""
        weight = self.split_threads / self.trainer_threads  # the role runs trainer.threads threads
        if self.split_with_workers or not self.apart:
            cores, threads = self.cores, self.background + self.worker_threads * workers
            threads += 0 if self.apart else self.trainer_threads * trainer
        else:
            cores, threads = self.trainer_cores, self.trainer_background + self.trainer_threads * trainer
        return min(1.0, cores * weight / (threads + self.split_threads)) if weight > 0 else 1.0

    def split_slowdown(self, workers: int, trainer: float = 0.0) -> float:
        """Extra share of a split while `workers` decode (and the trainer computes) beside it."""
        return self.split_rate(0, 0) / self.split_rate(trainer, workers) - 1.0


class Factors(msgspec.Struct, frozen=True):
    """How a scenario's machine changes each role's logged times."""

    decode_slowdown: float  # extra share of a decode step while the trainer computes
    trainer_slowdown: float  # extra share of the trainer's compute while every worker decodes
    decode_scale: float = 1.0  # a decode step's seconds on the scenario's machine / on the logged one
    trainer_scale: float = 1.0  # the trainer's compute and publish seconds, likewise
    decode_split: float = 0.0  # extra share of a decode step while the mismatch role computes
    trainer_split: float = 0.0  # extra share of the trainer's compute while the mismatch role computes
    split_decode: float = 0.0  # extra share of a split while every worker decodes
    split_trainer: float = 0.0  # extra share of a split while the trainer computes


def factors(logged: Cores, logged_workers: int, workers: int, background: float | None) -> Factors:
    """Slowdowns for the scenario's workers and background, and each role alone rescaled from its
    logged share of the cores to the scenario's (more workers, or less other load). A background
    given for a machine pinned in two pools is spread over its cores."""
    cores = logged
    if background is not None:
        total = logged.cores + logged.trainer_cores
        cores = msgspec.structs.replace(logged, background=background * logged.cores / total,
                                        trainer_background=background * logged.trainer_cores / total)
    return Factors(decode_slowdown=cores.decode_slowdown(workers), trainer_slowdown=cores.trainer_slowdown(workers),
                   decode_scale=logged.share(0, logged_workers) / cores.share(0, workers),
                   trainer_scale=logged.trainer_share(0) / cores.trainer_share(0),
                   decode_split=cores.decode_slowdown(workers, trainer=0, split=1),
                   trainer_split=cores.trainer_slowdown(0, split=1),
                   split_decode=cores.split_slowdown(workers), split_trainer=cores.split_slowdown(0, trainer=1))


def layout_of(started: list[RunStarted], stats: list[tuple[int, WorkerStats]], splits: list[tuple[int, MismatchSplit]],
            trainer_threads: int, engine_threads: int) -> Cores | None:
    """The cores each role may use, as logged: the trainer apart from the workers when their
    affinities share no core, else one pool of RunStarted.cpu_count; None when not recorded. The
    mismatch role runs trainer.threads threads, each weighted by its CPU priority (MismatchSplit.nice)
    as Linux's scheduler weighs a contended core's threads."""
    trainer = set(started[-1].cpus) if started else set()
    workers = {c for _, e in stats for c in e.cpus}
    split = {c for _, e in splits for c in e.cpus}
    apart = bool(trainer and workers and not trainer & workers)
    cores = len(workers) if apart else len(trainer | workers) or (started[-1].cpu_count if started else 0)
    if cores < 1:
        return None
    return Cores(cores=cores, background=0.0, trainer_threads=trainer_threads, worker_threads=engine_threads,
                 trainer_rate=0.0, worker_rate=0.0, trainer_cores=len(trainer) if apart else 0,
                 split_threads=trainer_threads * NICE_WEIGHT ** -splits[-1][1].nice if splits else 0.0,
                 split_with_workers=not split or not workers or bool(split & workers),
                 split_with_trainer=not split or not trainer or bool(split & trainer))


class CpuRate(msgspec.Struct, array_like=True):
    """One measured interval of a role: CPU seconds over wall seconds, the share of those wall seconds
    the other role was running, and the share the mismatch role computed."""

    cpu_s: float
    wall_s: float
    overlap: float
    split: float = 0.0


def fit_cores(layout: Cores, workers: int, trainer: list[CpuRate], rollout: list[CpuRate]) -> Cores:
    """The backgrounds that best explain the measured rates (trainer steps, worker intervals) on
    `layout`'s cores, threads and pools; the smallest among equals (a machine with cores to spare hides it)."""
    t = _rows(trainer)
    w = _rows(rollout)
    bg = _BACKGROUND[:, None]
    c = layout

    def share(on: float, decoding: float, split: float) -> np.ndarray:
        threads = bg + c.worker_threads * decoding + c.split_threads * split * c.split_with_workers
        return np.minimum(1.0, c.cores / np.maximum(threads + (0 if c.apart else c.trainer_threads * on), 1e-9))

    # Time-weighted: a rate over an interval averages the share over its overlapped and lone parts.
    alone_w, alone_t = np.clip(1 - w[2] - w[3], 0, 1), np.clip(1 - t[2] - t[3], 0, 1)
    w_pred = c.worker_threads * (alone_w * share(0, workers, 0) + w[2] * share(1, workers, 0)
                                 + w[3] * share(0, workers, 1))
    error = np.sum(w[1] * (w_pred / _rate(w) - 1) ** 2, axis=1)
    if c.apart:  # the trainer's pool is fitted on its own: a background there, nothing of the workers'
        alone = np.minimum(1.0, c.trainer_cores / (bg + c.trainer_threads))
        beside = np.minimum(1.0, c.trainer_cores / (bg + c.trainer_threads + c.split_threads * c.split_with_trainer))
        t_pred = c.trainer_threads * ((1 - t[3]) * alone + t[3] * beside)
        k = int(np.argmin(np.sum(t[1] * (t_pred / _rate(t) - 1) ** 2, axis=1) + 1e-9 * _BACKGROUND))
        trainer_background = float(_BACKGROUND[k])
    else:
        t_pred = c.trainer_threads * (alone_t * share(1, 0, 0) + t[2] * share(1, workers, 0) + t[3] * share(1, 0, 1))
        error = error + np.sum(t[1] * (t_pred / _rate(t) - 1) ** 2, axis=1)
        trainer_background = 0.0
    i = int(np.argmin(error + 1e-9 * _BACKGROUND))
    return msgspec.structs.replace(layout, background=float(_BACKGROUND[i]), trainer_background=trainer_background,
                                   trainer_rate=float(np.sum(t[0]) / np.sum(t[1])),
                                   worker_rate=float(np.sum(w[0]) / np.sum(w[1])))


def _rows(rates: list[CpuRate]) -> np.ndarray:
    return np.array([[r.cpu_s for r in rates], [r.wall_s for r in rates], [r.overlap for r in rates],
                     [r.split for r in rates]], dtype=float)


def _rate(rows: np.ndarray) -> np.ndarray:
    return np.maximum(rows[0] / rows[1], 1e-6)
