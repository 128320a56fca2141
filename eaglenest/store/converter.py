"""Conversion: an extraction's validated shards (by its ledger) -> one committed store version.

Owns planning, writing and committing store versions. Invariants:

- An extraction with samples still pending (its ``report.json`` counts them) is refused unless the caller
  asks for a partial store (``partial=True``): a store never silently holds half a run.
- Only ledger entries are converted, each shard checked against the ledger's sha256 and the capture
  contract (see :mod:`eaglenest.store.shards`); mixed provenance or schema versions are refused before
  anything is written. The store records the first shard's provenance.
- Samples are packed, in ledger order, into data files of about ``target_file_bytes``. A data file is
  named by a key over its content's identity (layout, provenance, and each sample's id, shard sha256 and
  loss spans), so the same inputs always produce the same file: a re-run reuses it after checking its
  sha256 against the file's sidecar (``<key>.arrow.json``, written after the file, holding its sha256 and
  index fragment); appended samples only add files (and rewrite the last, partial one).
- Commit order: data files (each complete or absent), then ``versions/<id>/index.arrow``, then
  ``versions/<id>/manifest.json`` LAST. A version without a manifest does not exist; the version id is
  a hash of the planned file keys, so a new extraction makes a new version and never touches old ones.
- A file that fails its checksum is moved to ``quarantine/`` (with a reason) and rebuilt.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from functools import partial as partial_fn
from pathlib import Path

import fsspec
import pyarrow as pa
import torch

from eaglenest.atomic import TMP_SUFFIX
from eaglenest.contract import Provenance, Shard
from eaglenest.extraction.ledger import Ledger, LedgerEntry, spans_to_mask
from eaglenest.models import auto_device
from eaglenest.store import layout as L
from eaglenest.store import storage
from eaglenest.store.encoding import DEFAULT_ENCODING, check_encoding, encode_samples
from eaglenest.store.reader import open_store
from eaglenest.store.shards import check_inputs, check_pending, group_entries, prefetch_shards

DEFAULT_TARGET_FILE_BYTES = 256 << 20
DEVICE_GROUP_BYTES = 32 << 20
"""Shard bytes encoded together off the CPU: a copy's and a wait's fixed cost vanish next to 32 MB, and eight
groups fit the prefetch window (one per helper)."""
DTYPES = {
    "bf16": {"input_ids": "int32", "loss_mask": "bool", "aux_hidden": "bfloat16", "final_hidden": "bfloat16"},
    "fp8": {"input_ids": "int32", "loss_mask": "bool", "aux_hidden": "float8_e4m3fn", "final_hidden": "float8_e4m3fn",
            "aux_scale": "float32", "final_scale": "float32"},
}
"""What the manifest says each column holds, per encoding."""
ProgressFn = Callable[[int, int], None]


@dataclass(frozen=True, kw_only=True, slots=True)
class ConvertSummary:
    """What one conversion did. ``bytes_in`` / ``seconds`` is the conversion speed of this run."""

    url: str
    version: str
    samples: int
    tokens: int
    loss_tokens: int
    files_total: int
    files_written: int
    files_reused: int
    files_quarantined: int
    bytes_in: int
    """Shard bytes read and converted in this run (0 when every file was reused)."""
    bytes_written: int
    store_bytes: int
    """Data bytes of the whole version (written + reused)."""
    seconds: float
    already_complete: bool
    pending: int = 0
    """Samples of the extraction left out because they are still pending (only with ``partial=True``)."""
    encoding: str = DEFAULT_ENCODING

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class _Planned:
    key: str
    entries: tuple[LedgerEntry, ...]


def file_key(provenance: Provenance, entries: Sequence[LedgerEntry]) -> str:
    layout = L.LAYOUTS[provenance.store_encoding]
    h = hashlib.sha256(f"{layout}\n{L.STORE_SCHEMA_VERSION}\n{provenance.to_json()}\n".encode())
    for e in entries:
        h.update(json.dumps([e.sample_id, e.sha256, e.num_tokens, e.loss_spans]).encode() + b"\n")
    return h.hexdigest()[:40]


def plan_files(entries: Sequence[LedgerEntry], provenance: Provenance, target_file_bytes: int) -> list[_Planned]:
    """Greedy packing in ledger order: a file closes once it holds ``target_file_bytes`` of shards."""
    return [_Planned(file_key(provenance, g), tuple(g)) for g in group_entries(entries, target_file_bytes)]


def sample_columns(encoding: str, device: torch.device,
                   loaded: list[tuple[LedgerEntry, Shard]]) -> list[list[torch.Tensor]]:
    """The data columns of each loaded sample in ``encoding`` (the order of :func:`layout.data_schema`); fp8 is
    encoded on ``device`` (the same bits on any device: float32 division and e4m3 rounding are exact IEEE)."""
    masks = [torch.tensor(spans_to_mask(e.loss_spans, e.num_tokens), dtype=torch.bool) for e, _ in loaded]  # [T]
    if encoding == "bf16":
        return [[s.input_ids, m, s.aux_hidden, s.final_hidden] for (_, s), m in zip(loaded, masks, strict=True)]
    num_aux = len(loaded[0][1].provenance.aux_layer_ids)
    fp8 = encode_samples([(s.aux_hidden, s.final_hidden) for _, s in loaded], num_aux,
                         names=[f"sample {e.sample_id!r}" for e, _ in loaded], device=device)
    return [[s.input_ids, m, f.aux_codes, f.final_codes, f.aux_scale, f.final_scale]
            for (_, s), m, f in zip(loaded, masks, fp8, strict=True)]


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """fp8 conversion works on several samples at once, one per helper thread (a CPU encodes them, for a GPU the
    helpers pack them); torch's intra-op threads on top of those oversubscribe the cores (5x slower measured on
    2 busy cores). torch's thread count is per process: it is restored when the conversion ends."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def encode_device(device: str) -> torch.device:
    """Where fp8 encoding runs: ``auto`` is the GPU when one is visible (the encoding is compute-bound on CPUs)."""
    dev = torch.device(auto_device(device))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch sees no CUDA device")
    return dev


