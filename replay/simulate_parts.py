"""What `reel simulate` moves around: groups, their samples' turns, the rollout workers' engines, work
whose pace changes (Paced); and its figures (SimResult: one run's, the mean of several, the
bottleneck they show)."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import msgspec


@dataclass
class Group:
    samples: int  # unfinished samples
    worker: int  # index of the worker that generates it
    rows: list[int]  # its samples' row lengths in a training batch (GroupShape.rows)
    tokens: dict[int, int] = field(default_factory=dict)  # version -> tokens sampled under it
    oldest: int = 1 << 30

    def sampled(self, version: int, count: int) -> None:
        self.tokens[version] = self.tokens.get(version, 0) + count
        self.oldest = min(self.oldest, version)


@dataclass
class Sequence:
    """One sample: the engine request of its current model turn, then the next turns'."""

    group: Group
    turns: list[int]  # token counts: model turn, env turn, model turn, ... (GroupShape.samples)
    context: int  # tokens the current turn's request starts from: the prompt, then the turns before it
    waits: list[float]  # seconds the env took to answer each model turn (GroupShape.env_s; [] = none)
    turn: int = 0  # index in `turns` of the model turn being sampled
    left: int = 0  # tokens still to sample in it

    def __post_init__(self) -> None:
        self.left = max(1, self.turns[0])

    @property
    def prefill(self) -> int:
        """Prompt tokens fed with the request's first step beyond the one sampled from."""
        return max(0, self.context - 1)

    def env_wait(self) -> float:
        """Seconds the env takes to answer the model turn just finished."""
        model_turn = self.turn // 2
        return self.waits[model_turn] if model_turn < len(self.waits) else 0.0

    def next_turn(self) -> bool:
        """After a model turn: append the env's turn and start the next model turn, if there is one."""
        if self.turn + 1 >= len(self.turns):
            return False
        self.context += self.turns[self.turn] + self.turns[self.turn + 1]
        self.turn += 2
        self.left = max(1, self.turns[self.turn])
        return True


@dataclass
class Paced:
    """Work whose pace changes with what runs beside it (the trainer's compute, a split): its seconds
    alone still to do, re-timed whenever the slowdown changes; `timer` names the pending end event."""

    running: bool = False
    left: float = 0.0  # seconds alone still to do as of `since`
    since: float = 0.0
    factor: float = 0.0  # the slowdown the pending end was timed with (0: not timed yet)
    timer: int = 0

    def start(self, seconds: float) -> None:
        self.running, self.left, self.factor = True, seconds, 0.0

    def retime(self, now: float, factor: float) -> float | None:
        """Seconds until done at `factor` (a new timer), or None when the pace is unchanged."""
        if factor == self.factor:
            return None
        if self.factor:
            self.left -= (now - self.since) / self.factor
        self.since, self.factor = now, factor
        self.timer += 1
        return self.left * factor


@dataclass
class Worker:
    index: int
    running: list[Sequence] = field(default_factory=list)
    waiting: collections.deque[Sequence] = field(default_factory=collections.deque)
    in_flight: int = 0
    started: int = 0
    replaced: int = 0  # of the groups started, those the trainer dropped: the gate starts one more for each
    version: int = 0  # live in the engine
    committed: int = 0  # newest commit seen
    busy: bool = False  # a decode step or a swap is under way
    idle_since: float | None = 0.0
    idle: list[tuple[float, float]] = field(default_factory=list)  # [start, end) without a group in flight


def bottleneck(trainer_idle: float, rollout_idle: float, redis_busy: float) -> str:
    """What sets the pace. "latency": trainer and workers both wait a fifth of the time or more, so
    neither is saturated; a step waits for its round's slowest group while the async gate holds the
    workers (raise async_level, or shorten the tail)."""
    if redis_busy > 0.8:
        return "redis"
    if min(trainer_idle, rollout_idle) >= 0.2:
        return "latency"
    return "trainer" if trainer_idle <= rollout_idle else "rollout"


def clip_length(a: float, b: float, lo: float, hi: float) -> float:
    return max(0.0, min(b, hi) - max(a, lo))


class SimResult(msgspec.Struct, kw_only=True):
    steps: int
    wall_s: float  # steps 2..N
    steps_per_hour: float
    trainer_idle: float  # share of the wall time the trainer waited for groups
    rollout_idle: float  # mean share of the wall time a worker had no group in flight
    staleness: dict[int, int]  # versions behind -> tokens, over every step
    dropped_share: float  # groups dropped as too stale / groups that reached the trainer
    redis_busy: float  # share of the wall time the Redis thread spent on group events
    bottleneck: str  # "redis" | "latency" (both sides wait on each other) | "trainer" | "rollout"


def mean_result(results: list[SimResult]) -> SimResult:
    """The mean of runs that differ only in their draw of groups (token counts rounded)."""
    n = len(results)
    wall = sum(r.wall_s for r in results) / n
    trainer_idle = sum(r.trainer_idle for r in results) / n
    rollout_idle = sum(r.rollout_idle for r in results) / n
    redis = sum(r.redis_busy for r in results) / n
    behind = sorted({k for r in results for k in r.staleness})
    return SimResult(steps=results[0].steps, wall_s=wall,
                     steps_per_hour=3600 * (results[0].steps - 1) / wall if wall else 0.0,
                     trainer_idle=trainer_idle, rollout_idle=rollout_idle,
                     staleness={k: round(sum(r.staleness.get(k, 0) for r in results) / n) for k in behind},
                     dropped_share=sum(r.dropped_share for r in results) / n, redis_busy=redis,
                     bottleneck=bottleneck(trainer_idle, rollout_idle, redis))
