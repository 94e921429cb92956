"""The mismatch role in `reel simulate`: each committed step's split is a job on the role's cores.

consumers/mismatch.py scores each due step's batch once by π_old and once more by every older
policy version among its tokens, in a process of its own. It never holds up the trainer, but it
takes cores: where it shares them with the rollout workers (`reel bench async` pins it beside them)
a decode step is slower while it computes, and an asynchronous run, whose batches span older
versions and whose steps come faster, keeps it busier than the synchronous run the model is
calibrated on. From the log's MismatchSplit events, a split of a step with P passes over T tokens
takes

    base_s + P · pass_s_per_token · T   seconds alone on its cores,

pass_s_per_token being the trainer's own π_old scoring per token (StepTiming.score_old: one forward
pass over the batch, the same work, on the trainer's cores) and base_s the rest (copying the model,
loading weights, reading the groups), the mean over the logged splits of their wall seconds
(MismatchSplit.compute_s) taken back to the role alone: each divided by the stretch that sharing
its cores gave it (replay/simulate_cores.py), from how much of it the workers decoded and the
trainer computed beside it. A synchronous log has P = 1 only; the extra passes of an asynchronous
scenario are priced by that measured forward pass, not assumed. In the simulation a split's pace
follows what runs beside it, so a role that falls behind splits back to back beside the workers.
"""

from __future__ import annotations

import msgspec
import numpy as np

from reel.bus.events import MismatchSplit, StepCommitted, WorkerStats
from reel.replay.intervals import intersection
from reel.replay.simulate_cores import Cores

__all__ = ["SplitModel", "fit_split", "passes", "stretch"]


class SplitModel(msgspec.Struct, kw_only=True):
    base_s: float  # wall seconds of a split beside its scoring passes
    pass_s_per_token: float  # one scoring pass, per batch token (the trainer's score_old)
    every: int  # mismatch.every: steps K, 2K, ... and the last are split
    splits: int  # MismatchSplit events fitted

    def seconds(self, passes: int, tokens: int) -> float:
        return self.base_s + passes * self.pass_s_per_token * tokens

    def due(self, step: int, last: int) -> bool:
        return self.every > 0 and (step % self.every == 0 or step == last)


def fit_split(commits: list[tuple[int, StepCommitted]], splits: list[tuple[int, MismatchSplit]],
              every: int, stretch: list[float]) -> SplitModel | None:
    """The cost model from steps 2..N's splits, each's wall seconds divided by its `stretch` (1 +
    its slowdown from sharing cores; ones without a model); None when the log has none (no mismatch
    role, or a log from before it) or the trainer did not time its π_old scoring."""
    steps = {e.step: e for _, e in commits[1:]}
    rows = [(msgspec.structs.replace(e, compute_s=e.compute_s / k), steps[e.step])
            for (_, e), k in zip(splits, stretch, strict=True) if e.step in steps and e.compute_s > 0]
    tokens = sum(c.metrics.get("tokens", 0.0) for _, c in commits[1:])
    scoring = sum(c.timing.score_old for _, c in commits[1:])
    if not rows or tokens <= 0 or scoring <= 0:
        return None
    per_token = scoring / tokens
    base = [s.compute_s - (1 + len(s.versions)) * per_token * c.metrics.get("tokens", 0.0) for s, c in rows]
    return SplitModel(base_s=max(0.0, sum(base) / len(base)), pass_s_per_token=per_token, every=every,
                      splits=len(rows))


def passes(behind: dict[int, int]) -> int:
    """Scoring passes of a batch whose tokens are `behind` versions behind: π_old, and each older version."""
    return 1 + sum(1 for b, tokens in behind.items() if b >= 1 and tokens > 0)


def stretch(splits: list[tuple[int, MismatchSplit]], cores: Cores | None, computing: np.ndarray,
                   active: dict[str, np.ndarray], stats: list[tuple[int, WorkerStats]]) -> list[float]:
    """Per split, how much sharing its cores stretched it: the workers decoding beside it (their
    share of it with a group in flight, times the share of that time their engines decoded) and the
    trainer computing."""
    if cores is None or not splits:
        return [1.0] * len(splits)
    first = {}
    for _, e in stats:
        first.setdefault(e.worker, e)
    last = {e.worker: e for _, e in stats}
    decoding = {w: (last[w].busy_s - first[w].busy_s) / max(1e-9, sum(
        (last[w].busy_s - first[w].busy_s, last[w].tool_wait_s - first[w].tool_wait_s))) for w in last}
    k = len(active) or 1
    out = []
    for ms, e in splits:
        span = np.array([[ms - 1000 * e.compute_s, ms]])
        wall = max(1.0, 1000 * e.compute_s)
        busy = sum(intersection(a, span) / wall * decoding.get(w, 1.0) for w, a in active.items()) / k
        out.append(1.0 + cores.split_slowdown(k) * busy + cores.split_slowdown(0, trainer=1) *
                   intersection(computing, span) / wall)
    return out
