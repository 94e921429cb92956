"""The one boundary between Reel and Redis: clients, redis-py errors turned into BusError, and a
short pause of the server ridden out.

    ReelError
     └── BusError    a Redis command failed; the message names the server and the stream

Retries: `connect` turns off redis-py's automatic retries (10 in redis-py 8) because a retried
pipeline re-sends its XADDs after a lost reply, unseen. Reel retries at this boundary instead, where
it can say so: `ride_out` repeats a command while Redis does not answer (timeouts, refused or
dropped connections: a paused VM, a SIGSTOP, a long fork, a failover) for up to a bound,
bus.ride_out_s (60 s by default: a Kafka producer retries for two minutes), logs which command on
which stream waited and for how long, and past the bound raises BusError as before, which stops the
role and so the run, with the resume command. A retried write may land twice (the first attempt
sits in the paused server's socket buffer and runs when it wakes): the copies carry one
(producer, seq), and every reader keeps the first (GroupConsumer, the archiver's log), so nothing
is doubled. What must not be retried is the blocking `XREADGROUP >` (a lost reply has moved entries
into the reader's pending list; bus/group_consumer.py reads that list again instead). A blocking
reader has its own connection whose socket timeout exceeds BLOCK, so a quiet stream is not a timeout.

Roles take the bound from REEL_BUS_RIDE_OUT_S, which `reel role` sets from bus.ride_out_s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar
from urllib.parse import urlsplit

import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.exceptions import AuthenticationError, AuthorizationError, ConnectionError, RedisError, TimeoutError

from reel.bus.cluster import cluster_client, cluster_from_env, is_cluster
from reel.bus.errors import ReelError

__all__ = ["FIELD", "BusError", "connect", "boundary", "ride_out", "ride_out_bound", "no_answer", "where", "as_str",
           "by_stream", "RIDE_OUT_ENV", "DEFAULT_RIDE_OUT_S", "READ_MARGIN_S"]

log = logging.getLogger(__name__)
T = TypeVar("T")

FIELD = b"e"  # the one field of a stream entry: the encoded event
RIDE_OUT_ENV = "REEL_BUS_RIDE_OUT_S"  # seconds a role retries a Redis that does not answer
DEFAULT_RIDE_OUT_S = 60.0  # bus.ride_out_s's default
READ_MARGIN_S = 10.0  # a blocking reader's socket timeout = BLOCK + this
_FIRST_DELAY_S, _MAX_DELAY_S = 0.05, 2.0  # backoff between attempts while riding out a pause


class BusError(ReelError):
    """A Redis command failed; the message names the server and the stream or operation."""


def connect(url: str, *, socket_timeout: float | None = 5.0, retries: int = 0,
            cluster: bool | None = None) -> redis.asyncio.Redis:
    """A client for redis://, rediss:// (TLS), unix:// URLs, with user:password for ACLs.

    No retries by default: see the module docstring. Connecting is lazy; the first command that
    cannot reach the server raises BusError naming it. `cluster` (default: REEL_BUS_CLUSTER=1)
    gives redis-py's cluster client, which follows MOVED; `url` then names any node.
    """
    backoff = ExponentialWithJitterBackoff(base=0.05, cap=1.0) if retries else NoBackoff()
    try:
        if cluster_from_env() if cluster is None else cluster:
            return cluster_client(url, socket_timeout=socket_timeout, retry=Retry(backoff, retries))
        return redis.asyncio.from_url(url, socket_timeout=socket_timeout, socket_connect_timeout=5.0,
                                      retry=Retry(backoff, retries))
    except ValueError as exc:
        raise BusError(f"bad Redis URL {_redact(url)}: {exc}") from exc


def _redact(url: str) -> str:
    parts = urlsplit(url)
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()


def where(client: redis.asyncio.Redis) -> str:
    if is_cluster(client):
        return f"Redis Cluster via {', '.join(client.nodes_manager.startup_nodes)}"
    kwargs = client.connection_pool.connection_kwargs
    if "path" in kwargs:
        return f"Redis at unix:{kwargs['path']}"
    return f"Redis at {kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"


@contextlib.contextmanager
def boundary(client: redis.asyncio.Redis, what: str) -> Iterator[None]:
    """Turns redis-py and socket errors into BusError; cancellation passes through untouched."""
    try:
        yield
    except (RedisError, OSError) as exc:
        raise BusError(f"{where(client)}: {what} failed ({type(exc).__name__}: {exc})") from exc


def no_answer(exc: BaseException) -> bool:
    """Whether a BusError (or redis-py error) says Redis did not answer, as opposed to refusing the
    command: only the former may pass with time. A refused login does not."""
    cause = exc.__cause__ if isinstance(exc, BusError) else exc
    return (isinstance(cause, (ConnectionError, TimeoutError, OSError))
            and not isinstance(cause, (AuthenticationError, AuthorizationError)))


def ride_out_bound() -> float:
    """This process's bound on a Redis pause, in seconds (REEL_BUS_RIDE_OUT_S, else the default)."""
    text = os.environ.get(RIDE_OUT_ENV, "")
    return float(text) if text else DEFAULT_RIDE_OUT_S


async def ride_out(client: redis.asyncio.Redis, what: str, attempt: Callable[[], Awaitable[T]], *,
                   bound_s: float | None = None) -> T:
    """`await attempt()`, again with backoff while Redis does not answer, for up to `bound_s` seconds
    (default: ride_out_bound()); then BusError naming the server, `what` and the wait. `attempt` must
    build its command afresh each time (a pipeline that failed is emptied) and be safe to repeat
    (a write: readers dedupe it on (producer, seq)). A wait that ended well is logged as a warning."""
    bound_s = ride_out_bound() if bound_s is None else bound_s
    start = time.monotonic()
    delay, tries = _FIRST_DELAY_S, 0
    while True:
        try:
            with boundary(client, what):
                result = await attempt()
        except BusError as exc:
            waited = time.monotonic() - start
            if not no_answer(exc) or waited >= bound_s:
                if tries:
                    raise BusError(f"{exc}; no answer for {waited:.1f} s, longer than bus.ride_out_s = "
                                   f"{bound_s:g}") from exc.__cause__
                raise
            if tries == 0:
                log.warning("%s; retrying for up to %g s (bus.ride_out_s)", exc, bound_s)
            tries += 1
            await asyncio.sleep(min(delay, bound_s - waited))
            delay = min(2 * delay, _MAX_DELAY_S)
            continue
        if tries:
            log.warning("%s answered again: %s waited %.1f s (%d retries)", where(client),
                        what, time.monotonic() - start, tries)
        return result


def as_str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def by_stream(reply: list | None) -> Iterator[tuple[str, list]]:
    """(key, entries) from an XREAD/XREADGROUP reply (RESP2, the protocol `connect` speaks)."""
    for key, entries in reply or ():
        yield as_str(key), entries
