"""One real `vllm serve` for the session, shared by the vLLM tests here (they run on one xdist worker,
tests/conftest.py): each start costs about a minute of the suite."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from reel.bus.blob_backends.file import BlobStore
from reel.runtime.config import run as config_mod
from reel.runtime.launch.vllm_serve import local_vllm
from reel.runtime.model.weights import save
from vllm_setup import RUN, Models, http_engine, tiny_model


class Served(msgspec.Struct, frozen=True):
    url: str
    version_at_start: int  # what the server said before any test pushed weights (-1: vLLM's "default")


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    """(directory vLLM starts from, its model, another model with the same shape)."""
    directory = tmp_path_factory.mktemp("vllm-model")
    first = tiny_model(0)
    save(first, directory)
    return directory, first, tiny_model(1)


@pytest.fixture(scope="session")
def server_blobs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The blob store the server loads weights from (the only one it accepts)."""
    return tmp_path_factory.mktemp("vllm-blobs")


@pytest.fixture(scope="session")
def served(models: Models, server_blobs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A real `vllm serve` on the tiny model, with the command line `reel run` gives its server."""
    import importlib.util

    assert importlib.util.find_spec("vllm") is not None, "vLLM is not installed: run `bash ops/install_vllm.sh`"
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    with local_vllm(config_mod.loads(RUN), models[0], log, server_blobs) as url:
        yield Served(url, asyncio.run(_version(models, url, BlobStore(server_blobs))))


@pytest.fixture
def server(served: Served) -> str:
    """The shared server's URL: it serves whatever version the last test pushed."""
    return served.url


async def _version(models: Models, url: str, blobs: BlobStore) -> int:
    async with http_engine(models, url, blobs) as engine:
        return await engine._server_version(url)
