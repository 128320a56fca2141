"""Store layout v1: paths, Arrow schema, sample <-> record batch, manifest, errors, committed writes.

Owns the bytes of a store (see the package docstring for why the layout is what it is) and the
primitives that write them safely on any fsspec filesystem. Invariants:

- A file appears under its final name only complete: local writes go to ``<name>.<rand>.tmp`` in the
  same folder, fsync, rename, fsync the folder; remote writes happen inside an fsspec transaction, so
  an exception discards the upload instead of publishing a partial object.
- Disk-full errors (ENOSPC, EFBIG, EDQUOT) leave no temporary behind and surface as
  :class:`StoreDiskFull` (terminal).
- Record batches are built from and read into tensors without copying: Arrow buffers wrap the tensor
  memory on write; on read, tensors are views of the buffer the message lives in.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import queue
import threading
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import torch
from fsspec.implementations.local import LocalFileSystem

from eaglenest.contract import Provenance

STORE_SCHEMA_VERSION = 1
LAYOUT = "eaglenest-store/arrow-ipc-token-rows/v1"
"""The bf16 layout (hidden states as captured). An older eaglenest reads only this one."""
LAYOUTS = {"bf16": LAYOUT, "fp8": "eaglenest-store/arrow-ipc-token-rows-fp8/v1"}
"""Layout per store encoding: another name for fp8, so an eaglenest without fp8 refuses such a store as an
unknown layout ("upgrade eaglenest") instead of misreading its bytes."""
DATA_DIR = "data"
VERSIONS_DIR = "versions"
QUARANTINE_DIR = "quarantine"
MANIFEST_NAME = "manifest.json"
INDEX_NAME = "index.arrow"
DATA_SUFFIX = ".arrow"
SIDECAR_SUFFIX = ".json"
"""Sidecar of a data file: its size, sha256 and index rows, written after the file (converter bookkeeping)."""
TMP_SUFFIX = ".tmp"
IPC_OPTIONS = pa.ipc.IpcWriteOptions(allow_64bit=True)
"""allow_64bit: a column may hold more than 2^31 - 1 values (one long sample's aux_hidden can)."""
HASH_CHUNK = 16 << 20
WRITEBACK_CHUNK = 32 << 20
_DISK_FULL = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


class StoreError(RuntimeError):
    """Base of store errors. ``retryable`` says whether running again unchanged can succeed."""

    retryable = False


class StoreNotFound(StoreError):
    """No committed version (no manifest.json) at the URL: the store does not exist (yet)."""


class StoreCorrupt(StoreError):
    """A stored file is missing, truncated, garbled or disagrees with the manifest. Terminal."""


class StoreDiskFull(StoreError):
    """The destination ran out of space; nothing partial was published. Terminal until space is freed."""


class StoreBackendMissing(StoreError):
    """The URL's protocol needs an fsspec implementation that is not installed (s3fs, gcsfs). Terminal."""


class ConvertInputError(StoreError):
    """The extraction folder cannot be converted as is (missing/changed shard, ledger mismatch)."""


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in _DISK_FULL


def disk_full_error(where: str, exc: OSError) -> StoreDiskFull:
    return StoreDiskFull(
        f"disk full while writing {where} ({errno.errorcode.get(exc.errno or 0, exc.errno)}: {exc.strerror}); "
        "nothing partial was published: free space (or raise the quota) and re-run convert, "
        "finished data files are reused"
    )


# ---------------------------------------------------------------- filesystem


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


def join(*parts: str) -> str:
    return "/".join(p.strip("/") if i else p.rstrip("/") for i, p in enumerate(parts))


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        _fsync_dir(os.path.dirname(path))
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


# ---------------------------------------------------------------- Arrow schema and record batches


def data_schema(provenance: Provenance) -> pa.Schema:
    """Schema of every data file of a store: one row per token, hidden states as stored bit patterns.

    bf16 (``provenance.store_encoding``): aux_hidden / final_hidden are uint16 bf16 patterns. fp8: they are
    uint8 e4m3 patterns, followed by float32 ``aux_scale`` [k] and ``final_scale`` [1] per token."""
    enc = provenance.store_encoding
    if enc not in LAYOUTS:
        raise ValueError(f"unknown store encoding {enc!r} (known: {', '.join(LAYOUTS)})")
    k, h = len(provenance.aux_layer_ids), provenance.hidden_size
    fields = [pa.field("input_ids", pa.int32(), nullable=False),
              pa.field("loss_mask", pa.uint8(), nullable=False, metadata={b"dtype": b"bool"})]
    if enc == "bf16":
        bf16 = {b"dtype": b"bfloat16", b"storage": b"uint16 bit pattern"}
        fields += [pa.field("aux_hidden", pa.list_(pa.uint16(), k * h), nullable=False, metadata=bf16),
                   pa.field("final_hidden", pa.list_(pa.uint16(), h), nullable=False, metadata=bf16)]
    else:
        fp8 = {b"dtype": b"float8_e4m3fn", b"storage": b"uint8 bit pattern, times the block's scale"}
        fields += [pa.field("aux_hidden", pa.list_(pa.uint8(), k * h), nullable=False, metadata=fp8),
                   pa.field("final_hidden", pa.list_(pa.uint8(), h), nullable=False, metadata=fp8),
                   pa.field("aux_scale", pa.list_(pa.float32(), k), nullable=False),
                   pa.field("final_scale", pa.list_(pa.float32(), 1), nullable=False)]
    return pa.schema(
        fields,
        metadata={
            b"eaglenest.layout": LAYOUTS[enc].encode(),
            b"eaglenest.schema_version": str(STORE_SCHEMA_VERSION).encode(),
            b"eaglenest.provenance": provenance.to_json().encode(),
        },
    )


def schema_encoding(schema: pa.Schema) -> str:
    """The encoding a data file's schema says it holds ("?" when its layout is unknown)."""
    layout = (schema.metadata or {}).get(b"eaglenest.layout", b"").decode()
    return next((enc for enc, lay in LAYOUTS.items() if lay == layout), "?")


def _arrow_from(tensor: torch.Tensor, arrow_type: pa.DataType) -> pa.Array:
    """A primitive Arrow array over the tensor's own memory (no copy)."""
    flat = tensor.contiguous().reshape(-1)
    if flat.dtype == torch.bfloat16:
        flat = flat.view(torch.int16)
    elif flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    arr = flat.numpy()
    return pa.Array.from_buffers(arrow_type, arr.size, [None, pa.py_buffer(arr)])


def sample_batch(schema: pa.Schema, columns: Sequence[torch.Tensor]) -> pa.RecordBatch:
    """One sample as one record batch of T rows, wrapping the tensors' memory.

    ``columns`` follow the schema: input_ids [T] int32, loss_mask [T] bool, aux_hidden [T, k*H] and
    final_hidden [T, H] (bf16, or uint8 fp8 codes), then for fp8 aux_scale [T, k] and final_scale [T, 1]."""
    arrays = []
    for f, tensor in zip(schema, columns, strict=True):
        if pa.types.is_fixed_size_list(f.type):
            arrays.append(pa.FixedSizeListArray.from_arrays(_arrow_from(tensor, f.type.value_type), f.type.list_size))
        else:
            arrays.append(_arrow_from(tensor, f.type))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def first_batch_offset(schema: pa.Schema) -> int:
    """Byte offset of the first record batch in an IPC file: 8 (magic + padding) + schema message."""
    return 8 + schema.serialize().size


def _view(base: torch.Tensor, base_address: int, buf: pa.Buffer, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    start = buf.address - base_address
    if start < 0 or start + nbytes > base.numel() or buf.size < nbytes:
        raise ValueError(f"column buffer [{start}, {start + nbytes}) lies outside its message")
    return base[start : start + nbytes].view(dtype)


_STORAGE = {pa.int32(): torch.int32, pa.uint8(): torch.uint8, pa.uint16(): torch.int16, pa.float32(): torch.float32}
_LOGICAL = {b"bfloat16": torch.bfloat16, b"bool": torch.bool}


def batch_tensors(batch: pa.RecordBatch, base: torch.Tensor, base_address: int) -> dict[str, torch.Tensor]:
    """Every column as a tensor viewing ``base``: [T] for scalars, [T, width] for fixed-size lists; bf16 and
    bool columns in their logical dtype, fp8 codes as uint8 (decoded by :mod:`eaglenest.store.encoding`).

    ``base`` is a uint8 tensor over the memory holding the batch's message (an mmap or fetched bytes).
    """
    t = batch.num_rows
    out = {}
    for f, col in zip(batch.schema, batch.columns, strict=True):
        if col.null_count or col.offset:
            raise ValueError("unexpected nulls or offsets in a sample batch")
        width = f.type.list_size if pa.types.is_fixed_size_list(f.type) else None
        values = col.values if width else col
        dtype = _STORAGE[values.type]
        n = t * (width or 1)
        tensor = _view(base, base_address, values.buffers()[1], n * dtype.itemsize, dtype)
        logical = _LOGICAL.get((f.metadata or {}).get(b"dtype", b""))
        if logical is not None:
            tensor = tensor.view(logical)
        out[f.name] = tensor.view(t, width) if width else tensor
    return out


# ---------------------------------------------------------------- index table

INDEX_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("file", pa.int32(), nullable=False),  # position in manifest["files"]
        pa.field("batch", pa.int32(), nullable=False),  # record batch (= sample row) within the file
        pa.field("offset", pa.int64(), nullable=False),  # byte offset of the batch's IPC message
        pa.field("length", pa.int64(), nullable=False),  # bytes of the message (metadata + body)
        pa.field("num_tokens", pa.int64(), nullable=False),
        pa.field("loss_tokens", pa.int64(), nullable=False),
        pa.field("shard_sha256", pa.string(), nullable=False),  # sha256 of the source shard
    ],
    metadata={b"eaglenest.layout": LAYOUT.encode()},
)


