"""Arrow-indexed store (schema v1): validated shards -> Arrow IPC data files + index + manifest, on fsspec.

Owns the training-data format between extraction and training. Layout of a store URL::

    data/<key>.arrow            Arrow IPC *file* format, uncompressed, immutable, shared by versions
    data/<key>.arrow.json       sidecar: size, sha256 and index rows of that file (converter bookkeeping)
    versions/<id>/index.arrow   index: sample_id -> file, batch (row), byte offset + length, tokens, loss tokens
    versions/<id>/manifest.json written LAST: schema version, layout, provenance, counts, per-file size + sha256
    quarantine/                 files that failed their checksum, with a reason

Why this Arrow layout (one record batch per sample, one row per token):

- Columns ``input_ids`` int32, ``loss_mask`` uint8 (0/1), ``aux_hidden`` FixedSizeList<uint16, k*H> and
  ``final_hidden`` FixedSizeList<uint16, H>; bf16 is kept as its 16-bit pattern and the field metadata says
  ``dtype=bfloat16``. No nulls, so no validity buffers: each column of a batch is exactly one contiguous
  buffer holding the tensor's bytes (Arrow aligns buffers to 8 bytes), and ``torch`` views it as is
  (uint8 mask viewed as bool, uint16 bits viewed as bf16). Arrow's bit-packed booleans would force a copy.
- Fixed-size lists carry no offsets buffer at all, so no 32-bit offset limit exists anywhere; array
  lengths and IPC buffer offsets are 64-bit and files are written with ``allow_64bit`` so one sample's
  aux_hidden may exceed 2^31 values (> 4 GiB; tested with a sparse file).
- One record batch per sample makes a sample one contiguous, self-describing IPC message: the index keeps
  its (offset, length), so a local read is a slice of a memory map (O(1), zero copies) and a remote read
  is ONE range request of exactly that sample's bytes, decoded with ``pyarrow.ipc.read_message``. The file
  keeps Arrow's footer, so any Arrow tool can open a data file on its own.
- Uncompressed: zstd IPC reads at ~500 MB/s, mapped uncompressed reads at memory speed.
- Files of ``target_file_bytes`` bound object sizes for object stores and keep the number of files small.

Samples with one ledger's content always land in the same file keys, so re-runs and appends reuse
files; versions never modify files of other versions (see :mod:`eaglenest.store.converter`).
"""

from eaglenest.store.converter import DEFAULT_TARGET_FILE_BYTES, ConvertSummary, convert
from eaglenest.store.extraction import ExtractionStore, open_samples
from eaglenest.store.layout import (
    STORE_SCHEMA_VERSION,
    ConvertInputError,
    StoreBackendMissing,
    StoreCorrupt,
    StoreDiskFull,
    StoreError,
    StoreNotFound,
)
from eaglenest.store.reader import Store, StoreSample, list_versions, open_store
from eaglenest.store.sampler import LengthBucketSampler, StoreDataset
from eaglenest.store.split import held_out, split_indices
from eaglenest.store.verify import verify_store

__all__ = [
    "DEFAULT_TARGET_FILE_BYTES",
    "STORE_SCHEMA_VERSION",
    "ConvertInputError",
    "ConvertSummary",
    "ExtractionStore",
    "LengthBucketSampler",
    "Store",
    "StoreBackendMissing",
    "StoreCorrupt",
    "StoreDataset",
    "StoreDiskFull",
    "StoreError",
    "StoreNotFound",
    "StoreSample",
    "convert",
    "held_out",
    "list_versions",
    "open_samples",
    "open_store",
    "split_indices",
    "verify_store",
]
