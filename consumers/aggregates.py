"""Rolling aggregates of one run's events: pure state fed one event at a time, no I/O.

`RunAggregates.apply(event)` folds an event in; `snapshot()` returns an immutable `Snapshot` that
the terminal view, the Prometheus collector and tests read. The same code aggregates a live bus
(consumers/metrics.py feeds it from an XREAD tail) and a finished run's log, so both show the same
figures. Events are deduplicated on `(producer, seq)` because the bus delivers at least once.

Figures and where they come from:
    reward           Trajectory: one figure per group (mean sample reward); mean/p50/p90 over the
                     last `window_groups` groups; per step: metrics["reward_mean"] when the trainer
                     wrote it, else the mean over the step's groups this aggregate saw
    mismatch         StepCommitted.metrics of the latest step (MISMATCH_KEYS; absent keys stay absent); the
                     numerics/drift split from the latest MismatchSplit (the mismatch role's, which lags
                     the trainer: split_step, split_lag_steps), also merged into its step's row; logs
                     from before that role carry the split in StepCommitted.metrics
    staleness        StepCommitted.staleness summed over steps (versions behind -> tokens)
    idle ratio       StepCommitted.timing: sum(wait) / sum(wait + compute + publish), last `window_steps`
    published        Trajectory events per worker: each is one group put on the bus
    dropped          StepCommitted.dropped counted by reason code (DROP_REASONS; the text stays in the log)
    workers          latest WorkerStats per worker; lag = latest WeightsPublished.version - its version
    dead letters     set from outside while live (the `dead` stream holds raw entries, not events),
                     from RunFinished.dead_letters in a finished run's log; never lowered

Published groups = trained + dropped + unused: a group is unused while it waits for the trainer,
and at the end of a run the groups rollout made for versions the trainer never reached stay unused
(e.g. 1952 published, 1920 trained, 32 unused on examples/reverse_text.toml).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque

import msgspec
import numpy as np

from reel.bus.events import (
    AnyEvent, ConfigChanged, EvalResult, MismatchSplit, RunFinished, StepCommitted, StepTiming, Trajectory,
    WeightsPublished, WorkerStats, event_key,
)

__all__ = ["DROP_REASONS", "MISMATCH_KEYS", "drop_reason_code", "end_of", "RunAggregates", "Snapshot", "StepRow",
           "WorkerView", "idle_share", "step_row"]

# Reason codes of dropped groups: the trainer writes "CODE: details" (consumers/trainer.py); the
# code is the metrics label (a small fixed set), an unknown code counts as "other".
DROP_REASONS = ("stale", "bad_routing", "other")


def drop_reason_code(reason: str) -> str:
    code = reason.split(":", 1)[0].strip()
    return code if code in DROP_REASONS else "other"


# StepCommitted.metrics keys the trainer writes for train/inference mismatch (runtime/train/loss.py).
# numerics_k3 / drift_k3: the split of kl_k3 into engine numerics and policy drift (runtime/train/mismatch_split.py),
# in MismatchSplit.figures (StepCommitted.metrics in logs from before the mismatch role).
MISMATCH_KEYS = ("kl_k1", "kl_k2", "kl_k3", "numerics_k3", "drift_k3", "ratio_mean", "ratio_min", "ratio_max",
                 "ratio_frac_outside", "entropy")


class StepRow(msgspec.Struct, frozen=True):
    """The figures of one committed step (a line of `reel metrics export`)."""

    step: int
    version: int
    loss: float
    grad_norm: float
    reward: float | None
    metrics: dict[str, float]
    staleness: dict[int, int]
    staleness_mean: float | None  # token-weighted mean versions behind
    idle_share: float | None
    groups: int
    dropped: int
    dropped_by_reason: dict[str, int]  # by reason code (DROP_REASONS)
    timing: StepTiming


class WorkerView(msgspec.Struct, frozen=True):
    worker: str
    tokens_per_s: float
    running: int
    waiting: int
    policy_version: int
    version_lag: int | None  # None until a WeightsPublished was seen
    idle_share: float
    version_spans_assumed: int = 0  # samples whose policy-version spans the engine did not report


class Snapshot(msgspec.Struct, frozen=True):
    run: str
    finished: str | None  # RunFinished.reason once the run is over or has ended early (none again after a resume)
    step: int | None  # latest committed trainer step
    policy_version: int | None  # latest published weights version
    groups_seen: int  # Trajectory events (distinct): groups published by all workers
    groups_published: dict[str, int]  # worker -> Trajectory events it published (distinct)
    groups_trained: int  # group ids in StepCommitted.groups, summed
    window_groups: int  # groups in the reward window (<= RunAggregates.window_groups)
    reward_mean: float | None
    reward_p50: float | None
    reward_p90: float | None
    step_reward: float | None  # of the latest step
    loss: float | None
    grad_norm: float | None
    mismatch: dict[str, float]  # latest step's MISMATCH_KEYS that were present
    idle_ratio: float | None
    staleness: dict[int, int]
    dropped: dict[str, int]  # every code of DROP_REASONS, from 0
    dead_letters: int | None  # None when unknown (a log without RunFinished and no bus to ask)
    workers: list[WorkerView]
    tokens_per_s: float  # sum over workers
    recent_steps: list[StepRow]
    bus_lost_events: int = 0  # logged events Redis lost, as commits after a resume recorded them
    latest_eval: EvalResult | None = None  # the eval role's result for the newest version it scored
    eval_skipped: int = 0  # versions the eval role passed over (it runs behind), summed
    dataset_epoch: int | None = None  # newest epoch of a dataset env's prompts (Trajectory.meta["epoch"])
    reward_by_task: dict[str, float] = {}  # mean group reward per task (Trajectory.meta task), last K groups each
    reward_parts: dict[str, float] = {}  # mean of each Sample.scores part (a verifiers rubric's functions), last K groups
    split_step: int | None = None  # the step of the latest MismatchSplit (the mismatch role lags the trainer)
    split_lag_steps: int | None = None  # how many committed steps it was behind when it published that one


def end_of(reason: str | None) -> str | None:
    """How a run ended, from its RunFinished.reason: "failed" (a role exited), "stopped" (a signal
    reached the launcher), "finished" (any other reason: it ran its last step); None while it runs."""
    if reason is None:
        return None
    kind = reason.partition(":")[0]
    return kind if kind in ("failed", "stopped") else "finished"


def idle_share(timing: StepTiming) -> float | None:
    total = timing.wait + timing.compute + timing.publish
    return timing.wait / total if total > 0 else None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def step_row(event: StepCommitted, group_rewards: dict[str, float]) -> StepRow:
    """One step's figures; `group_rewards` (group id -> mean reward) fills in a missing reward_mean."""
    reward = event.metrics.get("reward_mean")
    if reward is None:
        reward = _mean([group_rewards[g] for g in event.groups if g in group_rewards])
    tokens = sum(event.staleness.values())
    staleness_mean = sum(k * n for k, n in event.staleness.items()) / tokens if tokens else None
    return StepRow(
        step=event.step, version=event.version, loss=event.loss, grad_norm=event.grad_norm, reward=reward,
        metrics=dict(event.metrics), staleness=dict(event.staleness), staleness_mean=staleness_mean,
        idle_share=idle_share(event.timing), groups=len(event.groups), dropped=len(event.dropped),
        dropped_by_reason=dict(Counter(drop_reason_code(d.reason) for d in event.dropped)), timing=event.timing,
    )


