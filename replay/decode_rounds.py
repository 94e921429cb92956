"""Decode steps timed by a synchronous round's groups: the batch sizes WorkerStats intervals lack.

A WorkerStats interval gives the mean decode step at its mean batch. On a short log whose intervals
all hold about the same batch (the long-tail bench's synchronous run: three intervals of 20 to 22
sequences) what a step costs per sequence cannot be told from what it costs anyway, and an
asynchronous scenario, whose engine holds more rounds at once, depends on it. A round whose groups
all start together, with no other group of its worker in flight (a synchronous worker after its
weight swap), decodes their one-turn samples side by side: at its k-th step the B_k samples longer
than k tokens run, and a group is done after its longest sample's K steps. So its generate_s is

    Σ_{k<K} (base_s + per_seq_s · B_k) + per_prefill_token_s · X,

X the round's prompt tokens (beyond the one sampled from), prefilled in its first step: one row of
the decode fit with K steps at mean batch ΣB_k / K and mean prefill X / K. A group's time also holds
what the worker does around its engine (scoring the reward, publishing), which the intervals' busy
seconds leave out; the rows weigh by their steps, as the intervals do.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from reel.bus.events import Trajectory

__all__ = ["RoundGroup", "round_groups"]

TOGETHER_MS = 5.0  # groups started this close together are one round (entry ids are in ms; publishing lags a little)


class RoundGroup(NamedTuple):
    worker: str
    steps: int  # K: its longest sample's tokens
    batch: float  # mean sequences decoding over its steps
    prefill: float  # the round's prompt tokens per step of it
    step_s: float  # its generate_s per step
    start_ms: float
    end_ms: float


def round_groups(trajectories: list[tuple[int, Trajectory]]) -> list[RoundGroup]:
    """The groups of every round of one-turn samples that ran alone on its worker."""
    by_worker: dict[str, list[tuple[float, float, Trajectory]]] = {}
    for ms, e in trajectories:
        by_worker.setdefault(e.worker, []).append((ms - 1000 * e.generate_s, float(ms), e))
    out = []
    for worker, groups in by_worker.items():
        groups.sort(key=lambda g: g[0])
        rounds: list[list[tuple[float, float, Trajectory]]] = []
        for g in groups:
            if rounds and g[0] - rounds[-1][0][0] <= TOGETHER_MS:
                rounds[-1].append(g)
            else:
                rounds.append([g])
        for i, round_ in enumerate(rounds):
            alone = (i == 0 or max(g[1] for g in rounds[i - 1]) <= round_[0][0]) and \
                (i + 1 == len(rounds) or max(g[1] for g in round_) <= rounds[i + 1][0][0])
            if alone and all(not s.env_spans for _, _, e in round_ for s in e.samples):
                out += _rows(worker, round_)
    return out


def _rows(worker: str, round_: list[tuple[float, float, Trajectory]]) -> list[RoundGroup]:
    lengths = np.array([max(1, int(s.tokens.shape[0])) for _, _, e in round_ for s in e.samples])
    prefill = sum(max(0, int(e.prompt.shape[0]) - 1) * len(e.samples) for _, _, e in round_)
    out = []
    for start, end, e in round_:
        steps = max(max(1, int(s.tokens.shape[0])) for s in e.samples)
        running = int(np.sum(np.minimum(lengths, steps)))  # Σ_{k<K} B_k
        out.append(RoundGroup(worker, steps, running / steps, prefill / steps, e.generate_s / steps, start, end))
    return out
