"""Verifying a store: every data file's size and sha256 against the manifest, and the index against the data.

Owns what ``eaglenest store verify`` checks. Damage is reported as one problem line per file (never raised),
so a user sees every bad file at once; a store whose manifest or index cannot even be read is one problem.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa

from eaglenest.store import layout as L
from eaglenest.store import storage
from eaglenest.store.reader import Store, _open


def verify_store(url: str, *, storage_options: dict | None = None, version: str | None = None,
                 ) -> tuple[Store | None, list[str]]:
    """(the store or None, every problem found). Unlike :func:`~eaglenest.store.reader.open_store`, a missing
    or truncated data file is one problem among the others, and a garbled manifest or index is a problem with
    no store to check further. A URL without any committed version raises :class:`StoreNotFound`."""
    try:
        store = _open(url, storage_options, version, check_sha256=True, check_sizes=False)
    except L.StoreCorrupt as e:
        return None, [str(e)]
    return store, verify(store)


def verify(store: Store) -> list[str]:
    """Every problem of an opened store (empty when fine): sizes, sha256, and index <-> data consistency."""
    problems = store._size_problems()
    rows_per_file = Counter(int(f) for f in store._file)
    for f, (path, rec) in enumerate(zip(store._paths, store.manifest["files"], strict=True)):
        if any(p.startswith(f"data file {path} is ") for p in problems):
            continue  # missing or truncated: already named
        try:
            size, sha = storage.sha256_file(store.fs, path)
        except FileNotFoundError:
            problems.append(f"{path}: missing")
            continue
        if sha != rec["sha256"] or size != rec["bytes"]:
            problems.append(f"{path}: sha256/size mismatch with the manifest (bytes changed on storage); "
                            f"{store._remedy()}")
            continue
        store._remember_checked(f)  # reads below need not hash it again
        if rec["samples"] != rows_per_file[f]:
            problems.append(f"{path}: manifest says {rec['samples']} samples, index has {rows_per_file[f]}")
        problems += _check_file(store, f, path)
    for key, arr in (("num_tokens", store.num_tokens), ("loss_tokens", store.loss_tokens)):
        if int(arr.sum()) != store.manifest.get(key):
            problems.append(f"index {key} total {int(arr.sum())} != manifest {store.manifest.get(key)}")
    if len(set(store.sample_ids)) != len(store.sample_ids):
        problems.append("index lists a sample id twice")
    return problems


def _check_file(store: Store, f: int, path: str) -> list[str]:
    """Each index row of file f: same sample id (batch metadata), rows, loss tokens, message range."""
    problems = []
    try:
        with store.fs.open(path, "rb") as fh:
            reader = pa.ipc.open_file(pa.py_buffer(fh.read()) if not store._local else store._mapped(f)[2])
            rows = np.flatnonzero(store._file == f)
            if reader.num_record_batches != len(rows):
                problems.append(f"{path}: {reader.num_record_batches} batches, index lists {len(rows)}")
            for i in rows:
                batch, meta = reader.get_batch_with_custom_metadata(int(store._batch[i]))
                sid = (meta or {}).get(b"sample_id", b"").decode()
                if sid != store.sample_ids[i] or batch.num_rows != store.num_tokens[i]:
                    problems.append(f"{path}: batch {store._batch[i]} holds {sid!r}/{batch.num_rows} tokens, "
                                    f"index says {store.sample_ids[i]!r}/{store.num_tokens[i]}")
                elif int(batch.column(1).to_numpy().sum()) != store.loss_tokens[i]:
                    problems.append(f"{path}: loss tokens of {sid!r} differ from the index")
                elif store[int(i)].num_tokens != batch.num_rows:
                    problems.append(f"{path}: index offset of {sid!r} does not point at its batch")
    except (pa.ArrowException, OSError, L.StoreCorrupt, ValueError) as e:
        problems.append(f"{path}: unreadable ({e})")
    return problems
