"""runtime/launch/bus_probe.py against a real redis-server: running, paused (SIGSTOP) and killed."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from reel.bus.server import EmbeddedRedis
from reel.runtime.launch.bus_probe import refuses
from reel.runtime.launch.role_process import free_port


def test_a_paused_redis_is_not_gone_and_a_killed_one_is(tmp_path: Path):
    port = free_port()
    server = EmbeddedRedis(tmp_path, port=port)
    url = server.start()
    try:
        assert server.tcp_url is not None
        assert not refuses(url) and not refuses(server.tcp_url)
        pid = int((tmp_path / "redis" / "redis.pid").read_text())
        os.kill(pid, signal.SIGSTOP)  # a pause: ridden out, not a death
        try:
            started = time.monotonic()
            assert not refuses(url) and not refuses(server.tcp_url)
            assert time.monotonic() - started < 2.0
        finally:
            os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not refuses(url):  # once the process is gone
            assert time.monotonic() < deadline, "a killed Redis still accepts connections"
            time.sleep(0.05)
        assert refuses(server.tcp_url)
    finally:
        server.stop()
    assert refuses(f"unix://{tmp_path}/nothing.sock")
