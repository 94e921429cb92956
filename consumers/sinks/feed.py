"""Feed a sink: the run's log first, then the live bus, each point written once.

Points the tracker already holds (Sink.written) are skipped, so a restarted sink picks up at the
first step it lacks and a sink that reads the log and then the bus from its first entry writes
nothing twice. Entries trimmed from the bus were archived first (safe trimming), so log + bus
leaves no gap.
"""

from __future__ import annotations

import asyncio
import logging
import tomllib

import msgspec

from reel.bus.events import AnyEvent, ConfigChanged, EvalResult, MismatchSplit, RunFinished, RunStarted, StepCommitted
from reel.bus.streams import BusError
from reel.bus.tail import Tail
from reel.consumers.metrics import RunSource, log_events
from reel.consumers.sinks.base import RunMeta, Sink
from reel.consumers.sinks.points import eval_points, split_points, step_points

__all__ = ["Feed", "run_meta"]

FEED_STREAMS = ["control", "steps"]  # RunStarted, EvalResult, RunFinished; StepCommitted, MismatchSplit

log = logging.getLogger(__name__)


def run_meta(source: RunSource) -> RunMeta:
    text = (source.run_dir / "config.toml").read_text()
    return RunMeta(run=source.run, run_dir=source.run_dir, config_toml=text, config=tomllib.loads(text))


class Feed:
    """Writes one run's events into one sink; `run()` returns the number of steps written."""

    def __init__(self, sink: Sink, source: RunSource, meta: RunMeta):
        self.sink = sink
        self.source = source
        self.meta = meta
        self.written = sink.written()  # name -> highest step held
        self.steps_written = 0
        self.finished = False
        self._described = False

    def apply(self, event: AnyEvent) -> None:
        match event:
            case RunStarted():
                self._describe(event.code_version)
            case StepCommitted():
                points = self._new(event.step, step_points(event))
                if points:
                    self.sink.write(event.step, points)
                    self.steps_written += 1
            case EvalResult():
                points = self._new(event.step, eval_points(event))
                if points:
                    self.sink.write_eval(event.step, points)
            case MismatchSplit():  # behind the steps already written
                points = self._new(event.step, split_points(event))
                if points:
                    self.sink.write_split(event.step, points)
            case RunFinished():
                self.finished = True
            case ConfigChanged():  # a --resume after that end: the run goes on
                self.finished = False

    def _new(self, step: int, points: dict[str, float]) -> dict[str, float]:
        fresh = {name: value for name, value in points.items() if step > self.written.get(name, -1)}
        self.written.update(dict.fromkeys(fresh, step))
        return fresh

    def _describe(self, code_version: str) -> None:
        if not self._described:
            self.sink.describe(msgspec.structs.replace(self.meta, code_version=code_version))
            self._described = True

    def backfill(self) -> None:
        if not (self.source.run_dir / "log").is_dir():
            return  # a run starting with its sinks: the archiver has not begun, the bus holds it all
        for event in log_events(self.source.run_dir, FEED_STREAMS):
            self.apply(event)
        self.sink.flush()

    async def follow(self, stop: asyncio.Event, *, until_finished: bool) -> None:
        """Read the live bus from its first entry; until RunFinished (`until_finished`) or until it
        has nothing new. A bus that goes away ends the feed with one more pass over the log."""
        tail = Tail(self.source.bus_url, self.source.run, FEED_STREAMS, "0", partitions=self.source.partitions)
        try:
            while not stop.is_set():
                batch = await tail.read(count=500, block_ms=500 if until_finished else 0)
                for _stream, _entry_id, event in batch:
                    self.apply(event)
                self.sink.flush()
                # Read on past a RunFinished while more comes: a resume of a stopped run follows it.
                if not batch and (self.finished or not until_finished):
                    return
        except BusError as exc:
            log.warning("sink %s lost the bus of run %s (%s); reading the rest from the log",
                        self.sink.name, self.source.run, exc)
            self.backfill()
        finally:
            await tail.close()

    async def run(self, stop: asyncio.Event, *, follow: bool) -> int:
        self.backfill()
        if self.source.bus_url is not None and not self.finished:
            await self.follow(stop, until_finished=follow)
        if not self._described:
            self._describe("")
        self.sink.flush()
        return self.steps_written
