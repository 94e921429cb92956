"""`reel bench bus`: Reel's delivery and archiving against raw redis-py, on one Redis or partitioned.

On one Redis: runtime/bench/common/bus_pipeline.py. With --partitions P: the same pipeline on a local
three-master Redis Cluster, with the trajectories in 1 and in P partitions.

Per partition count: events/s until the trainer-like consumer and the archiver (both in their own
processes, reading every partition) have acked the last event; P publishers, one per partition,
publish at once. Redis CPU per event = the masters' used_cpu_user + used_cpu_sys over the round
(INFO cpu), divided by the events. ratio = events/s with P partitions / with 1. One partition puts
every key on one master (one Redis thread does all the work); P spread them over the masters, so
the ratio measures what spreading buys on this machine (masters: AOF, fsync every second): on a shared 2-core host the masters, the
readers and the publishers compete for the same cores, so expect little there.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from reel.runtime.bench.common.bus_pipeline import bench_bus, reel_pipeline, trajectory
from reel.bus.cluster import CLUSTER_ENV
from reel.bus.errors import ReelError
from reel.bus.jsonout import print_json
from reel.bus.events import encode
from reel.bus.local_cluster import LocalCluster
from reel.bus.partitions import lane_key
from reel.bus.server import redis_server_binary

__all__ = ["bench_bus_partitions"]

MASTERS = 3


def run(args: argparse.Namespace) -> int:
    """On one Redis, or with --partitions P on a local cluster."""
    return bench_bus_partitions(args) if getattr(args, "partitions", 0) else bench_bus(args)


def bench_bus_partitions(args: argparse.Namespace) -> int:
    if args.partitions < 1:
        raise ReelError(f"--partitions {args.partitions} must be at least 1")
    n, rounds = (300, 1) if args.quick else (3000, 3)
    counts = sorted({1, args.partitions})
    event = trajectory()
    rates: dict[int, list[float]] = {p: [] for p in counts}
    cpu: dict[int, list[float]] = {p: [] for p in counts}
    previous = os.environ.get(CLUSTER_ENV)
    os.environ[CLUSTER_ENV] = "1"  # this process's clients and the reader children's
    try:
        masters_used = _measure(n, rounds, counts, event, rates, cpu)
    finally:
        if previous is None:
            del os.environ[CLUSTER_ENV]
        else:
            os.environ[CLUSTER_ENV] = previous
    best = {p: max(rates[p]) for p in counts}
    print_json({
        "bench": "bus", "partitions": args.partitions, "masters": MASTERS, "events": n,
        "event_bytes": len(encode(event)), "rounds": rounds,
        "cpus": os.cpu_count(),
        "events_per_s": {str(p): round(best[p]) for p in counts},
        "redis_cpu_us_per_event": {str(p): round(min(cpu[p]) * 1e6, 1) for p in counts},
        "masters_used": {str(p): masters_used[p] for p in counts},
        "ratio": round(best[counts[-1]] / best[1], 3),
    })
    return 0


def _measure(n: int, rounds: int, counts: list[int], event, rates: dict[int, list[float]],
             cpu: dict[int, list[float]]) -> dict[int, int]:
    """Fill rates and cpu per partition count; returns how many masters each count used."""
    with tempfile.TemporaryDirectory(prefix="reel-bench-cluster-") as tmp, \
            LocalCluster(Path(tmp) / "cluster", redis_server_binary(), masters=MASTERS,
                         appendfsync="everysec") as cluster:  # as the embedded Redis of `reel bench bus`
        for r in range(rounds):
            for p in counts:
                before = _redis_cpu_s(cluster)
                done, _ = reel_pipeline(cluster.url, Path(tmp) / f"run{r}-{p}", f"bench{r}-{p}", event, n, p)
                rates[p].append(done)
                cpu[p].append((_redis_cpu_s(cluster) - before) / n)
        return {p: len({cluster.owner(lane_key(f"bench0-{p}", f"trajectories/{i}" if p > 1 else "trajectories"))
                        for i in range(p)}) for p in counts}


def _redis_cpu_s(cluster: LocalCluster) -> float:
    total = 0.0
    for i in range(len(cluster.ports)):
        with cluster.node(i) as client:
            info = client.info("cpu")
        total += float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    return total
