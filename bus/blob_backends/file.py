"""The filesystem blob backend: `file://` blobs under a directory (a run's blobs/, local or shared).

Layout: root/<sha[:2]>/<sha>. A put writes a temp file in root, fsyncs it, renames it into place and
fsyncs the directory, so a blob is either absent or complete.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import tempfile
from pathlib import Path
from urllib.parse import urlparse

from reel.bus.blobs import BlobBackend, BlobError, check_key
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
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".put-")
            os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide blobs from other users of a shared store
            try:
                with os.fdopen(fd, "wb") as f:
                    digest, nbytes = self._copy(data, f)
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
            raise BlobError(f"blob {ref.sha256} not found in {self.root}{elsewhere}") from None
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

    @staticmethod
    def _copy(data: bytes | Path, f) -> tuple[str, int]:
        sha = hashlib.sha256()
        if isinstance(data, Path):
            nbytes = 0
            with open(data, "rb") as src:
                while chunk := src.read(_CHUNK):
                    sha.update(chunk)
                    f.write(chunk)
                    nbytes += len(chunk)
            return sha.hexdigest(), nbytes
        sha.update(data)
        f.write(data)
        return sha.hexdigest(), len(data)

    def _make_dir(self, shard: Path) -> None:
        if not shard.is_dir():
            shard.mkdir(exist_ok=True)
            fsync_dir(self.root)

