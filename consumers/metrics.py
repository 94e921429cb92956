"""Live metrics of a run: a bus watcher, `reel top`, Prometheus exposition and a JSONL export.

Watchers read the bus with plain XREAD (reel.bus.streams.Tail) from an entry id, never through a
consumer group: any number can attach, none can slow the trainer or hold entries back from
trimming. A finished run (RunFinished in its log, or no Redis to reach) is read from its on-disk
log instead, through the same aggregates (consumers/aggregates.py), so both show the same figures.

Finding a run: `--bus URL --name NAME`, or `--run DIR`, whose name is `[run] name` of
DIR/config.toml and whose bus is the URL in DIR/bus_url (written by the launcher while the run is
live; `--bus` overrides it).
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import signal
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import msgspec
import redis.asyncio as aioredis
from prometheus_client import start_http_server
from prometheus_client.registry import CollectorRegistry
from rich.console import Console
from rich.live import Live

from reel.bus.errors import ReelError
from reel.bus.events import AnyEvent, ConfigChanged, RunFinished
from reel.bus.jsonout import json_line
from reel.bus.run_log import RunLog
from reel.bus.streams import BusError, connect, dead_letters_added
from reel.bus.tail import Tail
from reel.consumers.aggregates import MISMATCH_KEYS, RunAggregates, Snapshot, StepRow
from reel.consumers.metric_views import SnapshotCollector, render
from reel.runtime.config import run as run_config
from reel.runtime.fit_tables import fit

__all__ = ["MetricsError", "RunSource", "Watcher", "locate", "log_events", "read_log", "serve", "export_jsonl",
           "main_top", "main_serve", "main_export"]

WATCH_STREAMS = ["control", "weights", "trajectories", "steps"]  # routing traces carry no figures


class MetricsError(ReelError):
    """A run that cannot be found or read, or an output that cannot be written."""


class RunSource(msgspec.Struct, frozen=True):
    run: str
    bus_url: str | None  # None: read the log
    run_dir: Path | None
    partitions: int = 1  # bus.partitions of the run

    def describe(self) -> str:
        """Where the figures come from, without the URL's password."""
        if self.bus_url is None:
            return f"log {self.run_dir}"
        parts = urlsplit(self.bus_url)
        return f"live {parts._replace(netloc=parts.netloc.rpartition('@')[2]).geturl()}"


# ---------------------------------------------------------------- sources


async def _reachable(url: str) -> bool:
    client = None
    try:
        client = connect(url, socket_timeout=2.0)
        return bool(await client.ping())
    except (BusError, aioredis.RedisError, OSError):
        return False
    finally:
        if client is not None:
            await asyncio.shield(client.aclose())


def _log_finished(run_dir: Path) -> bool:
    """The log ends with the run's end: a RunFinished that no resume (ConfigChanged) came after."""
    if not (run_dir / "log" / "control").is_dir():
        return False
    with RunLog(run_dir, readonly=True) as log:
        ends = [isinstance(e, RunFinished) for _, e in log.events("control")
                if isinstance(e, (RunFinished, ConfigChanged))]
    return bool(ends) and ends[-1]


async def locate(run_dir: str | None, bus: str | None, name: str | None) -> RunSource:
    """Where to read a run: its live bus, or its log when it finished or no Redis answers."""
    if run_dir is None:
        if not (bus and name):
            raise MetricsError("name a run with --run DIR, or with --bus URL and --name NAME")
        return RunSource(name, bus, None)
    directory = Path(run_dir)
    config_file = directory / "config.toml"
    if not config_file.is_file():
        raise MetricsError(f"{config_file} does not exist; is {directory} a run directory?")
    config = run_config.load(config_file)
    run = name or config.run.name
    url_file = directory / "bus_url"
    url = bus or (url_file.read_text().strip() if url_file.is_file() else None)
    if url and not _log_finished(directory) and await _reachable(url):
        return RunSource(run, url, directory, config.bus.partitions)
    if not (directory / "log").is_dir():
        raise MetricsError(f"{directory} has no log/ and no reachable bus (bus_url or --bus); "
                           "is the run started?")
    return RunSource(run, None, directory)


def _entry_order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def log_events(run_dir: Path, streams: Iterable[str] = WATCH_STREAMS) -> Iterator[AnyEvent]:
    """A run's logged events of `streams`, merged into bus order (entry ids are one Redis clock).

    Read-only: safe while the archiver is still appending."""
    with RunLog(run_dir, readonly=True) as log:
        per_stream = [((_entry_order(i), e) for i, e in log.events(s)) for s in streams if s in log.names()]
        for _, event in heapq.merge(*per_stream, key=lambda pair: pair[0]):
            yield event


def read_log(source: RunSource) -> Snapshot:
    """The final figures of a run, from its log."""
    aggregates = RunAggregates(source.run)
    for event in log_events(source.run_dir):
        aggregates.apply(event)
    return aggregates.snapshot()


