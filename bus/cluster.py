"""Redis Cluster: the client `connect` returns when `bus.cluster = true` (or REEL_BUS_CLUSTER=1),
and reads over streams that live in different slots.

A cluster refuses a command whose keys span slots (CROSSSLOT), so a reader of several partitions
cannot block on all of them in one XREADGROUP. `SlotReader` asks every slot group without
blocking, concurrently (each goes to its own master), and, when none has anything, blocks on one
group at a time for a short slice, turning to the next group each time: an entry waits at most
one slice, and a quiet run costs one cheap blocking call per slice. On a plain Redis every key
goes in one command, as before.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable

import redis.asyncio
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry

__all__ = ["CLUSTER_ENV", "cluster_from_env", "cluster_client", "hash_tag", "SlotReader"]

CLUSTER_ENV = "REEL_BUS_CLUSTER"  # "1": bus.url names a node of a Redis Cluster
SLICE_MS = 50  # the longest one blocking call waits on one slot group while others may fill

Reply = list  # an XREAD/XREADGROUP reply: [(key, [(entry id, fields), ...]), ...]
Read = Callable[[dict[str, str], "int | None"], Awaitable[Reply | None]]  # (key -> cursor, block ms)


def cluster_from_env() -> bool:
    return os.environ.get(CLUSTER_ENV, "") not in ("", "0")


def cluster_client(url: str, *, socket_timeout: float | None, retry: Retry) -> RedisCluster:
    """A cluster client that follows MOVED/ASK; `url` names any node."""
    return RedisCluster.from_url(url, socket_timeout=socket_timeout, socket_connect_timeout=5.0, retry=retry)


def is_cluster(client: redis.asyncio.Redis | RedisCluster) -> bool:
    return isinstance(client, RedisCluster)


def hash_tag(key: str) -> str:
    """The part of a key Redis Cluster hashes: the first {...} with something inside, else all of it."""
    start = key.find("{")
    end = key.find("}", start + 1) if start >= 0 else -1
    return key[start + 1:end] if start >= 0 and end > start + 1 else key


class SlotReader:
    """XREAD/XREADGROUP over keys of any slots; `read` is the command on one slot group."""

    def __init__(self, cluster: bool):
        self.cluster = cluster
        self._turn = 0  # which slot group the next blocking slice waits on

    async def read(self, read: Read, ids: dict[str, str], block_ms: int | None) -> Reply:
        groups = self._groups(ids)
        if len(groups) == 1:
            return await read(ids, block_ms) or []
        replies = await asyncio.gather(*(read(group, None) for group in groups))
        got = [item for reply in replies for item in reply or () if item[1]]
        if got or not block_ms:
            return got
        group = groups[self._turn % len(groups)]
        self._turn += 1
        return await read(group, min(block_ms, SLICE_MS)) or []

    def _groups(self, ids: dict[str, str]) -> list[dict[str, str]]:
        if not self.cluster:
            return [ids]
        groups: dict[str, dict[str, str]] = {}
        for key, cursor in ids.items():
            groups.setdefault(hash_tag(key), {})[key] = cursor
        return list(groups.values())
