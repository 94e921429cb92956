"""bus/blobs.py: content addressing, hash verification, key validation, atomic put."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reel.bus.blob_backends.file import BlobStore
from reel.bus.blobs import BlobError
from reel.bus.events import BlobRef


def test_put_get_bytes_and_path(tmp_path: Path):
    store = BlobStore(tmp_path / "blobs")
    data = os.urandom(100_000)
    ref = store.put(data)
    sha = hashlib.sha256(data).hexdigest()
    assert ref == BlobRef(uri=(tmp_path / "blobs" / sha[:2] / sha).as_uri(), sha256=sha, nbytes=len(data))
    assert store.get(ref) == data and store.path(ref).read_bytes() == data
    src = tmp_path / "weights.safetensors"
    src.write_bytes(data)
    assert store.put(src) == ref  # same content, same claim check; put is idempotent
    assert store.put(b"").nbytes == 0 and store.get(store.put(b"")) == b""


def test_hash_or_size_mismatch_is_rejected(tmp_path: Path):
    store = BlobStore(tmp_path / "blobs")
    ref = store.put(b"weights v1")
    store.path(ref).write_bytes(b"weights v2")
    with pytest.raises(BlobError, match=f"blob {ref.sha256} .* is corrupted"):
        store.get(ref)
    store.path(ref).write_bytes(b"short")
    with pytest.raises(BlobError, match="has 5 bytes"):
        store.get(ref)
    lie = BlobRef(uri=ref.uri, sha256=hashlib.sha256(b"other").hexdigest(), nbytes=5)
    with pytest.raises(BlobError, match="not found"):
        store.get(lie)


@pytest.mark.parametrize("key", ["../x", "../" + "a" * 61, "/etc/passwd", "A" * 64, "a" * 63, "a" * 65, ""])
def test_keys_that_are_not_sha256_are_rejected(tmp_path: Path, key: str):
    store = BlobStore(tmp_path / "blobs")
    ref = BlobRef(uri="file:///etc/passwd", sha256=key, nbytes=1)
    with pytest.raises(BlobError, match="not a sha256"):
        store.get(ref)
    with pytest.raises(BlobError, match="not a sha256"):
        store.path(ref)


def test_a_blob_is_read_from_this_store_only(tmp_path: Path):
    other = BlobStore(tmp_path / "other-run" / "blobs")
    ref = other.put(b"init weights")
    store = BlobStore(tmp_path / "blobs")
    # A copied run never silently reads the original run's file through the ref's absolute path.
    with pytest.raises(BlobError, match=f"not found in {store.root}; its reference names {ref.uri}"):
        store.get(ref)
    in_mooncake = BlobRef(uri=f"mooncake://{ref.sha256}", sha256=ref.sha256, nbytes=ref.nbytes)
    with pytest.raises(BlobError, match="not found"):  # a file store never reaches into another store
        store.get(in_mooncake)
    # a moved run dir: the uri is stale but the hash finds it in this store
    shutil.copytree(tmp_path / "other-run" / "blobs", tmp_path / "blobs", dirs_exist_ok=True)
    shutil.rmtree(tmp_path / "other-run")
    assert store.get(ref) == b"init weights"
    assert store.get(in_mooncake) == b"init weights"  # the archiver's copy of a Mooncake blob


def _replace_blob(store: BlobStore, ref: BlobRef, make) -> None:
    path = store.path(ref)
    path.unlink()
    make(path)


@pytest.mark.parametrize("kind, message", [
    ("symlink to a file", "a symbolic link"), ("symlink to /dev/zero", "a symbolic link"),
    ("fifo", "not a regular file"), ("symlinked shard directory", "is a symbolic link"),
])
def test_a_blob_that_is_not_a_regular_file_is_refused_without_reading_it(tmp_path: Path, kind: str,
                                                                         message: str) -> None:
    store = BlobStore(tmp_path / "blobs")
    secret = tmp_path / "secret"
    secret.write_bytes(b"private key")
    ref = store.put(b"private key")
    if kind == "symlink to a file":
        _replace_blob(store, ref, lambda p: p.symlink_to(secret))
    elif kind == "symlink to /dev/zero":
        _replace_blob(store, ref, lambda p: p.symlink_to("/dev/zero"))
    elif kind == "fifo":
        _replace_blob(store, ref, os.mkfifo)  # a plain open() would wait for a writer forever
    else:
        shard = store.path(ref).parent
        shutil.move(shard, tmp_path / "shard")
        shard.symlink_to(tmp_path / "shard")
    with pytest.raises(BlobError, match=message):
        store.get(ref)


def test_a_read_is_bounded_by_the_size_the_reference_names(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    ref = store.put(b"small")
    with open(store.path(ref), "ab") as f:
        f.truncate(1 << 40)  # a sparse terabyte: reading it whole would exhaust memory
    with pytest.raises(BlobError, match="has 6 bytes, its reference says 5"):
        store.get(ref)


_PUT_CHILD = """
import hashlib, sys
from pathlib import Path
from reel.bus.blob_backends.file import BlobStore
data = bytes(128 << 20)
print(hashlib.sha256(data).hexdigest(), flush=True)
BlobStore(Path(sys.argv[1])).put(data)
"""


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.2])
def test_put_is_atomic_under_sigkill(tmp_path: Path, delay: float):
    root = tmp_path / "blobs"
    proc = subprocess.Popen([sys.executable, "-c", _PUT_CHILD, str(root)], stdout=subprocess.PIPE, text=True)
    sha = proc.stdout.readline().strip()
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    final = root / sha[:2] / sha
    # never a partial blob under its name: absent (a temp file may be left) or complete
    assert not final.exists() or final.stat().st_size == 128 << 20
    ref = BlobStore(root).put(bytes(128 << 20))
    assert ref.sha256 == sha and BlobStore(root).get(ref) == bytes(128 << 20)


def test_failed_put_leaves_nothing_and_wrong_size_files_are_replaced(tmp_path: Path):
    store = BlobStore(tmp_path / "blobs")
    with pytest.raises(BlobError, match="cannot write a blob"):
        store.put(tmp_path / "does-not-exist")
    assert not list((tmp_path / "blobs").rglob("*"))
    data = b"x" * 1000
    ref = store.put(data)
    store.path(ref).write_bytes(b"x" * 10)  # e.g. copied in by a foreign tool: not trusted
    assert store.put(data) == ref and store.get(ref) == data
