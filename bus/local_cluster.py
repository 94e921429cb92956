"""A local Redis Cluster of N masters on free ports: for `reel bench bus --partitions` and the tests.

Each master has its own directory under `root` (nodes.conf, redis.log, an append-only file with
appendfsync always, so a killed master restarts with everything it acknowledged); `redis-cli
--cluster create` assigns the slots. `kill(i)` / `start(i)` take one master down and bring it back
from its directory; `owner(key)` says which master serves a key. Needs redis-server and redis-cli
(Debian: redis-server, redis-tools).
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

from reel.bus.errors import ReelError

__all__ = ["LocalCluster"]

START_TIMEOUT_S = 20.0


def free_port() -> int:
    """A port whose cluster bus port (port + 10000) is free too; both below 65536."""
    while True:
        port = random.randrange(20000, 55000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue


class LocalCluster:
    """Context manager: the cluster is up (every slot served) inside the with block."""

    def __init__(self, root: Path, binary: str, masters: int = 3, *, appendfsync: str = "always"):
        self.root = root
        self.binary = binary
        self.appendfsync = appendfsync  # "always" (tests: a killed master loses nothing) or "everysec"
        self.ports = [free_port() for _ in range(masters)]
        self.procs: list[subprocess.Popen | None] = [None] * masters
        self.url = f"redis://127.0.0.1:{self.ports[0]}"

    def __enter__(self) -> LocalCluster:
        try:
            for i in range(len(self.ports)):
                self.start(i)
            cli = shutil.which("redis-cli")
            if cli is None:
                raise ReelError("redis-cli is not on PATH: install Redis's tools (Debian: apt-get install redis-tools)")
            nodes = [f"127.0.0.1:{port}" for port in self.ports]
            made = subprocess.run([cli, "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
                                  capture_output=True, text=True, timeout=60)
            if made.returncode:
                raise ReelError(f"redis-cli --cluster create failed: {made.stdout[-500:]}{made.stderr[-500:]}")
            self.wait_ok()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for i in range(len(self.ports)):
            self.kill(i)

    def start(self, i: int) -> None:
        """Start master i from its directory (a restart reloads nodes.conf and the append-only file)."""
        workdir = self.root / f"m{i}"
        workdir.mkdir(parents=True, exist_ok=True)
        self.procs[i] = subprocess.Popen(
            [self.binary, "--port", str(self.ports[i]), "--bind", "127.0.0.1", "--dir", str(workdir),
             "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000",
             "--appendonly", "yes", "--appendfsync", self.appendfsync, "--save", "", "--logfile", "redis.log"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                with self.node(i) as client:
                    client.ping()
                return
            except redis.BusyLoadingError:
                pass
            except (redis.ConnectionError, OSError):
                if self.procs[i].poll() is not None or time.monotonic() > deadline:
                    raise ReelError(f"cluster master {i} did not start: see {workdir / 'redis.log'}") from None
            time.sleep(0.05)

    def kill(self, i: int) -> None:
        proc, self.procs[i] = self.procs[i], None
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            proc.wait(timeout=10)

    def node(self, i: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.ports[i], socket_timeout=2.0)

    def wait_ok(self) -> None:
        """Until every master says cluster_state:ok (all slots served)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            states = []
            for i in range(len(self.ports)):
                try:
                    with self.node(i) as client:
                        states.append(client.cluster("info").get("cluster_state"))
                except (redis.RedisError, OSError):
                    states.append(None)
            if all(state == "ok" for state in states):
                return
            if time.monotonic() > deadline:
                raise ReelError(f"the local Redis Cluster did not become ok (cluster_state per master: {states})")
            time.sleep(0.1)

    def owner(self, key: str) -> int:
        """Which master serves `key` (by CLUSTER KEYSLOT and the masters' slot ranges)."""
        with self.node(0) as client:
            slot = client.cluster("keyslot", key)
            for start, end, master, *_ in client.execute_command("CLUSTER SLOTS"):
                if start <= slot <= end:
                    return self.ports.index(int(master[1]))
        raise ReelError(f"no master serves slot {slot} of {key}")
