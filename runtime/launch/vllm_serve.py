"""A `vllm serve` on this machine for one model directory: started, health-checked, stopped.

What benchmarks and tests use to talk to a real vLLM, with the command line and environment a run's
local server gets (runtime/launch/vllm_args.py); `reel run` itself supervises its server as a role
(runtime/launch/supervisor.py), so a server that dies stops the run.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from reel.bus.errors import ReelError
from reel.runtime.config.sections import Config
from reel.runtime.launch import vllm_args
from reel.runtime.launch.vllm_key import KEY_ENV

STARTUP_TIMEOUT_S = 900.0  # imports and model load: ~1 minute on an idle CPU machine, many on a busy one
STOP_TIMEOUT_S = 30.0
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the server is on this machine


class VLLMServeError(ReelError):
    """The local `vllm serve` did not come up."""


@contextmanager
def local_vllm(config: Config, model_dir: Path, log_path: Path, blobs_dir: Path, *,
               startup_timeout_s: float = STARTUP_TIMEOUT_S) -> Iterator[str]:
    """The URL of a healthy `vllm serve` on `model_dir` (its output in `log_path`), stopped on exit.
    It loads weights only from `blobs_dir` and requires this process's VLLM_API_KEY (made here when
    unset), which the HTTP engine in this process sends."""
    from reel.runtime.launch.role_process import free_port

    port = free_port()
    key = os.environ.setdefault(KEY_ENV, secrets.token_urlsafe(32))
    # Under this interpreter: the server imports Reel's middleware and worker extension, which must be
    # the `reel` this process runs (another environment's `vllm` script could import another one).
    argv = [sys.executable, "-m", "vllm.entrypoints.cli.main",
            *vllm_args.local_serve_argv(config, "vllm", model_dir, port)[1:]]
    env = os.environ | vllm_args.local_serve_env(config, key, blobs_dir)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, log_path, startup_timeout_s)
        yield url
    finally:
        _stop(proc)


def _wait_healthy(proc: subprocess.Popen, url: str, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise VLLMServeError(f"vllm serve exited with code {proc.returncode} before it was healthy; "
                                 f"see {log_path}")
        try:
            with _NO_PROXY.open(url + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise VLLMServeError(f"vllm serve was not healthy after {timeout_s:.0f} s; see {log_path}")
        time.sleep(1.0)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (API server, engine core, workers), SIGKILL if it lingers."""
    for sig, wait_s in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:
            try:  # the group's stragglers
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return
