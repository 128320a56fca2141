"""Atomic local writes: a file appears under its final name complete, or not at all.

Owns the one recipe every local write of eaglenest follows (shards, ledgers, reports, configs): write a unique
``<name>.<rand>.tmp`` in the same folder, fsync it, rename (or link, for write-once files) it to the final name,
fsync the folder so the rename survives a power loss. Stdlib only: the SGLang capture plugin imports it inside
the engine's processes.

Invariants: readers ignore ``*.tmp`` (:data:`TMP_SUFFIX`); on any error the temporary is removed and the error
re-raised unchanged (disk full stays an OSError with its errno); :func:`publish_once` never replaces an existing
file; :func:`clean_temporaries` removes what killed writers left.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path

TMP_SUFFIX = ".tmp"


def fsync_dir(path: str | Path) -> None:
    """fsync a folder, so that renames and links inside it survive a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temporary_name(path: Path) -> Path:
    """A unique ``<name>.<rand>.tmp`` beside ``path`` (readers ignore the suffix; cleaners remove it)."""
    return path.with_name(f"{path.name}.{uuid.uuid4().hex[:12]}{TMP_SUFFIX}")


def _write_fsynced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` so that the final name holds either nothing or all of it.

    A unique ``<name>.<rand>.tmp`` in the same folder is written, fsynced and renamed over the final
    name; the folder is fsynced so the rename survives a power loss. On any error the temporary is
    removed and the error re-raised (disk full stays an OSError with its errno).
    """
    path = Path(path)
    tmp = _temporary_name(path)
    try:
        _write_fsynced(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
    return path


def publish_once(path: str | Path, data: bytes) -> tuple[Path, bytes]:
    """Atomically create ``path`` with ``data`` unless a complete file is already there.

    Shards are write-once: a late duplicate of a request (a client retried after a timeout while the
    engine was still computing the first attempt) must never replace a shard that may already be
    validated and recorded by its sha256. Returns the path and the bytes now under it (the earlier
    file's when one was kept). To replace a shard, move it away first (quarantine).
    """
    path = Path(path)
    tmp = _temporary_name(path)
    try:
        _write_fsynced(tmp, data)
        try:
            os.link(tmp, path)  # fails if the name exists: never overwrites
        except FileExistsError:
            return path, path.read_bytes()
        finally:
            os.unlink(tmp)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
    return path, data


def clean_temporaries(directory: str | Path) -> int:
    """Remove leftover ``*.tmp`` files (from killed writers); returns how many were removed."""
    directory = Path(directory)
    n = 0
    if directory.is_dir():
        for p in directory.glob(f"*{TMP_SUFFIX}"):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                n += 1
    return n