def _write_file(fs, root: str, pf: _Planned, schema: pa.Schema,
                samples: Iterator[tuple[LedgerEntry, list[torch.Tensor]]]) -> dict:
    """Write one data file, then its sidecar; returns the sidecar record."""
    path = L.join(root, L.DATA_DIR, pf.key + L.DATA_SUFFIX)
    rows = []
    with storage.committed_file(fs, path, background_hash=True) as sink:
        writer = pa.ipc.new_file(pa.PythonFile(sink, mode="w"), schema, options=L.IPC_OPTIONS)
        pos = L.first_batch_offset(schema)
        for _ in pf.entries:
            entry, columns = next(samples)
            writer.write_batch(L.sample_batch(schema, columns), custom_metadata={"sample_id": entry.sample_id})
            rows.append(dict(sample_id=entry.sample_id, offset=pos, length=sink.size - pos,
                             num_tokens=entry.num_tokens, loss_tokens=int(columns[1].sum()),
                             shard_sha256=entry.sha256))
            pos = sink.size
            if storage.is_local(fs):
                sink.start_writeback()
        writer.close()
    record = {"key": pf.key, "bytes": sink.size, "sha256": sink.hexdigest(), "rows": rows}
    storage.write_bytes(fs, path + L.SIDECAR_SUFFIX, json.dumps(record).encode())
    return record


def _read_sidecar(fs, path: str) -> dict | None:
    try:
        with fs.open(path + L.SIDECAR_SUFFIX, "rb") as f:
            return json.loads(f.read())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None


def quarantine(fs, root: str, path: str, reason: str) -> str:
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%f")
    dst = L.join(root, L.QUARANTINE_DIR, f"{path.rsplit('/', 1)[-1]}.{stamp}")
    storage.move(fs, path, dst)
    storage.write_bytes(fs, dst + ".reason.json", json.dumps({"file": path, "reason": reason}).encode())
    return dst


def _reusable(fs, root: str, pf: _Planned, sizes: dict[str, int], trusted: dict | None, rehash: bool) -> dict | None:
    """The sidecar record of an existing, valid file for ``pf``; quarantines a broken one."""
    path = L.join(root, L.DATA_DIR, pf.key + L.DATA_SUFFIX)
    if path not in sizes:
        return None
    record = _read_sidecar(fs, path)
    if record is None or record.get("key") != pf.key or len(record.get("rows", ())) != len(pf.entries):
        return None  # written but not vouched for (crash before the sidecar): rebuild over it
    expect_sha = trusted["sha256"] if trusted else record["sha256"]
    if sizes[path] != record["bytes"]:
        reason = f"size {sizes[path]} != {record['bytes']}"
    elif trusted and not rehash:
        return record  # vouched for by this version's committed manifest and the size matches
    else:
        _, sha = storage.sha256_file(fs, path)
        if sha == expect_sha == record["sha256"]:
            return record
        reason = f"sha256 {sha} != {expect_sha}"
    quarantine(fs, root, path, reason)
    return None


def _write_manifest(fs, root: str, version: str, manifest: dict) -> None:
    storage.write_bytes(fs, L.version_path(root, version, L.MANIFEST_NAME), L.encode_manifest(manifest))


