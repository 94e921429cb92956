"""The calibration's least squares: times as non-negative sums of costs, each stretched by what
sharing the cores cost it (replay/workload.py fits the engine's decode steps and the trainer's
steps with them)."""

from __future__ import annotations

import math

import numpy as np

SLOWDOWN_GRID = np.linspace(0.0, 3.0, 301)  # k, the slowdown per share of time the cores were shared


def fit_with_slowdown(weight: np.ndarray, x: np.ndarray, y: np.ndarray, shared: np.ndarray,
                       slowdown: float | None, extra: np.ndarray) -> tuple[list[float], float]:
    """y ≈ (x · coef)(1 + k · shared + extra), coef >= 0: weighted least squares at k = `slowdown` (the
    shared-cores model's), else at each k of a grid, best k; `extra` is what the mismatch role's
    computing beside each row cost it (the shared-cores model's, 0 without one).

    When `shared` does not vary (a synchronous run never overlaps) every k of the grid fits alike
    and the smallest, 0, is kept: without CPU times such a log cannot tell what sharing costs."""
    best: tuple[float, list[float], float] = (math.inf, [0.0] * x.shape[1], 0.0)
    for k in SLOWDOWN_GRID if slowdown is None else [slowdown]:
        factor = 1.0 + k * shared + extra
        coef = non_negative_lstsq(x * factor[:, None], y, weight)
        residual = float(np.sum(weight * (y - (x @ coef) * factor) ** 2))
        if residual < best[0] * (1 - 1e-12) - 1e-15:
            best = (residual, [float(c) for c in coef], float(k))
    return best[1], best[2]


def non_negative_lstsq(x: np.ndarray, y: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Weighted least squares; a column whose coefficient comes out negative (noise, or a feature
    that does not vary) is left out and the rest refitted: times are sums of non-negative costs."""
    keep = [j for j in range(x.shape[1]) if np.any(x[:, j])]
    root = np.sqrt(weight)[:, None]
    while True:
        coef = np.zeros(x.shape[1])
        if keep:
            coef[keep] = np.linalg.lstsq(x[:, keep] * root, y * root[:, 0], rcond=None)[0]
        negative = [j for j in keep if coef[j] < 0]
        if not negative:
            return coef
        keep.remove(min(negative, key=lambda j: coef[j]))
