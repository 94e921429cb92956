"""Did Redis lose writes the log had already archived? Checked when a run resumes; never silent.

Redis persists with AOF `appendfsync everysec`, so a machine (or process) crash can bring it back
without its last second of writes. The archiver logs an entry before acking it, so whatever the
log holds past a stream's last entry on the bus is what Redis lost and the log kept. Entry ids
start with their millisecond timestamp, which dates the window.
"""

from __future__ import annotations

import msgspec
import redis

from reel.bus.cluster import cluster_from_env
from reel.bus.events import STREAMS
from reel.bus.log import LogError
from reel.bus.run_log import RunLog
from reel.bus.partitions import lane_key, lanes

__all__ = ["LossWindow", "find_loss_window", "describe"]


class LossWindow(msgspec.Struct, frozen=True):
    events: int  # logged events the bus no longer holds
    streams: list[str]
    first_ms: int  # timestamp of the oldest of them
    last_ms: int  # timestamp of the newest of them

    @property
    def seconds(self) -> float:
        return (self.last_ms - self.first_ms) / 1000


def find_loss_window(url: str, run: str, run_dir, partitions: int = 1) -> LossWindow | None:
    """The logged events Redis lost, or None when the bus has everything the log has.

    A split stream's lanes share one log stream (consumers/archiver.py): the newest of its lanes
    on the bus marks where the log is ahead."""
    try:
        run_log = RunLog(run_dir, readonly=True)
    except LogError:
        return None  # nothing archived yet: nothing to compare
    client = (redis.RedisCluster if cluster_from_env() else redis.Redis).from_url(url, socket_timeout=10.0)
    events, streams, stamps = 0, [], []
    try:
        for stream in set(STREAMS) & set(run_log.names()):
            newest = [entry[0][0].decode() for lane in lanes([stream], partitions)
                      if (entry := client.xrevrange(lane_key(run, lane), count=1))]
            on_bus = max(newest, key=lambda i: tuple(map(int, i.split("-")))) if newest else None
            lost = [r.entry_id for r in run_log.stream(stream).records(after_entry_id=on_bus)]
            if lost:
                events += len(lost)
                streams.append(stream)
                stamps += [int(lost[0].split("-")[0]), int(lost[-1].split("-")[0])]
    finally:
        client.close()
        run_log.close()
    if not events:
        return None
    return LossWindow(events, sorted(streams), min(stamps), max(stamps))


def describe(window: LossWindow) -> str:
    return (f"Redis lost writes the log had archived: {window.events} events of {', '.join(window.streams)} "
            f"({window.seconds:.1f} s of entries) are in the log but no longer on the bus; the run resumes from the "
            f"log, and events of that window that were not archived yet are gone (their groups are sampled again)")
