"""Store files on any fsspec filesystem: URL resolution, committed writes, hashing, moves.

Owns how the bytes of a store (:mod:`eaglenest.store.layout`) reach a local disk or an object store, and how
they are read back for checksums. Invariants:

- A file appears under its final name only complete: local writes go to ``<name>.<rand>.tmp`` in the
  same folder, fsync, rename, fsync the folder (the recipe of :mod:`eaglenest.atomic`, streamed); remote
  writes happen inside an fsspec transaction, so an exception discards the upload instead of publishing a
  partial object.
- Disk-full errors (ENOSPC, EFBIG, EDQUOT) leave no temporary behind and surface as
  :class:`~eaglenest.store.layout.StoreDiskFull` (terminal); a protocol whose fsspec implementation is not
  installed surfaces as :class:`~eaglenest.store.layout.StoreBackendMissing`, naming what to install.
- What is written is hashed on the way (:class:`HashingWriter`): a writer learns its file's size and sha256
  without reading it back.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import queue
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from eaglenest.atomic import TMP_SUFFIX, fsync_dir
from eaglenest.store.layout import StoreBackendMissing, StoreDiskFull

HASH_CHUNK = 16 << 20
WRITEBACK_CHUNK = 32 << 20
_DISK_FULL = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in _DISK_FULL


def disk_full_error(where: str, exc: OSError) -> StoreDiskFull:
    return StoreDiskFull(
        f"disk full while writing {where} ({errno.errorcode.get(exc.errno or 0, exc.errno)}: {exc.strerror}); "
        "nothing partial was published: free space (or raise the quota) and re-run convert, "
        "finished data files are reused"
    )


def resolve(url: str, storage_options: dict | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """fsspec filesystem and root path (no trailing slash) for a store URL or local path."""
    try:
        fs, path = fsspec.core.url_to_fs(str(url), **(storage_options or {}))
    except ImportError as e:  # fsspec knows the protocol but its implementation package is not installed
        raise StoreBackendMissing(backend_missing_message(str(url), e)) from e
    return fs, path.rstrip("/") or "/"


# What to install for each object-store protocol's fsspec implementation (s3 is an eaglenest extra).
_INSTALL = {"s3": ("s3fs", "pip install 'eaglenest[s3]'"), "s3a": ("s3fs", "pip install 'eaglenest[s3]'"),
            "gs": ("gcsfs", "pip install gcsfs"), "gcs": ("gcsfs", "pip install gcsfs")}


def backend_missing_message(url: str, exc: ImportError) -> str:
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    if protocol not in _INSTALL:
        return f"{url}: no filesystem for {protocol}:// is installed ({exc})"
    package, command = _INSTALL[protocol]
    return f"{url}: {protocol}:// needs {package}, which is not installed: {command}"


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


class HashingWriter:
    """File-like sink for pyarrow: forwards writes, counts bytes and sha256s them on the way.

    ``background=True`` hashes on a helper thread (in write order) while the caller goes on encoding and
    writing: the data is referenced, not copied (pyarrow hands over immutable bytes or the batch's own
    buffers, which the converter keeps alive); :meth:`hexdigest` waits for it."""

    def __init__(self, raw: Any, *, background: bool = False) -> None:
        self.raw = raw
        self._sha = hashlib.sha256()
        self.size = 0
        self.closed = False
        self._written_back = 0
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._queue = queue.Queue(maxsize=256)
            self._thread = threading.Thread(target=self._hash_loop, name="store-hash", daemon=True)
            self._thread.start()

    def _hash_loop(self) -> None:
        while (view := self._queue.get()) is not None:
            self._sha.update(view)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self._queue is not None:
            self._queue.put(view)
        else:
            self._sha.update(view)
        total = view.nbytes
        while view.nbytes:  # a single write() moves at most ~2 GiB on Linux: loop
            n = self.raw.write(view)
            view = view[n if n is not None else view.nbytes :]
        self.size += total
        return total

    def finish(self) -> None:
        """Wait until everything written so far is hashed (stops the helper thread)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = self._queue = None

    def hexdigest(self) -> str:
        self.finish()
        return self._sha.hexdigest()

    def tell(self) -> int:
        return self.size

    def start_writeback(self, every: int = WRITEBACK_CHUNK) -> None:
        """Local files: ask the kernel to start writing what is behind us (POSIX_FADV_DONTNEED starts
        async writeback of dirty pages), so the final fsync finds little left and disk I/O overlaps the
        CPU work (hashing, decoding) instead of following it."""
        if self.size - self._written_back >= every and hasattr(os, "posix_fadvise"):
            with contextlib.suppress(OSError):
                os.posix_fadvise(self.raw.fileno(), self._written_back, self.size - self._written_back,
                                 os.POSIX_FADV_DONTNEED)
            self._written_back = self.size

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:  # the owner closes/commits ``raw``
        self.closed = True


@contextlib.contextmanager
def committed_file(fs: fsspec.AbstractFileSystem, path: str, *, background_hash: bool = False,
                   ) -> Iterator[HashingWriter]:
    """Open ``path`` for writing; it is published (complete) only if the block exits cleanly."""
    where = path
    if is_local(fs):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{uuid.uuid4().hex[:12]}{TMP_SUFFIX}"
        try:
            with open(tmp, "wb", buffering=0) as raw:
                sink = HashingWriter(raw, background=background_hash)
                try:
                    yield sink
                finally:
                    sink.finish()
                os.fsync(raw.fileno())
            os.replace(tmp, path)
        except BaseException as e:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            if is_disk_full(e):
                raise disk_full_error(where, e) from e
            raise
        fsync_dir(os.path.dirname(path))
        return
    try:
        with fs.transaction, fs.open(path, "wb") as raw:
            sink = HashingWriter(raw, background=background_hash)
            try:
                yield sink
            finally:
                sink.finish()
    except OSError as e:
        if is_disk_full(e):
            raise disk_full_error(where, e) from e
        raise


def write_bytes(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> str:
    """Commit ``data`` to ``path`` atomically; returns its sha256."""
    with committed_file(fs, path) as f:
        f.write(data)
    return f.hexdigest()


def sha256_file(fs: fsspec.AbstractFileSystem, path: str) -> tuple[int, str]:
    """(size, sha256) of a stored file, streamed."""
    h, n = hashlib.sha256(), 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
            n += len(chunk)
    return n, h.hexdigest()


def move(fs: fsspec.AbstractFileSystem, src: str, dst: str) -> None:
    if is_local(fs):
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.replace(src, dst)
    else:
        fs.mv(src, dst)
