"""The mismatch role runs at CPU priority mismatch.nice (default 19, the lowest), so it never takes a core from training."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import redis

from rollout_setup import make_run


def _autogroup_nice(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/autogroup") as f:
            return int(f.read().split()[-1])  # "/autogroup-N nice K"
    except FileNotFoundError:  # a kernel without autogroups
        return None


def _nice(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])  # field 19: nice


def test_the_role_lowers_its_priority_to_mismatch_nice(redis_url: str, run_name: str, tmp_path) -> None:
    expected = 7
    run_dir = make_run(tmp_path, run_name, async_level=1, env=f"[mismatch]\nnice = {expected}\n")
    bus = redis.Redis.from_url(redis_url)
    clients = len(bus.client_list())
    role = subprocess.Popen([sys.executable, "-m", "reel.runtime.launch.cli", "role", "mismatch", "--run", str(run_dir)],
                            env={**os.environ, "REEL_BUS_URL": redis_url}, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # as `reel run` starts a role
    try:
        before = _nice(os.getpid())
        deadline = time.monotonic() + 30
        while _nice(role.pid) == before:  # it lowers its own priority once its config is read
            assert role.poll() is None, f"the role exited early: {role.stderr.read()}"
            assert time.monotonic() < deadline, "the role's priority never changed"
            time.sleep(0.05)
        assert _nice(role.pid) == min(19, before + expected)
        # Its session's autogroup too: between sessions the scheduler shares a core by the autogroup's nice alone.
        assert _autogroup_nice(role.pid) in (expected, None)
        while len(bus.client_list()) == clients:  # following the (empty) run: its stop signal is handled
            assert role.poll() is None, f"the role exited early: {role.stderr.read()}"
            assert time.monotonic() < deadline, "the role never connected to the bus"
            time.sleep(0.05)
    finally:
        bus.close()
        role.send_signal(signal.SIGTERM)
        assert role.wait(30) == 0