def _clean_stale(fs, root: str, older_than_s: float) -> int:
    if not storage.is_local(fs):
        return 0  # remote writes use transactions: no temporaries exist
    n, now = 0, time.time()
    for folder in (L.join(root, L.DATA_DIR), *fs.glob(L.join(root, L.VERSIONS_DIR, "*"))):
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            for name in os.listdir(folder):
                p = os.path.join(folder, name)
                if name.endswith(TMP_SUFFIX) and now - os.path.getmtime(p) > older_than_s:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(p)
                        n += 1
    return n


def convert(
    extraction_dir: str | Path,
    url: str,
    *,
    target_file_bytes: int = DEFAULT_TARGET_FILE_BYTES,
    storage_options: dict | None = None,
    append: bool = False,
    rehash: bool = False,
    partial: bool = False,
    encoding: str = DEFAULT_ENCODING,
    device: str = "auto",
    progress: ProgressFn | None = None,
    stale_tmp_seconds: float = 3600.0,
) -> ConvertSummary:
    """Convert an extraction folder's validated samples into a committed version of the store at ``url``.

    append: start from the store's latest version and add the ledger's samples it lacks (same provenance).
    rehash: also sha256-check files that a committed manifest already vouches for (quarantine + rebuild).
    partial: convert although samples of the extraction are still pending (refused otherwise, with counts).
    encoding: how the version holds the states: ``bf16`` (bit exact) or ``fp8`` (half the bytes, within the
    error bound of :mod:`eaglenest.store.encoding`). One version holds one encoding.
    device: where fp8 encoding runs (``auto``: a GPU when one is visible, else the CPU).
    progress: called as ``progress(samples_done, samples_total)``.
    """
    t0 = time.perf_counter()
    if target_file_bytes < 1:
        raise ValueError(f"target_file_bytes must be positive, got {target_file_bytes}")
    check_encoding(encoding)
    dev = encode_device(device)
    fs, root = storage.resolve(url, storage_options)
    ledger = Ledger(extraction_dir)
    entries = list(ledger.entries().values())
    if not entries:
        raise L.ConvertInputError(f"{ledger.path}: no validated samples; run the extraction first")
    pending = check_pending(extraction_dir, entries, partial=partial)
    capture = check_inputs(ledger.capture_dir, entries)  # the shards' provenance (bf16 states)
    prov = replace(capture, store_encoding=encoding)  # the store's: the capture's, plus how it is stored

    base_records, parent = [], None
    if append:
        try:
            base = open_store(url, storage_options=storage_options, check_sha256=False)  # only its index is used
        except L.StoreNotFound:
            base = None
        if base is not None:
            if base.encoding != encoding:
                raise L.ConvertInputError(
                    f"store {url} holds {base.encoding} states; appending {encoding} samples would mix encodings "
                    f"in one version: append with --encoding {base.encoding}, or convert into a new store"
                )
            base.provenance.require_match(prov, what=f"store {url} (latest version) vs extraction {extraction_dir}")
            prov = base.provenance  # every file of a version carries the same provenance (model_path included)
            capture = replace(prov, store_encoding="bf16")
            parent = base.manifest["version"]
            base_records = base.file_records()
            known = dict(zip(base.sample_ids, base.shard_sha256, strict=True))
            changed = [e.sample_id for e in entries if e.sample_id in known and known[e.sample_id] != e.sha256]
            if changed:
                raise L.ConvertInputError(
                    f"samples {changed[:5]} (of {len(changed)}) differ from the store's copies; "
                    "append adds new samples only: convert without --append to make a fresh version"
                )
            entries = [e for e in entries if e.sample_id not in known]

    schema = L.data_schema(prov)
    planned = plan_files(entries, prov, target_file_bytes)
    keys = [r["key"] for r in base_records] + [p.key for p in planned]
    layout = L.LAYOUTS[encoding]
    version = hashlib.sha256(json.dumps([layout, prov.to_json(), keys]).encode()).hexdigest()[:24]
    old = _read_json(fs, L.version_path(root, version, L.MANIFEST_NAME))
    trusted = {f["path"]: f for f in old["files"]} if old else {}
    sizes = {p: int(info["size"]) for p, info in _ls(fs, L.join(root, L.DATA_DIR)).items()}

    quarantined = len(fs.glob(L.join(root, L.QUARANTINE_DIR, "*.reason.json")))
    records: list[dict | None] = []
    for pf in planned:
        records.append(_reusable(fs, root, pf, sizes, trusted.get(f"{L.DATA_DIR}/{pf.key}{L.DATA_SUFFIX}"), rehash))
    todo = [pf for pf, r in zip(planned, records, strict=True) if r is None]
    total = sum(len(p.entries) for p in planned)
    done = total - sum(len(p.entries) for p in todo)
    if progress:
        progress(done, total)

    bytes_in = bytes_written = 0
    if todo:
        # fp8: several helpers (on a CPU the encoding itself is the work; for a GPU they hash and pack while the
        # device works), a GPU's samples in groups (one copy each way and one wait per group, not per sample);
        # bf16 only reads and checks, which one helper keeps up with
        stream = prefetch_shards(ledger.capture_dir, [e for pf in todo for e in pf.entries], capture,
                                 transform=partial_fn(sample_columns, encoding, dev),
                                 workers=min(8, os.cpu_count() or 1) if encoding == "fp8" else 1,
                                 group_bytes=DEVICE_GROUP_BYTES if encoding == "fp8" and dev.type != "cpu" else 0)
        slot = {pf.key: j for j, pf in enumerate(planned)}
        with _one_torch_thread() if encoding == "fp8" else contextlib.nullcontext():
            try:
                for pf in todo:
                    rec = _write_file(fs, root, pf, schema, stream)
                    records[slot[pf.key]] = rec
                    bytes_in += sum(e.bytes for e in pf.entries)
                    bytes_written += rec["bytes"]
                    done += len(pf.entries)
                    if progress:
                        progress(done, total)
            finally:
                stream.close()

    all_records = base_records + [r for r in records if r is not None]
    manifest = _commit_version(fs, root, version, prov, all_records, parent, old, extraction_dir)
    _clean_stale(fs, root, stale_tmp_seconds)
    return ConvertSummary(
        url=url, version=version, samples=manifest["num_samples"], tokens=manifest["num_tokens"],
        loss_tokens=manifest["loss_tokens"], files_total=len(all_records), files_written=len(todo),
        files_reused=len(all_records) - len(todo),
        files_quarantined=len(fs.glob(L.join(root, L.QUARANTINE_DIR, "*.reason.json"))) - quarantined,
        bytes_in=bytes_in, bytes_written=bytes_written, store_bytes=sum(r["bytes"] for r in all_records),
        seconds=time.perf_counter() - t0, already_complete=bool(old) and not todo, pending=pending,
        encoding=prov.store_encoding,
    )


