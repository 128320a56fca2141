"""Store layout v1: paths, Arrow schema, sample <-> record batch, index, manifest, errors.

Owns the bytes of a store (see the package docstring for why the layout is what it is);
:mod:`eaglenest.store.storage` writes them safely on any fsspec filesystem. Invariant: record batches are
built from and read into tensors without copying: Arrow buffers wrap the tensor memory on write; on read,
tensors are views of the buffer the message lives in.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import torch

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
IPC_OPTIONS = pa.ipc.IpcWriteOptions(allow_64bit=True)
"""allow_64bit: a column may hold more than 2^31 - 1 values (one long sample's aux_hidden can)."""


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


# ---------------------------------------------------------------- manifest and paths


def encode_manifest(manifest: dict) -> bytes:
    return (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()


def join(*parts: str) -> str:
    return "/".join(p.strip("/") if i else p.rstrip("/") for i, p in enumerate(parts))


def version_path(root: str, version: str, name: str = "") -> str:
    return join(root, VERSIONS_DIR, version, name) if name else join(root, VERSIONS_DIR, version)
