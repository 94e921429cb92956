"""The Mooncake blob backend: blobs in a Mooncake store (`mooncake://<sha256>`), TCP here, RDMA on clusters.

Every role is a pure client (it mounts no memory; a holder process owns the segment, see
mooncake_service.py). The key is the blob's sha256, so a put is idempotent; it is an upsert because
Mooncake's `put` on an existing key answers 0 and keeps the old bytes. `get` answers b"" for a key
it cannot serve right now (a holder restarting, a segment whose client died and whose keys linger
for the client TTL): reads retry for `retry_s`, then fall back to `fallback`, the run directory's
file store, where the archiver copies every blob an event names (replay never needs a live store).
The base class checks size and sha256 of whatever `read` returns; `mapped` (weight shards, which
their loader verifies) reads straight into one writable buffer (`get_into`), so a shard is held once.
"""

from __future__ import annotations

import ctypes
import hashlib
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec

from reel.bus.blobs import BlobBackend, BlobError, BlobMissing, check_key
from reel.bus.events import BlobRef

__all__ = ["MooncakeAddress", "MooncakeBlobs", "SCHEME"]

SCHEME = "mooncake"
CLIENT_TTL_S = 15.0  # a bit over Mooncake's client TTL (~10 s): how long a read or write keeps trying
_PROBE = "reel-probe"


class MooncakeAddress(msgspec.Struct, frozen=True):
    """Where a Mooncake store answers."""

    master: str  # host:port of the master's RPC
    metadata: str  # http://host:port/metadata (the master's HTTP metadata server)


class MooncakeBlobs(BlobBackend):
    """A Mooncake store client; `fallback` (a run's file store) serves what the store no longer has."""

    def __init__(self, address: MooncakeAddress, *, fallback: BlobBackend | None = None, protocol: str = "tcp",
                 device: str = "", host: str = "127.0.0.1", buffer_bytes: int = 64 << 20,
                 retry_s: float = CLIENT_TTL_S):
        self.address = address
        self.fallback = fallback
        self.protocol = protocol
        self.device = device
        self.host = host  # this client's address as the store's other clients reach it
        self.buffer_bytes = buffer_bytes  # the client's local transfer buffer
        self.retry_s = retry_s
        self._store = None  # MooncakeDistributedStore, connected on first use
        self._lock = threading.Lock()  # roles call in from worker threads

    def put(self, data: bytes | Path) -> BlobRef:
        payload = data.read_bytes() if isinstance(data, Path) else bytes(data)
        sha = hashlib.sha256(payload).hexdigest()
        self._until_ok(lambda store: store.upsert(sha, payload) == 0, f"upsert of blob {sha} ({len(payload)} bytes)")
        return BlobRef(uri=f"{SCHEME}://{sha}", sha256=sha, nbytes=len(payload))

    def read(self, ref: BlobRef) -> bytes:
        if not ref.uri.startswith(f"{SCHEME}://"):
            return self._from_fallback(ref, f"it is not a {SCHEME}:// blob")
        got: list[bytes] = []

        def fetch(store) -> bool:
            data = store.get(ref.sha256)
            got[:] = [data]
            return len(data) > 0 or ref.nbytes == 0  # b"": not served now; other sizes: get() says corrupted

        try:
            self._until_ok(fetch, f"get of blob {ref.sha256}")
        except BlobError as exc:
            return self._from_fallback(ref, str(exc))
        return got[0]

    @contextmanager
    def mapped(self, ref: BlobRef) -> Iterator[memoryview]:
        """The stored bytes, unverified, in one writable buffer the store writes into (`get` returns
        bytes that a writable view would copy again: a 64 MiB shard held twice)."""
        check_key(ref.sha256)
        if not ref.uri.startswith(f"{SCHEME}://") or not ref.nbytes:
            yield memoryview(bytearray(self.read(ref)))
            return
        buffer = bytearray(ref.nbytes)
        got: list[int] = []
        try:
            self._until_ok(lambda store: _get_into(store, ref.sha256, buffer, got, register=self.protocol != "tcp"),
                           f"get of blob {ref.sha256}")
        except BlobError as exc:
            yield memoryview(bytearray(self._from_fallback(ref, str(exc))))
            return
        yield memoryview(buffer)[:got[0]]  # another size: its verifier says corrupted, as read's caller does

    def delete(self, ref: BlobRef) -> int:
        """Remove the blob from the store and from the run's copy (`fallback`); bytes freed in each."""
        check_key(ref.sha256)
        with self._lock:
            code = self._store_or_connect().remove(ref.sha256)
        # 0: removed; a negative code for a key the store does not hold (already gone) frees nothing.
        freed = ref.nbytes if code == 0 else 0
        return freed + (self.fallback.delete(ref) if self.fallback is not None else 0)

    def keys(self) -> dict[str, int]:
        """The run's copy (`fallback`): Mooncake lists no keys, and the archiver copies every blob an
        event names there, so it holds everything retention decides on."""
        return self.fallback.keys() if self.fallback is not None else {}

    def writable(self) -> bool:
        """Whether a put lands now (some client has mounted a segment)."""
        try:
            return self._store_or_connect().upsert(_PROBE, b"ok") == 0
        except BlobError:
            return False

    def close(self) -> None:
        with self._lock:
            store, self._store = self._store, None
        if store is not None:
            store.close()

    def _until_ok(self, attempt, what: str) -> None:
        """Call attempt(store) until it returns True, for up to retry_s; BlobError after that."""
        deadline = time.monotonic() + self.retry_s
        pause = 0.05
        while True:
            with self._lock:
                if attempt(self._store_or_connect()):
                    return
            if time.monotonic() >= deadline:
                raise BlobError(f"Mooncake store at {self.address.master}: {what} failed for {self.retry_s:.0f} s")
            time.sleep(pause)
            pause = min(pause * 2, 1.0)

    def _store_or_connect(self):
        if self._store is None:
            from mooncake.store import MooncakeDistributedStore  # the `mooncake` extra

            store = MooncakeDistributedStore()
            code = store.setup(self.host, self.address.metadata, 0, self.buffer_bytes, self.protocol, self.device,
                               self.address.master)
            if code != 0:
                raise BlobError(f"cannot connect to the Mooncake store at {self.address.master} "
                                f"(metadata {self.address.metadata}): setup returned {code}")
            self._store = store
        return self._store

    def _from_fallback(self, ref: BlobRef, why: str) -> bytes:
        if self.fallback is None:
            raise BlobMissing(f"blob {ref.sha256} ({ref.uri}) cannot be read: {why}")
        try:
            return self.fallback.read(ref)
        except BlobError as exc:
            kind = BlobMissing if isinstance(exc, BlobMissing) else BlobError
            raise kind(f"blob {ref.sha256} ({ref.uri}) cannot be read: {why}; {exc}") from exc


def _get_into(store, key: str, buffer: bytearray, got: list[int], *, register: bool) -> bool:
    """One `get_into` of `key` into `buffer`; False when the store cannot serve the key now (a negative
    code). A larger object than the buffer answers a negative code too: retried, then read from the
    fallback. `register`: RDMA transfers need the buffer registered; over TCP a registered buffer
    measured a second copy of the object in memory (117 MB of RSS for a 59 MB get, 59 MB without)."""
    address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    if register and store.register_buffer(address, len(buffer)) != 0:
        return False
    try:
        code = store.get_into(key, address, len(buffer))
    finally:
        if register:
            store.unregister_buffer(address)
    got[:] = [code]
    return code >= 0
