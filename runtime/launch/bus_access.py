"""How a run's processes reach an external Redis: ACL user, password, TLS files; never a leaked secret.

The password is never in the config (it would travel in RunStarted.config_toml into the log):
`bus.url` names the user (rediss://reel@host:6380/0), the password comes from REEL_BUS_PASSWORD
or `bus.password_file` (mode 0600). `bus_url` joins them, with the TLS files as redis-py query
arguments, into the URL the launcher hands its roles through the environment and the 0600
`bus_url` file, never through argv (which `ps` shows to every user).

An ACL user for one run is limited to that run's keys and the commands Reel sends:

    ACL SETUSER reel reset on >PASSWORD ~reel:{RUN}:* ~reel:{RUN:[0-9]*}:* resetchannels -@all +ping +multi ...

(`acl_setuser(run, user)` gives the arguments after SETUSER, without the password.)
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from urllib.parse import quote, urlencode, urlsplit

from reel.bus.events import stream_key
from reel.runtime.config.sections import Config
from reel.runtime.config.keys import ConfigError
from reel.runtime.config.run import load

__all__ = ["bus_url", "acl_setuser", "key_patterns", "read_commands", "REEL_COMMANDS", "WRITE_COMMANDS", "PASSWORD_ENV"]

PASSWORD_ENV = "REEL_BUS_PASSWORD"
# Every command Reel's clients send, those Lua scripts run (safe_trim) included: the seq marks
# (zadd, zscore, zmscore: bus/trust.py), the dead-letter count (xinfo|stream), and what redis-py's
# cluster client asks a node for its slots and command table (cluster|slots, command).
REEL_COMMANDS = ("ping", "multi", "exec", "discard", "eval", "exists", "zadd", "zscore", "zmscore", "xadd", "xack",
                 "xautoclaim", "xlen", "xpending", "xrange", "xrevrange", "xread", "xreadgroup", "xtrim",
                 "xgroup|create", "xinfo|groups", "xinfo|stream", "cluster|slots", "command")
# Those that change a key: a role user (runtime/launch/role_users.py) gets each only on its own keys.
WRITE_COMMANDS = ("eval", "zadd", "xadd", "xack", "xautoclaim", "xreadgroup", "xtrim", "xgroup|create")


def bus_url(config: Config) -> str:
    """bus.url with the password (REEL_BUS_PASSWORD, else bus.password_file) and the TLS files."""
    b = config.bus
    parts = urlsplit(b.url)
    password = os.environ.get(PASSWORD_ENV) or (_read_password_file(Path(b.password_file)) if b.password_file else "")
    netloc = parts.netloc
    if password:
        user, _, host = netloc.rpartition("@")
        netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"
    tls = {"ssl_ca_certs": b.tls_ca, "ssl_certfile": b.tls_cert, "ssl_keyfile": b.tls_key}
    query = "&".join(q for q in (parts.query, urlencode({k: v for k, v in tls.items() if v})) if q)
    return parts._replace(netloc=netloc, query=query).geturl()


def _read_password_file(path: Path) -> str:
    try:
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(f"bus.password_file {path} is readable by other users (mode {stat.filemode(mode)}); "
                              f"chmod 600 it")
        return path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"bus.password_file {path} cannot be read: {exc.strerror}") from exc


def acl_setuser(run: str, user: str) -> list[str]:
    """Arguments of ACL SETUSER for a user limited to `run`'s keys and Reel's commands (add >PASSWORD)."""
    return [user, "reset", "on", *(f"~{pattern}" for pattern in key_patterns(run)), "resetchannels", "-@all",
            *(f"+{command}" for command in REEL_COMMANDS)]


def read_commands() -> list[str]:
    """Reel's commands that change no key (a role user's root permissions)."""
    return [c for c in REEL_COMMANDS if c not in WRITE_COMMANDS]


def key_patterns(run: str) -> list[str]:
    """The run's keys: its own slot's (reel:{RUN}:...) and every partition's (reel:{RUN:P}:...,
    bus/partitions.py). Run names hold no glob characters and no ':' (runtime/config/run.py)."""
    return [stream_key(run, "*"), f"reel:{{{run}:[0-9]*}}:*"]


def main(argv: list[str]) -> int:
    """`python -m reel.runtime.launch.bus_access CONFIG`: the run's bus URL with its secrets on stdout,
    for a Slurm job to put in REEL_BUS_URL (a variable and a 0600 file, never a command line)."""
    try:
        print(bus_url(load(Path(argv[0]))))
    except ConfigError as exc:
        print(f"reel: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
