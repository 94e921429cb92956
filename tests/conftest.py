"""Session fixtures: one real Redis server on a free port for the whole test session.

Under pytest-xdist (ops/test.sh runs `-n 2`) each worker is a session of its own, with its own Redis
server; the warm-start and kernel cache is shared by the workers of one run (warm-starts take tens
of seconds, and producers/warmstart.py lets one process compute a key while the others wait)."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _redis_binary() -> str:
    """Debian's redis-server (ops/install_test.sh installs it; tests/test_packaging.py checks it is Redis 7)."""
    from reel.bus.server import service_redis_server

    return service_redis_server()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory):
    """URL of a private redis-server started for this test session (redis://127.0.0.1:PORT/0)."""
    port = _free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [_redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            time.sleep(0.05)
    else:
        proc.kill()
        raise RuntimeError("test redis-server did not start")
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory):
    """A real three-master Redis Cluster (bus/local_cluster.py), created once per test session."""
    from reel.bus.local_cluster import LocalCluster

    with LocalCluster(tmp_path_factory.mktemp("cluster"), _redis_binary()) as cluster:
        yield cluster


@pytest.fixture
def run_name(request: pytest.FixtureRequest) -> str:
    """A run name unique to the test, so tests sharing the Redis server never see each other's streams."""
    digest = hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:10]
    return f"t{os.getpid()}-{request.node.name[:30]}-{digest}".replace("[", "-").replace("]", "")


WHOLE_RUNS = Path(__file__).parent / "runs"
# The single-host Slurm cluster's nodes and a vLLM server's cores are shared by the tests that use them.
SHARED_SERVICES = ("slurm", "vllm")


@pytest.hookimpl(tryfirst=True)  # before -m selects: the marker must be there when it looks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:  # whole runs are the slow tier, marked or not
        if WHOLE_RUNS in item.path.parents:
            item.add_marker(pytest.mark.slow)
        for shared in SHARED_SERVICES:  # one xdist worker takes all tests of a shared service, one at a time
            if shared in item.keywords:
                item.add_marker(pytest.mark.xdist_group(shared))
    # Longest first, so that under xdist the last minutes are short tests spread over the workers
    # rather than one whole run that started late: the shared services' chains of tests, then the
    # slow tier (sort is stable: otherwise the collected order).
    items.sort(key=lambda item: (not any(s in item.keywords for s in SHARED_SERVICES), "slow" not in item.keywords))
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if not has_gpu:
        deselected = [i for i in items if "gpu" in i.keywords]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = [i for i in items if "gpu" not in i.keywords]


@pytest.fixture(params=["C", "torch"])
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The test runs twice: on the C kernels (the KV-cache forward and the sampler; they must build
    here, CI has a compiler) and on the torch ops they replace (REEL_NATIVE=0)."""
    if request.param == "C":
        from reel.producers import sampling
        from reel.runtime import cbuild
        from reel.runtime.model import native

        for source in (native._SOURCE, sampling._SOURCE):
            assert cbuild.load(source) is not None, f"{source.name} did not build (see the log for the compiler's error)"
    else:
        monkeypatch.setenv("REEL_NATIVE", "0")
    return request.param


@pytest.fixture(scope="session", autouse=True)
def warm_start_cache(tmp_path_factory: pytest.TempPathFactory):
    """Warm-starts and compiled kernels are cached per test session (never in the user's ~/.cache)."""
    previous = os.environ.get("REEL_CACHE")
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the run's directory, above each worker's own
        cache = tmp_path_factory.getbasetemp().parent / "reel-cache"
        cache.mkdir(exist_ok=True)
    else:
        cache = tmp_path_factory.mktemp("reel-cache")
    os.environ["REEL_CACHE"] = str(cache)
    yield
    if previous is None:
        os.environ.pop("REEL_CACHE", None)
    else:
        os.environ["REEL_CACHE"] = previous
