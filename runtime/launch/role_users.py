"""One Redis user per role: each may XADD only to the streams its role produces.

bus/trust.py refuses an entry whose producer's role may not publish its type, but a producer id is
just a field: a process holding the run's one Redis user can still write any stream (squat a
worker's next seq, flood `steps`). With per-role users Redis itself refuses: a rollout worker's
user gets NOPERM on XADD to `weights` and `steps`, the trainer's on `trajectories`.

Each role user has, as its root permissions, the read-only commands on the run's keys (XREAD,
XRANGE, the seq marks, XINFO, ...) and, as Redis 7 ACL selectors:
    (~<its streams' keys> +xadd)           the streams its role produces (PRODUCERS + STREAM_OF)
    (~<seq and dead keys> +zadd / +xadd)   its seq marks; the dead letters, for roles that file them
    (~<consumed keys> +xreadgroup +xack ...) the streams it reads in a consumer group
A command is allowed when the root or one selector allows it with all its keys, so XADD and XACK on
one key can differ, which Redis 6.2's ACLs cannot express.

The launcher makes them when it may (`make`): its own user must be allowed ACL SETUSER (the Slurm
job's own Redis: the job's password; an external Redis: an admin-made launcher user) and the server
must be Redis >= 7. Otherwise every role uses the launcher's user and `make` says why in one line.
Passwords are fresh per launch; `drop` deletes the users when the run stops. On a Redis Cluster the
users are made on every node (ACLs are per node).
"""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple
from urllib.parse import quote, unquote, urlsplit

import redis
import redis.cluster

from reel.bus.events import STREAM_OF, STREAMS, stream_key
from reel.bus.partitions import PARTITIONED
from reel.bus.streams import DEAD
from reel.bus.trust import PRODUCERS, SEQ_MARKS
from reel.runtime.launch.bus_access import key_patterns, read_commands

__all__ = ["ROLES", "RoleUsers", "role_setuser", "make", "drop", "for_run", "url_file", "write_url_files", "MIN_VERSION"]

MIN_VERSION = (7, 0)  # ACL selectors
# The roles `reel role NAME` starts that get their own user (the sink only reads).
ROLES = ("trainer", "rollout", "archiver", "eval", "sink", "mismatch")
# What each role reads in a consumer group (consumers/trainer.py, consumers/archiver.py) and
# which roles file dead letters (GroupConsumer; Publisher.dead_letter of a refused group).
GROUP_READS: dict[str, tuple[str, ...]] = {"trainer": ("trajectories", "routing"), "archiver": STREAMS}
DEAD_LETTERS = frozenset({"trainer", "archiver", "rollout"})
# The archiver trims what every group has acknowledged (bus/streams.py safe_trim, a Lua script).
TRIMS = frozenset({"archiver"})


class RoleUsers(NamedTuple):
    urls: dict[str, str]  # role -> its bus URL (empty: every role uses the launcher's)
    note: str  # why there are none, for the launcher's log; "" when made


def produced(role: str) -> list[str]:
    """The streams `role` publishes to (bus/trust.py PRODUCERS, bus/events.py STREAM_OF)."""
    return sorted({STREAM_OF[kind] for kind, roles in PRODUCERS.items() if role in roles})


def _keys(run: str, stream: str, *, every_slot: bool = False) -> list[str]:
    """Key patterns of `stream`: its run-slot key, and every partition's when it is split."""
    own = stream_key(run, stream)
    return [own, f"reel:{{{run}:[0-9]*}}:{stream}"] if every_slot or stream in PARTITIONED else [own]


def role_setuser(run: str, user: str, role: str) -> list[str]:
    """Arguments of ACL SETUSER for `role`'s user of `run` (add >PASSWORD)."""
    def selector(keys: list[str], commands: list[str]) -> str:
        return "(" + " ".join([*(f"~{k}" for k in keys), *(f"+{c}" for c in commands)]) + ")"

    args = [user, "reset", "on", "resetchannels", "-@all", *(f"~{k}" for k in key_patterns(run)),
            *(f"+{c}" for c in read_commands())]
    streams = produced(role)
    if streams:
        args += [selector([k for s in streams for k in _keys(run, s)], ["xadd"]),
                 selector(_keys(run, SEQ_MARKS, every_slot=True), ["zadd"])]
    if role in DEAD_LETTERS:
        args.append(selector(_keys(run, DEAD, every_slot=True), ["xadd"]))
    if role in GROUP_READS:
        trim = ["eval", "xtrim"] if role in TRIMS else []
        args.append(selector([k for s in GROUP_READS[role] for k in _keys(run, s)],
                             ["xgroup|create", "xreadgroup", "xack", "xautoclaim", *trim]))
    return args


