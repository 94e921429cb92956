"""Partitioned streams: `bus.partitions = P` splits trajectories and routing into P streams.

A *lane* is one Redis stream a reader follows: the stream's short name when it is not split
("control"; every stream when P = 1), else "<stream>/<p>" ("trajectories/2"). A partition has its
own hash tag, `reel:{<run>:<p>}:<stream>`, so a Redis Cluster spreads partitions over its masters,
while control, weights and steps stay on the run's slot (`reel:{<run>}:...`). A worker publishes to
one partition chosen from its index; the trainer and the archiver read every lane. With P = 1 the
keys are exactly stream_key's: a one-partition run is the unpartitioned one.

Keys that must be written atomically with an entry (the dead-letter stream, the producers' seq
marks) sit next to it in the same slot: `slot_key(key, name)`.
"""

from __future__ import annotations

from reel.bus.events import stream_key

__all__ = ["PARTITIONED", "worker_partition", "lanes", "lane_of", "stream_of", "lane_key", "slot_key",
           "seq_keys"]

PARTITIONED = ("trajectories", "routing")  # the streams bus.partitions splits


def worker_partition(worker: int, partitions: int) -> int | None:
    """The partition rollout worker `worker` publishes to (None when streams are not split)."""
    return worker % partitions if partitions > 1 else None


def lane_of(stream: str, partition: int | None) -> str:
    """The lane an event of `stream` goes to from a publisher writing to `partition`."""
    return f"{stream}/{partition}" if partition is not None and stream in PARTITIONED else stream


def lanes(streams: list[str] | tuple[str, ...], partitions: int) -> list[str]:
    """Every lane of `streams` (a split stream gives one lane per partition)."""
    out: list[str] = []
    for stream in streams:
        split = stream in PARTITIONED and partitions > 1
        out += [lane_of(stream, p) for p in range(partitions)] if split else [stream]
    return out


def stream_of(lane: str) -> str:
    """The event stream a lane belongs to (the log keeps one stream per event stream)."""
    return lane.partition("/")[0]


def lane_key(run: str, lane: str) -> str:
    stream, _, partition = lane.partition("/")
    return f"reel:{{{run}:{partition}}}:{stream}" if partition else stream_key(run, stream)


def slot_key(key: str, name: str) -> str:
    """The key `name` in the same cluster slot as `key` (run names cannot contain ':')."""
    return f"{key.rpartition(':')[0]}:{name}"


def seq_keys(run: str, name: str, partitions: int) -> list[str]:
    """Every slot's `name` key of a run: the run's own, then one per partition."""
    keys = [stream_key(run, name)]
    if partitions > 1:
        keys += [slot_key(lane_key(run, lane_of(PARTITIONED[0], p)), name) for p in range(partitions)]
    return keys
