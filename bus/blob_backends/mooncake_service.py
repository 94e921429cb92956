"""The Mooncake processes a run needs: the master (with its HTTP metadata server) and a holder.

Mooncake keeps an object in the memory segment of the client that mounted it: a writer's close()
deletes its objects and a crashed writer's objects vanish after the client TTL (~10 s). So no role
mounts memory (they are pure clients, global segment 0) and one long-lived holder,
`mooncake_client --global_segment_size=...`, owns the segment every blob lands in: blobs outlive
the trainer that wrote them. The launcher (and the Slurm job, on the control node) starts both
for a run; `blobs.mooncake_master` names a master already running instead.

Files in root: master.log, holder.log.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from reel.bus.blob_backends.mooncake import MooncakeAddress, MooncakeBlobs
from reel.bus.blobs import BlobError

__all__ = ["MooncakeService", "mooncake_binary"]

START_TIMEOUT_S = 30.0


def mooncake_binary(name: str) -> str:
    """`mooncake_master` / `mooncake_client`: on PATH, else beside this Python (a venv's bin/)."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        raise BlobError(f"{name} is not installed: pip install 'reel-rl[mooncake]' "
                        "(and, on Debian, apt-get install libibverbs1)")
    return found


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class MooncakeService:
    """start() -> MooncakeAddress: a master and a holder of `segment_bytes`; stop() ends both."""

    def __init__(self, root: Path, *, segment_bytes: int, host: str = "127.0.0.1", protocol: str = "tcp",
                 device: str = ""):
        self.root = Path(root)
        self.segment_bytes = segment_bytes
        self.host = host
        self.protocol = protocol
        self.device = device
        self.address: MooncakeAddress | None = None  # set by start()
        self._master: subprocess.Popen | None = None
        self._holder: subprocess.Popen | None = None

    def __enter__(self) -> MooncakeService:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> MooncakeAddress:
        self.root.mkdir(parents=True, exist_ok=True)
        rpc, http, metrics = (_free_port(self.host) for _ in range(3))
        self.address = MooncakeAddress(f"{self.host}:{rpc}", f"http://{self.host}:{http}/metadata")
        try:
            self._master = self._spawn("master.log", [
                mooncake_binary("mooncake_master"), f"--rpc_address={self.host}", f"--rpc_port={rpc}",
                "--enable_http_metadata_server=true", f"--http_metadata_server_host={self.host}",
                f"--http_metadata_server_port={http}", f"--metrics_host={self.host}", f"--metrics_port={metrics}"])
            self._wait_port(rpc, self._master, "master.log")
            self._wait_port(http, self._master, "master.log")
            self.start_holder()
        except BaseException:
            self.stop()
            raise
        return self.address

    def start_holder(self) -> None:
        """(Re)start the holder; returns once it has mounted its segment (a probe put succeeds)."""
        assert self.address is not None, "start() first"
        self._holder = self._spawn("holder.log", [
            mooncake_binary("mooncake_client"), f"--global_segment_size={self.segment_bytes}",
            "--local_buffer_size=0", f"--master_server_address={self.address.master}",
            f"--metadata_server={self.address.metadata}", f"--host={self.host}", f"--port={_free_port(self.host)}",
            f"--http_port={_free_port(self.host)}", f"--protocol={self.protocol}",
            *([f"--device_names={self.device}"] if self.device else [])])
        # the probe is a client like any role
        probe = MooncakeBlobs(self.address, protocol=self.protocol, device=self.device, retry_s=0.0)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not probe.writable():
                if self._holder.poll() is not None or time.monotonic() > deadline:
                    raise BlobError(f"the Mooncake holder did not mount its segment: see {self.root / 'holder.log'}")
                time.sleep(0.2)
        finally:
            probe.close()

    def stop_holder(self) -> None:
        """Kill the holder (its segment, and every blob in it, goes with it)."""
        holder, self._holder = self._holder, None
        _end(holder, kill=True)

    def stop(self) -> None:
        self.stop_holder()
        master, self._master = self._master, None
        _end(master, kill=False)

    def _spawn(self, log: str, argv: list[str]) -> subprocess.Popen:
        with open(self.root / log, "ab") as out:
            # Own session: a Ctrl-C meant for the roles must not take the store down under them.
            return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def _wait_port(self, port: int, proc: subprocess.Popen, log: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                with socket.create_connection((self.host, port), timeout=0.5):
                    return
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise BlobError(f"the Mooncake master did not listen on {self.host}:{port}: "
                                    f"see {self.root / log}") from None
                time.sleep(0.05)


def _end(proc: subprocess.Popen | None, *, kill: bool) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.kill() if kill else proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
