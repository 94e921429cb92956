"""A bus that trusts roles, not entries: who may publish each event, and in what order.

Anyone who can XADD to a run's streams could otherwise steer it (a StepCommitted for a step the run
never had, a WeightsPublished with version 10**9, a RunFinished that stops the archiver, entries
squatting a worker's next seqs). Readers therefore accept an entry only when

    role     its producer's role (the part before ':') may publish its type (PRODUCERS)
    run      it names this run
    range    its seq is within what its producer has published: Publisher records each producer's
             high-water mark (the `seq` sorted set next to the streams) before the XADD, so an entry
             above the mark was not sent by a Publisher
    order    a policy version or step is the next one (or a repeat of a known one, same weights)

Consumer groups dead-letter a refused entry with its reason (GroupConsumer, the archiver); a watcher
(a rollout worker following weights) skips it with a warning, the archiver having dead-lettered it.
With ACLs on, one Redis user per role (runtime/launch/bus_access.py) makes `role` hold against a
compromised process too.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import redis.asyncio

from reel.bus.events import (
    AnyEvent, CheckpointsPruned, ConfigChanged, EvalResult, GroupsDropped, MismatchSplit, RoutingTrace, RunFinished,
    RunStarted, StepCommitted, Trajectory, WeightsPublished, WorkerStats,
)
from reel.bus.partitions import seq_keys
from reel.bus.redis_boundary import ride_out

__all__ = ["PRODUCERS", "wrong_producer", "SeqMarks", "Order", "SEQ_MARKS", "trusted"]

log = logging.getLogger(__name__)

SEQ_MARKS = "seq"  # bus/streams.py's sorted set per slot: producer -> highest seq it published there

# The roles that may publish each event type (a producer is "<role>:<instance>").
PRODUCERS: dict[type, frozenset[str]] = {
    RunStarted: frozenset({"trainer"}),
    WeightsPublished: frozenset({"trainer"}),
    StepCommitted: frozenset({"trainer"}),
    GroupsDropped: frozenset({"trainer"}),
    Trajectory: frozenset({"rollout"}),
    RoutingTrace: frozenset({"rollout"}),
    WorkerStats: frozenset({"rollout"}),
    EvalResult: frozenset({"eval"}),
    MismatchSplit: frozenset({"mismatch"}),
    ConfigChanged: frozenset({"launcher", "trainer"}),
    RunFinished: frozenset({"launcher", "trainer"}),
    CheckpointsPruned: frozenset({"trainer"}),
}


def role_of(producer: str) -> str:
    return producer.partition(":")[0]


def wrong_producer(event: AnyEvent, run: str) -> str | None:
    """Why `event` cannot have come from a role allowed to publish it in `run`, if so."""
    kind = type(event).__name__
    if event.run != run:
        return f"{kind} of run {event.run!r} on run {run!r}'s streams"
    roles = PRODUCERS.get(type(event), frozenset())
    if role_of(event.producer) not in roles:
        return f"{kind} from {event.producer!r}: only {' or '.join(sorted(roles))} publishes it"
    return None


class SeqMarks:
    """Each producer's published range, read from the run's seq marks (every slot's) when an entry's
    seq is above what is cached; a mark only grows, so the cache never says yes wrongly."""

    def __init__(self, run: str, partitions: int = 1):
        self.keys = seq_keys(run, SEQ_MARKS, partitions)
        self._mark: dict[str, int] = {}  # producer -> highest seq published (cached)

    async def refresh(self, client: redis.asyncio.Redis, stamps: Iterable[tuple[str, int]]) -> None:
        """Re-read the marks of the producers whose (producer, seq) stamps go beyond the cache."""
        producers = sorted({p for p, seq in stamps if seq > self._mark.get(p, -1)})
        if not producers:
            return

        async def attempt() -> list:
            pipe = client.pipeline(transaction=False)
            for key in self.keys:
                pipe.zmscore(key, producers)
            return await pipe.execute()

        for scores in await ride_out(client, f"ZMSCORE on {', '.join(self.keys)}", attempt):
            for producer, score in zip(producers, scores):
                if score is not None:
                    self._mark[producer] = max(self._mark.get(producer, -1), int(score))

    def problem(self, event: AnyEvent) -> str | None:
        mark = self._mark.get(event.producer)
        if mark is None:
            return f"seq {event.seq} of {event.producer}, which has published nothing on this run"
        if event.seq > mark:
            return f"seq {event.seq} of {event.producer} is beyond its published range (its last is {mark})"
        return None


async def trusted(client: redis.asyncio.Redis, run: str, marks: SeqMarks,
                  events: list[tuple[str, AnyEvent]]) -> list[AnyEvent]:
    """For a reader without a consumer group: the events of (where, event) pairs that pass `role`
    and `range`; the others are skipped with a warning naming `where` (the archiver dead-letters them)."""
    await marks.refresh(client, ((e.producer, e.seq) for _, e in events))
    out = []
    for where, event in events:
        if problem := wrong_producer(event, run) or marks.problem(event):
            log.warning("skipping %s: untrusted: %s", where, problem)
        else:
            out.append(event)
    return out


class Order:
    """The trainer's policy versions and steps: each must be the next one, or a repeat (the same
    weights) of one already seen, e.g. a version re-published after Redis lost its last second."""

    def __init__(self) -> None:
        self.versions: dict[int, str] = {}  # policy version -> weights sha256
        self.steps: dict[int, str] = {}  # step -> weights sha256

    def problem(self, event: AnyEvent) -> str | None:
        match event:
            case WeightsPublished():
                return _not_next("version", event.version, event.weights.sha256, self.versions, first=0)
            case StepCommitted():
                return _not_next("step", event.step, event.weights_sha256, self.steps, first=1)
        return None

    def learn(self, event: AnyEvent) -> None:
        match event:
            case WeightsPublished():
                self.versions.setdefault(event.version, event.weights.sha256)
            case StepCommitted():
                self.steps.setdefault(event.step, event.weights_sha256)

    def admit(self, event: AnyEvent) -> str | None:
        """`problem`, and `learn` the event when there is none."""
        problem = self.problem(event)
        if problem is None:
            self.learn(event)
        return problem


def _not_next(what: str, number: int, sha256: str, known: dict[int, str], *, first: int) -> str | None:
    if number in known:
        return None if known[number] == sha256 else f"{what} {number} was already published with other weights"
    expected = max(known) + 1 if known else first
    return None if number == expected else f"{what} {number} is not the next one ({expected})"
