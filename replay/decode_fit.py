"""The decode step's cost, fitted from a run's log for `reel simulate` (replay/workload.py calibrates with it).

A decode step over B sequences, X of whose prompt tokens it prefills, costs base_s + per_seq_s · B +
per_prefill_token_s · X (StepModel). The rows it is fitted on (DecodeRow), each with the shares of its
time the trainer and the mismatch role computed beside it (the shared-cores slowdowns):
- where the engine timed its steps by batch size (WorkerStats.decode_batches: the built-in engine since
  2026-12-05), one row per batch size of each WorkerStats interval: the engine's own seconds, and the
  only rows fitted;
- else each interval's means (Δbusy_s, Δdecode_steps, Δdecode_tokens, Δforward_tokens), and each group
  of a synchronous round of one-turn samples (replay/decode_rounds.py), whose time also holds its work
  around the engine (`per_group`, fitted apart as StepModel.group_s).
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec
import numpy as np

from reel.bus.events import Trajectory, WorkerStats
from reel.replay.decode_rounds import round_groups
from reel.replay.intervals import NONE, clip, intersection, length
from reel.replay.least_squares import fit_with_slowdown

__all__ = ["StepModel", "DecodeRow", "Span", "worker_spans", "interval_rows", "batch_rows", "round_rows", "fit_decode"]


class StepModel(msgspec.Struct, kw_only=True):
    """Seconds of one decode step over B sequences, X of whose prompt tokens are prefilled in it:
    (base_s + per_seq_s · B + per_prefill_token_s · X) · (1 + shared)."""

    base_s: float
    per_seq_s: float
    per_prefill_token_s: float
    shared_slowdown: float  # extra share of a step's time while the trainer computes on the same machine
    intervals: int  # rows fitted (DecodeRow)
    # Seconds a round's group spends around the engine (its prompts' hand-off, scoring, publishing), fitted
    # apart from the steps. Not simulated as a wait: charged after each group's last token, it made three
    # long-tail synchronous runs 12-38% too slow in sample (2026-12-05): that work overlaps the steps.
    group_s: float = 0.0


class DecodeRow(msgspec.Struct, array_like=True):
    """One worker's WorkerStats interval: decode steps, their mean batch, prefill and seconds; the
    shares of its active time the trainer and the mismatch role computed, and its CPU seconds
    (0: not recorded). A round's group (replay/decode_rounds.py) is a row too, with `per_group` = 1 /
    its steps: the share of one step its work around the engine takes (0 for a WorkerStats interval,
    whose busy seconds are the engine's alone)."""

    steps: int
    batch: float
    prefill: float
    step_s: float
    overlap: float
    split: float
    cpu_s: float
    per_group: float = 0.0


class Span(NamedTuple):
    """Two consecutive WorkerStats of one worker with decode steps between them, and the shares of the
    worker's active time between them that the trainer and the mismatch role computed."""

    before: WorkerStats
    after: WorkerStats
    overlap: float
    split: float


def worker_spans(stats: list[tuple[int, WorkerStats]], computing: np.ndarray, active: dict[str, np.ndarray],
                 splitting: np.ndarray) -> list[Span]:
    """Each worker's consecutive stats with decode steps between them (`active`: its groups' spans)."""
    spans, last = [], {}
    for ms, e in stats:
        prev = last.get(e.worker)
        last[e.worker] = (ms, e)
        if prev is None or e.decode_steps <= prev[1].decode_steps:
            continue
        mine = clip(active.get(e.worker, NONE), prev[0], ms)
        busy = length(mine)
        spans.append(Span(prev[1], e, intersection(mine, computing) / busy if busy else 0.0,
                          intersection(mine, splitting) / busy if busy else 0.0))
    return spans


def interval_rows(spans: list[Span]) -> list[DecodeRow]:
    """Each span's means: decode steps, mean batch and prefill, seconds a step, the worker's CPU seconds."""
    rows = []
    for p, e, overlap, split in spans:
        steps = e.decode_steps - p.decode_steps
        tokens = e.decode_tokens - p.decode_tokens
        rows.append(DecodeRow(steps, tokens / steps, (e.forward_tokens - p.forward_tokens - tokens) / steps,
                              (e.busy_s - p.busy_s) / steps, overlap, split, e.cpu_s - p.cpu_s if p.cpu_s else 0.0))
    return rows


def batch_rows(spans: list[Span]) -> list[DecodeRow]:
    """The same intervals by batch size (WorkerStats.decode_batches): a row per batch size the engine ran
    in each, its steps' seconds the engine's own. Empty where the worker did not record them."""
    rows = []
    for p, e, overlap, split in spans:
        earlier = {b: (n, x, t) for b, n, x, t in p.decode_batches}
        for b, n, x, t in e.decode_batches:
            n0, x0, t0 = earlier.get(b, (0, 0, 0.0))
            if n > n0:
                rows.append(DecodeRow(n - n0, float(b), (x - x0) / (n - n0), (t - t0) / (n - n0), overlap, split, 0.0))
    return rows


def round_rows(trajectories: list[tuple[int, Trajectory]], computing: np.ndarray,
               splitting: np.ndarray) -> list[DecodeRow]:
    """The groups of rounds that ran alone (replay/decode_rounds.py) as decode rows, with the shares of
    their time the trainer and the mismatch role computed; no CPU seconds."""
    rows = []
    for g in round_groups(trajectories):
        span, wall = np.array([[g.start_ms, g.end_ms]]), max(1.0, g.end_ms - g.start_ms)
        rows.append(DecodeRow(g.steps, g.batch, g.prefill, g.step_s, intersection(span, computing) / wall,
                              intersection(span, splitting) / wall, 0.0, 1.0 / g.steps))
    return rows


def fit_decode(rows: list[DecodeRow], slowdown: float | None, split_slowdown: float) -> StepModel:
    """Least squares of the mean step time on mean batch and prefill over WorkerStats intervals and
    rounds' groups, with a round group's work around the engine a cost of its own (per_group), not
    taken for decode steps: folded into them, it made a full engine's steps look dearer per sequence
    (a negative base, clipped to 0: on a long-tail bench log, 0 + 0.060 ms a sequence against 0.19 ms
    + 0.047 ms), and so the half-full steps where the long answers decode too slow."""
    w, b, x, s, o, m, g = (np.array([getattr(r, f) for r in rows], dtype=float)
                           for f in ("steps", "batch", "prefill", "step_s", "overlap", "split", "per_group"))
    columns = np.stack([np.ones_like(b), b, x, g], axis=1)
    if np.linalg.matrix_rank(columns) < columns.shape[1]:
        # The rows cannot tell a group's own seconds from its steps (for example rounds alike in their
        # prompt tokens, whose prefill per step is then a multiple of per_group, and no interval): the
        # steps alone are fitted, as before.
        columns[:, 3] = 0.0
    (base, per_seq, per_prefill, group), shared = fit_with_slowdown(w, columns, s, o, slowdown, split_slowdown * m)
    return StepModel(base_s=base, per_seq_s=per_seq, per_prefill_token_s=per_prefill, shared_slowdown=shared,
                     intervals=len(rows), group_s=group)