class _Bounded:
    """Insertion-ordered map that forgets its oldest keys beyond `capacity`."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.items: OrderedDict = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self.items

    def put(self, key: object, value: object) -> None:
        self.items[key] = value
        if len(self.items) > self.capacity:
            self.items.popitem(last=False)


class RunAggregates:
    """Rolling figures of one run; `apply` every event in bus order, read `snapshot()`."""

    def __init__(self, run: str = "", *, window_groups: int = 64, window_steps: int = 20,
                 history_steps: int = 200, remember: int = 65_536):
        # fixed at construction
        self.run = run
        self.window_groups = window_groups
        self.window_steps = window_steps
        # rolling windows
        self._group_rewards: deque[float] = deque(maxlen=window_groups)
        self._recent_steps: deque[StepRow] = deque(maxlen=max(history_steps, window_steps))
        # lookups, bounded so a long run does not grow them without end
        self._seen = _Bounded(remember)  # event keys already applied
        self._reward_of_group = _Bounded(remember)  # group id -> mean reward
        # cumulative
        self._published: Counter[str] = Counter()
        self._groups_trained = 0
        self._staleness: Counter[int] = Counter()
        self._dropped: Counter[str] = Counter({code: 0 for code in DROP_REASONS})
        self._bus_lost_events = 0
        self._workers: dict[str, WorkerStats] = {}
        # latest
        self._finished: str | None = None
        self._policy_version: int | None = None
        self._dead_letters: int | None = None
        self._eval: EvalResult | None = None
        self._eval_skipped = 0
        self._task_rewards: dict[str, deque[float]] = {}
        self._dataset_epoch: int | None = None
        self._reward_parts: dict[str, deque[float]] = {}
        self._split: MismatchSplit | None = None

    def apply(self, event: AnyEvent) -> StepRow | None:
        """Fold in one event; returns the step's figures when the event is a new StepCommitted."""
        key = event_key(event)
        if key in self._seen:
            return None
        self._seen.put(key, True)
        if not self.run:
            self.run = event.run
        match event:
            case Trajectory():
                reward = _mean([s.reward for s in event.samples])
                if reward is not None:
                    self._group_rewards.append(reward)
                    self._reward_of_group.put(event.group_id, reward)
                self._published[event.worker] += 1
                task, epoch = event.meta.get("task"), event.meta.get("epoch")
                if isinstance(epoch, int):
                    self._dataset_epoch = max(epoch, self._dataset_epoch or 0)
                if reward is not None and isinstance(task, str):
                    self._task_rewards.setdefault(task, deque(maxlen=self.window_groups)).append(reward)
                for part in {name for sample in event.samples for name in sample.scores}:
                    values = [sample.scores[part] for sample in event.samples if part in sample.scores]
                    self._reward_parts.setdefault(part, deque(maxlen=self.window_groups)).append(float(np.mean(values)))
            case StepCommitted():
                row = step_row(event, self._reward_of_group.items)
                self._recent_steps.append(row)
                self._groups_trained += row.groups
                self._staleness.update(event.staleness)
                self._dropped.update(row.dropped_by_reason)
                self._bus_lost_events += int(event.metrics.get("bus_lost_events", 0))
                return row
            case MismatchSplit():
                if self._split is None or event.step >= self._split.step:
                    self._split = event
                for i, row in enumerate(self._recent_steps):  # its step's row shows the split too
                    if row.step == event.step:
                        self._recent_steps[i] = msgspec.structs.replace(row, metrics={**row.metrics, **event.figures})
            case WeightsPublished():
                self._policy_version = max(event.version, self._policy_version or 0)
            case WorkerStats():
                self._workers[event.worker] = event
            case EvalResult():
                self._eval_skipped += len(event.skipped_versions)
                if self._eval is None or event.version >= self._eval.version:
                    self._eval = event
            case RunFinished():
                self._finished = event.reason
                self.set_dead_letters(event.dead_letters)
            case ConfigChanged():  # a --resume: the run goes on after the end its log recorded
                self._finished = None
        return None

    def set_dead_letters(self, count: int) -> None:
        """A count of entries ever dead-lettered; a lower one than already known is stale."""
        self._dead_letters = max(count, self._dead_letters or 0)

    def snapshot(self) -> Snapshot:
        rewards = np.asarray(self._group_rewards, dtype=np.float64)
        p50, p90 = (float(v) for v in np.percentile(rewards, [50, 90])) if rewards.size else (None, None)
        steps = list(self._recent_steps)
        last = steps[-1] if steps else None
        window = steps[-self.window_steps:]
        wait = sum(s.timing.wait for s in window)
        busy = sum(s.timing.compute + s.timing.publish for s in window)
        workers = [
            WorkerView(
                worker=w.worker, tokens_per_s=w.tokens_per_s, running=w.running, waiting=w.waiting,
                policy_version=w.policy_version,
                version_lag=None if self._policy_version is None else self._policy_version - w.policy_version,
                idle_share=w.idle_share, version_spans_assumed=w.version_spans_assumed,
            )
            for w in sorted(self._workers.values(), key=lambda w: w.worker)
        ]
        return Snapshot(
            run=self.run, finished=self._finished, step=last.step if last else None,
            policy_version=self._policy_version, groups_seen=sum(self._published.values()),
            groups_published=dict(sorted(self._published.items())),
            groups_trained=self._groups_trained, window_groups=int(rewards.size),
            reward_mean=float(rewards.mean()) if rewards.size else None, reward_p50=p50, reward_p90=p90,
            step_reward=last.reward if last else None, loss=last.loss if last else None,
            grad_norm=last.grad_norm if last else None,
            mismatch=self._mismatch(last),
            idle_ratio=wait / (wait + busy) if wait + busy > 0 else None,
            staleness=dict(sorted(self._staleness.items())), dropped=dict(self._dropped),
            dead_letters=self._dead_letters, workers=workers,
            tokens_per_s=sum(w.tokens_per_s for w in workers), recent_steps=steps,
            bus_lost_events=self._bus_lost_events, latest_eval=self._eval, eval_skipped=self._eval_skipped,
            dataset_epoch=self._dataset_epoch,
            reward_by_task={t: float(np.mean(r)) for t, r in sorted(self._task_rewards.items()) if r},
            reward_parts={p: float(np.mean(r)) for p, r in sorted(self._reward_parts.items()) if r},
            split_step=self._split.step if self._split else None,
            split_lag_steps=self._split.lag_steps if self._split else None,
        )

    def _mismatch(self, last: StepRow | None) -> dict[str, float]:
        """The latest step's MISMATCH_KEYS, the split from the latest MismatchSplit (an older step, the role lags)."""
        figures = {**(last.metrics if last else {}), **(self._split.figures if self._split else {})}
        return {k: figures[k] for k in MISMATCH_KEYS if k in figures}
