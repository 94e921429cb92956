"""The filesystem blob backend: `file://` blobs under a directory (a run's blobs/, local or shared).

Layout: root/<sha[:2]>/<sha>. A put writes a temp file in root, fsyncs it, renames it into place and
fsyncs the directory, so a blob is either absent or complete.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import stat
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import unquote, urlparse

from reel.bus.blobs import BlobBackend, BlobError, BlobMissing, check_key
from reel.bus.errors import printable
from reel.bus.events import BlobRef
from reel.bus.logformat import fsync_dir

__all__ = ["BlobStore"]

_CHUNK = 8 << 20


class BlobStore(BlobBackend):
    """Blobs as files under `root` (run_dir/"blobs"), addressed by sha256."""

    def __init__(self, root: Path):
        self.root = Path(root).absolute()

    def path(self, ref: BlobRef) -> Path:
        """Where the blob lives (or would live) in this store."""
        sha = check_key(ref.sha256)
        return self.root / sha[:2] / sha

    def put(self, data: bytes | Path) -> BlobRef:
        return self.put_parts(_chunks(data) if isinstance(data, Path) else [data])

    def put_parts(self, parts: Iterable[bytes | memoryview]) -> BlobRef:
        """Hashes each part as it writes it: one pass over the bytes, never joined in memory."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".put-")
            os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide blobs from other users of a shared store
            try:
                with os.fdopen(fd, "wb") as f:
                    digest, nbytes = _copy(parts, f)
                    f.flush()
                    os.fsync(f.fileno())
                ref = BlobRef(uri="", sha256=digest, nbytes=nbytes)
                final = self.path(ref)
                if not final.is_symlink() and final.is_file() and final.stat().st_size == nbytes:
                    os.unlink(tmp)  # already stored: content addressing makes put idempotent
                else:
                    self._make_dir(final.parent)
                    os.replace(tmp, final)
                    fsync_dir(final.parent)
            except BaseException:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise
        except OSError as exc:
            raise BlobError(f"cannot write a blob to {self.root}: {exc}") from exc
        return BlobRef(uri=final.as_uri(), sha256=digest, nbytes=nbytes)

    def read(self, ref: BlobRef) -> bytes:
        """From this store, by hash only: a run directory is untrusted input, so a blob is a regular
        file inside the store (no symlink, FIFO or device) and no more than ref.nbytes (+1, so a longer
        one fails the size check) are read. The ref's own uri is never followed: a copied run must
        not silently read another run's files (the archiver copies blobs of other stores here)."""
        path = self.path(ref)
        if path.parent.is_symlink():
            raise BlobError(f"blob {ref.sha256}: {path.parent} is a symbolic link; a blob store holds only its "
                            "own files")
        try:
            # O_NONBLOCK: opening a FIFO must not wait for a writer; O_NOFOLLOW: a symlink is refused.
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            elsewhere = f"; its reference names {printable(ref.uri)}, which is not read from here" if ref.uri and \
                urlparse(ref.uri).path != path.as_posix() else ""
            raise BlobMissing(f"blob {ref.sha256} not found in {self.root}{elsewhere}") from None
        except OSError as exc:
            why = "a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
            raise BlobError(f"cannot read blob {ref.sha256} at {path}: {why}") from exc
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise BlobError(f"blob {ref.sha256} at {path} is not a regular file")
            try:
                return f.read(ref.nbytes + 1)
            except OSError as exc:
                raise BlobError(f"cannot read blob {ref.sha256} at {path}: {exc}") from exc

    def delete(self, ref: BlobRef) -> int:
        """Unlink the blob from this store (never the ref's own file elsewhere); bytes freed."""
        path = self.path(ref)
        try:
            nbytes = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            return 0
        except OSError as exc:
            raise BlobError(f"cannot delete blob {ref.sha256} at {path}: {exc}") from exc
        return nbytes

    def keys(self) -> dict[str, int]:
        if not self.root.is_dir():
            return {}
        return {path.name: path.stat().st_size for path in self.root.glob("??/*")
                if path.name[:2] == path.parent.name and len(path.name) == 64}

    @contextmanager
    def mapped(self, ref: BlobRef) -> Iterator[memoryview]:
        """A private (copy-on-write) map of this store's file for the blob, by hash only: a regular
        file, not a link, of exactly ref.nbytes. A ref whose URI names a file that cannot be a blob of
        this hash is refused, so a manifest cannot point a reader outside the store."""
        path = self.path(ref)
        uri = urlparse(ref.uri)
        if uri.scheme == "file":
            named = Path(unquote(uri.path))
            if named.name != ref.sha256 or named.parent.name != ref.sha256[:2]:
                raise BlobError(f"blob {ref.sha256} names {named}, which is outside the blob store {self.root}")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise BlobError(f"blob {ref.sha256} not found in {self.root}") from None
        except OSError as exc:
            raise BlobError(f"cannot read blob {ref.sha256} at {path}: {exc}") from exc
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size != ref.nbytes:
                raise BlobError(f"blob {ref.sha256} at {path} is not a regular file of {ref.nbytes} bytes "
                                f"(it has {info.st_size})")
            view = mmap.mmap(fd, ref.nbytes, access=mmap.ACCESS_COPY) if ref.nbytes else None
        finally:
            os.close(fd)
        if view is None:
            yield memoryview(b"")
            return
        try:
            yield memoryview(view)
        finally:
            try:
                view.close()
            except BufferError:  # a tensor still views the map (an error unwinding): it unmaps when freed
                pass

    def _make_dir(self, shard: Path) -> None:
        if not shard.is_dir():
            shard.mkdir(exist_ok=True)
            fsync_dir(self.root)


def _chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as src:
        while chunk := src.read(_CHUNK):
            yield chunk


def _copy(parts: Iterable[bytes | memoryview], f) -> tuple[str, int]:
    sha = hashlib.sha256()
    nbytes = 0
    for part in parts:
        sha.update(part)
        f.write(part)
        nbytes += len(part) if isinstance(part, bytes) else part.nbytes
    return sha.hexdigest(), nbytes