def user_name(run: str, role: str) -> str:
    return f"reel.{run}.{role}"


def make(url: str, run: str, *, cluster: bool = False) -> RoleUsers:
    """Make (or remake, with new passwords) the run's role users through the launcher's `url`."""
    try:
        with _client(url, cluster) as client:
            version = _version(client)
            if version < MIN_VERSION:
                return RoleUsers({}, f"Redis {'.'.join(map(str, version))} has no ACL selectors (Redis >= 7 has): "
                                     f"every role uses the launcher's Redis user")
            urls = {}
            for role in ROLES:
                password = secrets.token_hex(32)
                _everywhere(client, "ACL", "SETUSER", *role_setuser(run, user_name(run, role), role),
                            f">{password}")
                urls[role] = _with_user(url, user_name(run, role), password)
            return RoleUsers(urls, "")
    except redis.exceptions.NoPermissionError:
        return RoleUsers({}, f"the bus user {_user(url)!r} may not make users (INFO, ACL SETUSER): every role uses it")


def drop(url: str, run: str, *, cluster: bool = False) -> None:
    """Delete the run's role users (a stopped run's passwords then open nothing)."""
    try:
        with _client(url, cluster) as client:
            _everywhere(client, "ACL", "DELUSER", *(user_name(run, role) for role in ROLES))
    except redis.RedisError as exc:
        print(f"reel: could not delete the run's Redis role users: {exc}", file=sys.stderr)


@contextmanager
def for_run(url: str, run: str, *, cluster: bool = False) -> Iterator[dict[str, str]]:
    """The role users of a run the launcher holds `url` for: made now (or why not, on stderr),
    dropped when the run stops; yields role -> URL (empty: every role uses `url`)."""
    users = make(url, run, cluster=cluster)
    if users.note:
        print(f"reel: {users.note}", file=sys.stderr, flush=True)
    try:
        yield users.urls
    finally:
        if users.urls:
            drop(url, run, cluster=cluster)


def url_file(run_dir: Path, role: str) -> Path:
    """Where a Slurm job leaves `role`'s bus URL (mode 0600, removed when the job ends)."""
    return run_dir / f"bus_url.{role}"


def write_url_files(run_dir: Path, users: RoleUsers) -> None:
    """Each role's URL file; none left from an earlier job (its users' passwords are gone)."""
    for role in ROLES:
        url_file(run_dir, role).unlink(missing_ok=True)
    for role, url in users.urls.items():
        fd = os.open(url_file(run_dir, role), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            os.fchmod(fd, 0o600)
            f.write(url + "\n")


def _client(url: str, cluster: bool) -> redis.Redis | redis.cluster.RedisCluster:
    if cluster:
        return redis.cluster.RedisCluster.from_url(url, socket_timeout=5)
    return redis.Redis.from_url(url, socket_timeout=5)


def _nodes(client: redis.Redis | redis.cluster.RedisCluster) -> list[redis.Redis]:
    """The servers to ask: a cluster's every node (ACLs and versions are per node), else the one."""
    if isinstance(client, redis.cluster.RedisCluster):
        return [node.redis_connection for node in client.get_nodes()]
    return [client]


def _everywhere(client: redis.Redis | redis.cluster.RedisCluster, *command: str) -> None:
    for node in _nodes(client):
        node.execute_command(*command)


def _version(client: redis.Redis | redis.cluster.RedisCluster) -> tuple[int, ...]:
    """The oldest node's Redis version (major, minor)."""
    return min(_parse(node.info("server")["redis_version"]) for node in _nodes(client))


def _parse(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:2])


def _user(url: str) -> str:
    return unquote(urlsplit(url).username or "default")


def _with_user(url: str, user: str, password: str) -> str:
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=f"{quote(user, safe='')}:{quote(password, safe='')}@{host}").geturl()


def main(argv: list[str]) -> int:
    """`python -m reel.runtime.launch.role_users RUN_DIR` (a Slurm job, REEL_BUS_URL set): make the role
    users and write each role's URL to RUN_DIR/bus_url.ROLE (0600), or say why every role shares one."""
    from reel.runtime.config.run import load

    run_dir = Path(argv[0])
    config = load(run_dir / "config.toml")
    users = make(os.environ["REEL_BUS_URL"], config.run.name, cluster=config.bus.cluster)
    write_url_files(run_dir, users)
    print(f"reel: {users.note}" if users.note else
          f"reel: one Redis user per role ({', '.join(ROLES)}), URLs in {run_dir}/bus_url.ROLE (mode 0600)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