def encode_index(columns: dict[str, list]) -> bytes:
    table = pa.table({f.name: pa.array(columns[f.name], f.type) for f in INDEX_SCHEMA}, schema=INDEX_SCHEMA)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, INDEX_SCHEMA, options=IPC_OPTIONS) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def decode_index(data: bytes, where: str) -> dict[str, np.ndarray | list[str]]:
    try:
        table = pa.ipc.open_file(pa.py_buffer(data)).read_all()
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as e:
        raise StoreCorrupt(f"{where}: unreadable index ({e}); rebuild it with `eaglenest store convert`") from None
    if table.schema.remove_metadata() != INDEX_SCHEMA.remove_metadata():
        raise StoreCorrupt(f"{where}: index columns {table.schema.names} differ from layout {LAYOUT}")
    out: dict[str, Any] = {"sample_id": table.column("sample_id").to_pylist()}
    for name in ("file", "batch", "offset", "length", "num_tokens", "loss_tokens"):
        out[name] = table.column(name).to_numpy().astype(np.int64)
    out["shard_sha256"] = table.column("shard_sha256").to_pylist()
    return out


# ---------------------------------------------------------------- manifest


def encode_manifest(manifest: dict) -> bytes:
    return (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()


def version_path(root: str, version: str, name: str = "") -> str:
    return join(root, VERSIONS_DIR, version, name) if name else join(root, VERSIONS_DIR, version)