def _commit_version(fs, root, version, prov, records, parent, old, extraction_dir) -> dict:
    """Index, then manifest (last). An existing manifest of this version keeps its created_at."""
    cols: dict[str, list] = {f.name: [] for f in L.INDEX_SCHEMA}
    files = []
    for i, rec in enumerate(records):
        for b, row in enumerate(rec["rows"]):
            for name in ("sample_id", "offset", "length", "num_tokens", "loss_tokens", "shard_sha256"):
                cols[name].append(row[name])
            cols["file"].append(i)
            cols["batch"].append(b)
        files.append({"path": f"{L.DATA_DIR}/{rec['key']}{L.DATA_SUFFIX}", "bytes": rec["bytes"],
                      "sha256": rec["sha256"], "samples": len(rec["rows"]), "encoding": prov.store_encoding,
                      "tokens": sum(r["num_tokens"] for r in rec["rows"])})
    if len(set(cols["sample_id"])) != len(cols["sample_id"]):
        raise L.ConvertInputError("duplicate sample ids across the version's files; this is a bug, please report")
    index = L.encode_index(cols)
    index_rel = f"{L.VERSIONS_DIR}/{version}/{L.INDEX_NAME}"
    storage.write_bytes(fs, L.join(root, index_rel), index)
    manifest = {
        "format": "eaglenest-store",
        "layout": L.LAYOUTS[prov.store_encoding],
        "encoding": prov.store_encoding,
        "schema_version": L.STORE_SCHEMA_VERSION,
        "version": version,
        "parent": parent,
        "created_at": old["created_at"] if old else datetime.now(UTC).isoformat(timespec="microseconds"),
        "extraction": Path(extraction_dir).name,
        "provenance": json.loads(prov.to_json()),
        "dtypes": DTYPES[prov.store_encoding],
        "num_samples": len(cols["sample_id"]),
        "num_tokens": int(sum(cols["num_tokens"])),
        "loss_tokens": int(sum(cols["loss_tokens"])),
        "index": {"path": index_rel, "bytes": len(index), "sha256": hashlib.sha256(index).hexdigest()},
        "files": files,
    }
    _write_manifest(fs, root, version, manifest)
    return manifest


def _ls(fs: fsspec.AbstractFileSystem, folder: str) -> dict[str, dict]:
    try:
        return {info["name"].rstrip("/"): info for info in fs.ls(folder, detail=True) if info["type"] == "file"}
    except FileNotFoundError:
        return {}


def _read_json(fs, path: str) -> dict | None:
    try:
        with fs.open(path, "rb") as f:
            return json.loads(f.read())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None  # absent or garbled: this run writes it (again)