class Watcher:
    """Follows one run on the bus with XREAD and keeps its aggregates current.

    `snapshot` is replaced whole after each read, so a reader in another thread (the Prometheus
    HTTP server) always sees a consistent one.
    """

    def __init__(self, url: str, run: str, *, start: str = "0", window_groups: int = 64, partitions: int = 1):
        self.run = run
        self.aggregates = RunAggregates(run, window_groups=window_groups)
        self.snapshot = self.aggregates.snapshot()
        self._tail = Tail(url, run, WATCH_STREAMS, start, partitions=partitions)
        self._redis = connect(url)
        self._partitions = partitions  # one dead-letter stream per slot

    async def poll(self, block_ms: int = 1000, count: int = 500) -> int:
        """Read and fold in one batch (waiting up to `block_ms`); returns how many events came."""
        batch = await self._tail.read(count=count, block_ms=block_ms)
        for _stream, _entry_id, event in batch:
            self.aggregates.apply(event)
        self.aggregates.set_dead_letters(await dead_letters_added(self._redis, self.run, self._partitions))
        self.snapshot = self.aggregates.snapshot()
        return len(batch)

    async def catch_up(self) -> None:
        """Fold in everything already on the bus."""
        while await self.poll(block_ms=0):
            pass

    async def follow(self, stop: asyncio.Event, on_update: Callable[[Snapshot], None] | None = None, *,
                     until_finished: bool = False, block_ms: int = 500) -> None:
        while not stop.is_set():
            await self.poll(block_ms)
            if on_update is not None:
                on_update(self.snapshot)
            if until_finished and self.snapshot.finished is not None:
                return

    async def close(self) -> None:
        await asyncio.shield(self._tail.close())
        await asyncio.shield(self._redis.aclose())


def _stop_on_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


# ---------------------------------------------------------------- Prometheus endpoint


def _start_exporter(port: int, addr: str, current: Callable[[], Snapshot]):
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(current))
    try:
        server, _thread = start_http_server(port, addr=addr, registry=registry)
    except OSError as exc:
        raise MetricsError(f"cannot serve metrics on {addr}:{port}: {exc.strerror}; choose another --port") from exc
    return server


async def serve(source: RunSource, port: int, stop: asyncio.Event, *, addr: str = "127.0.0.1",
                serving: Callable[[], None] = lambda: None) -> None:
    """Serve the run's figures on http://addr:port/metrics until `stop` is set.

    Once the run has finished the figures are final: the bus is let go (its Redis may stop) and the
    last snapshot stays on the endpoint."""
    final = None if source.bus_url else read_log(source)
    watcher = Watcher(source.bus_url, source.run, partitions=source.partitions) if source.bus_url else None
    if watcher is not None:
        await watcher.catch_up()  # the first scrape sees the run's counters, not zeros that then jump
    server = _start_exporter(port, addr, lambda: watcher.snapshot if watcher else final)
    serving()  # only now: a port already taken is an error, never a "serving" line first
    try:
        if watcher is not None:
            await watcher.follow(stop, until_finished=True)
            await watcher.close()
        await stop.wait()
    finally:
        server.shutdown()
        server.server_close()
        if watcher is not None:
            await watcher.close()


# ---------------------------------------------------------------- export


def _export_row(row: StepRow) -> dict:
    return {
        "step": row.step, "version": row.version, "loss": row.loss, "grad_norm": row.grad_norm, "reward": row.reward,
        **{key: row.metrics.get(key) for key in MISMATCH_KEYS},
        "staleness": row.staleness, "staleness_mean": row.staleness_mean, "idle_share": row.idle_share,
        "groups": row.groups, "dropped": row.dropped, "dropped_by_reason": row.dropped_by_reason,
        "timing": msgspec.structs.asdict(row.timing), "metrics": row.metrics,
    }


def export_jsonl(run_dir: Path, out: Path) -> int:
    """Write one JSON line per committed step of the run's log; returns the number of lines."""
    if not (run_dir / "log" / "steps").is_dir():
        raise MetricsError(f"{run_dir / 'log' / 'steps'} does not exist; is {run_dir} a run directory?")
    aggregates = RunAggregates(history_steps=1)
    lines = 0
    try:
        with open(out, "wb") as f:
            for event in log_events(run_dir, ["trajectories", "steps"]):
                row = aggregates.apply(event)
                if row is not None:
                    f.write(json_line(_export_row(row)))
                    lines += 1
    except OSError as exc:
        raise MetricsError(f"cannot write {out}: {exc.strerror}") from exc
    return lines


# ---------------------------------------------------------------- entry points


async def _top(args: argparse.Namespace) -> int:
    source = await locate(args.run_dir, args.bus, args.name)
    console = Console()
    if source.bus_url is None:
        console.print(fit(render(read_log(source), source.describe(), live=False), console))
        return 0
    watcher = Watcher(source.bus_url, source.run, partitions=source.partitions)
    try:
        await watcher.catch_up()
        if args.once or watcher.snapshot.finished is not None:
            console.print(fit(render(watcher.snapshot, source.describe()), console))
            return 0
        stop = asyncio.Event()
        _stop_on_signals(stop)
        with Live(fit(render(watcher.snapshot, source.describe()), console), console=console,
                  refresh_per_second=4) as live:
            await watcher.follow(stop, lambda s: live.update(fit(render(s, source.describe()), console)),
                                 until_finished=True)
    finally:
        await watcher.close()
    return 0


def main_top(args: argparse.Namespace) -> int:
    return asyncio.run(_top(args))


async def _serve(args: argparse.Namespace) -> int:
    source = await locate(args.run_dir, args.bus, None)
    stop = asyncio.Event()
    _stop_on_signals(stop)
    await serve(source, args.port, stop, addr=args.addr, serving=lambda: print(
        f"reel: serving metrics of run {source.run} ({source.describe()}) on http://{args.addr}:{args.port}/metrics",
        flush=True))
    return 0


def main_serve(args: argparse.Namespace) -> int:
    return asyncio.run(_serve(args))


def main_export(args: argparse.Namespace) -> int:
    lines = export_jsonl(Path(args.run_dir), Path(args.jsonl))
    print(f"reel: wrote {lines} steps to {args.jsonl}")
    return 0
