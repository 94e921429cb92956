"""Time intervals of a run's log, in milliseconds: sorted, disjoint [start, end] rows of an [n, 2] array.

When a role was busy, from the entry times of its events (the Redis server's clock) and the
durations they carry: what `reel simulate` overlaps to see which roles ran at the same time.
"""

from __future__ import annotations

import numpy as np

from reel.bus.events import MismatchSplit, StepCommitted, Trajectory

__all__ = ["NONE", "compute_intervals", "active_intervals", "split_intervals", "union", "clip", "length",
           "intersection"]

NONE = np.zeros((0, 2))


def compute_intervals(commits: list[tuple[int, StepCommitted]]) -> np.ndarray:
    """When the trainer computed (a commit's entry id is stamped after its publish)."""
    out = []
    for ms, e in commits:
        end = ms - 1000 * e.timing.publish
        out.append((end - 1000 * e.timing.compute, end))
    return union(np.array(out, dtype=float).reshape(-1, 2))


def active_intervals(trajectories: list[tuple[int, Trajectory]]) -> dict[str, np.ndarray]:
    """Per worker, when it had a group in flight: from each group's start to its publication."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for ms, e in trajectories:
        spans.setdefault(e.worker, []).append((ms - 1000 * e.generate_s, ms))
    return {worker: union(np.array(s, dtype=float)) for worker, s in spans.items()}


def split_intervals(splits: list[tuple[int, MismatchSplit]]) -> np.ndarray:
    """When the mismatch role computed (its event is published as each split ends)."""
    return union(np.array([(ms - 1000 * e.compute_s, ms) for ms, e in splits], dtype=float).reshape(-1, 2))


def union(intervals: np.ndarray) -> np.ndarray:
    out: list[list[float]] = []
    for start, end in intervals[np.argsort(intervals[:, 0])]:
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return np.array(out, dtype=float).reshape(-1, 2)


def clip(intervals: np.ndarray, start: float, end: float) -> np.ndarray:
    clipped = np.clip(intervals, start, end)
    return clipped[clipped[:, 1] > clipped[:, 0]]


def length(intervals: np.ndarray) -> float:
    return float(np.sum(intervals[:, 1] - intervals[:, 0]))


def intersection(a: np.ndarray, b: np.ndarray) -> float:
    """Length of the intersection of two unions of intervals."""
    total = 0.0
    for start, end in a:
        total += float(np.clip(np.minimum(b[:, 1], end) - np.maximum(b[:, 0], start), 0, None).sum())
    return total
