"""One role process of a run: started with its own log file, polled, stopped within a bound."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path


LOG_TAIL_LINES = 25


def beside_python(name: str) -> str:
    """An executable of this environment (the venv's reel, torchrun, vllm), else whatever PATH has."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name) or name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RoleProcess:
    """One role running as a child process (its own process group), its output in roles/<name>.log."""

    def __init__(self, name: str, argv: list[str], log_path: Path, threads: int, env: dict[str, str] | None = None):
        self.name = name
        self.log_path = log_path
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
               "REEL_TORCH_THREADS": str(threads), "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(log_path, "ab") as log:
            self.popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True)
        log_path.with_suffix(".pid").write_text(str(self.popen.pid))  # for operators (and tests)

    def poll(self) -> int | None:
        return self.popen.poll()

    def terminate(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        try:
            code = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        # The role's children (vLLM's engine processes) go with it, even when it did not wait for them.
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return self.popen.wait() if code is None else code

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""
