"""A run's blob store as its config says (`[blobs]`), and the Mooncake store `reel run` starts for it.

With blobs.backend = "mooncake" and no blobs.mooncake_master, the launcher starts a master and a
holder in run_dir/mooncake/ and writes their address to run_dir/mooncake.json (removed when the run
stops), the way it does the bus URL; roles started by hand or by Slurm find the store through
REEL_MOONCAKE_MASTER + REEL_MOONCAKE_METADATA, else that file.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec

from reel.bus.blob_backends import open_blobs
from reel.bus.blob_backends.mooncake import MooncakeAddress
from reel.bus.blob_backends.mooncake_service import MooncakeService
from reel.bus.blobs import BlobBackend, BlobError
from reel.runtime.config.sections import Config

__all__ = ["run_blobs", "mooncake_address", "mooncake_for", "MOONCAKE_FILE"]

MOONCAKE_FILE = "mooncake.json"


def run_blobs(run_dir: Path, config: Config) -> BlobBackend:
    """The blob store the roles of this run put and get through."""
    b = config.blobs
    address = mooncake_address(run_dir, config)
    if address is None:
        return open_blobs(run_dir)
    return open_blobs(run_dir, address, protocol=b.mooncake_protocol, device=b.mooncake_device,
                      buffer_bytes=b.mooncake_buffer_bytes)


def mooncake_address(run_dir: Path, config: Config) -> MooncakeAddress | None:
    b = config.blobs
    if b.backend != "mooncake":
        return None
    if b.mooncake_master:
        return MooncakeAddress(b.mooncake_master, b.mooncake_metadata)
    if os.environ.get("REEL_MOONCAKE_MASTER"):
        return MooncakeAddress(os.environ["REEL_MOONCAKE_MASTER"], os.environ.get("REEL_MOONCAKE_METADATA", ""))
    try:
        return msgspec.json.decode((Path(run_dir) / MOONCAKE_FILE).read_bytes(), type=MooncakeAddress)
    except FileNotFoundError:
        raise BlobError(f"no Mooncake store for {run_dir} (no {MOONCAKE_FILE}): set blobs.mooncake_master and "
                        "blobs.mooncake_metadata, or REEL_MOONCAKE_MASTER and REEL_MOONCAKE_METADATA") from None


@contextmanager
def mooncake_for(run_dir: Path, config: Config) -> Iterator[MooncakeAddress | None]:
    """The run's Mooncake store: started here (and finally stopped) unless one is configured."""
    b = config.blobs
    if b.backend != "mooncake" or b.mooncake_master:
        yield mooncake_address(run_dir, config)
        return
    where = Path(run_dir) / MOONCAKE_FILE
    with MooncakeService(Path(run_dir) / "mooncake", segment_bytes=b.mooncake_segment_bytes,
                         protocol=b.mooncake_protocol, device=b.mooncake_device) as service:
        where.write_bytes(msgspec.json.encode(service.address))
        try:
            yield service.address
        finally:
            where.unlink(missing_ok=True)
