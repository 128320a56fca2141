"""Input side of conversion: check an extraction's shards, then load them without copying tensors.

Owns how the converter reads shards. Invariants:

- A shard is used only if its bytes hash to the ledger's sha256 (the very bytes validation passed,
  finite values included) and it satisfies the capture contract: schema version, sample id, T equal to
  the ledger's, shapes/dtypes (:meth:`eaglenest.contract.Shard.check`), provenance equal to the store's
  (``model_path`` aside: it is machine-local).
- Shards are memory-mapped (private, copy-on-write) and decoded in place: hashing reads the page cache
  directly and tensors are views of the map, so a shard's bytes are never copied before the Arrow write.
  The format is the contract's shard v1 (safetensors: 8-byte header length, JSON header, raw tensors).
- Mixed schema versions or provenances are refused by a header-only pass before anything is written.
- Samples still pending in the extraction are counted (:func:`pending_samples`) so that the converter can
  refuse a partial store unless asked for one.
"""

from __future__ import annotations

import hashlib
import json
import mmap
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eaglenest.contract import SCHEMA_VERSION, ContractError, Provenance, Shard, UnknownSchemaVersion
from eaglenest.extraction.ledger import LedgerEntry
from eaglenest.store.layout import ConvertInputError

PREFETCH_BYTES = 256 << 20
_DTYPES = {"I32": torch.int32, "BF16": torch.bfloat16}
_TENSORS = ("input_ids", "aux_hidden", "final_hidden")


def check_inputs(capture_dir: Path, entries: Sequence[LedgerEntry]) -> Provenance:
    """Header pass over every shard: present, known schema version, one provenance. Reads no tensors."""
    first: tuple[Path, Provenance] | None = None
    for e in entries:
        path = capture_dir / e.shard
        if not path.is_file():
            raise ConvertInputError(
                f"ledger lists sample {e.sample_id!r} but its shard {path} is missing; re-run the extraction"
            )
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
        except Exception as exc:  # safetensors raises its own error types
            raise ConvertInputError(f"{path}: unreadable shard header ({exc}); re-run the extraction") from None
        if meta.get("schema_version") != str(SCHEMA_VERSION):
            raise UnknownSchemaVersion(
                f"{path}: shard schema_version {meta.get('schema_version')!r}, this eaglenest converts "
                f"{SCHEMA_VERSION}; mixed schema versions cannot share a store: re-extract with one version"
            )
        prov = Provenance.from_json(meta.get("provenance", "{}"))
        if first is None:
            first = (path, prov)
        else:
            diff = first[1].mismatches(prov)  # model_path is machine-local: servers on other hosts differ
            if diff:
                raise ContractError(
                    f"{path}: provenance differs from {first[0]} in {diff}; one store holds one provenance: "
                    "convert each capture setup into its own store"
                )
    if first is None:
        raise ConvertInputError("no shards to convert")
    return first[1]


def pending_samples(extraction_dir: str | Path, ledger_ids: set[str]) -> tuple[int, int] | None:
    """(pending, total) samples of an extraction, or None for a folder that is not a pipeline extraction.

    The extraction's ``report.json`` (written at the end of each run) counts them; samples validated after it
    was written (a later run killed before its report) are taken off. Without a report (the first run was
    killed), the prepared ``samples.parquet`` minus the ledger is the count (skips included: an upper bound).
    """
    folder = Path(extraction_dir)
    try:
        report = json.loads((folder / "report.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        report = None  # absent, or torn by a crash mid-write of an older eaglenest: count from the samples
    if isinstance(report, dict) and isinstance(report.get("pending"), int) and isinstance(report.get("done"), int):
        newer = max(0, len(ledger_ids) - report["done"])
        return max(0, report["pending"] - newer), int(report.get("samples", len(ledger_ids)))
    samples = folder / "samples.parquet"
    if samples.is_file():
        import pyarrow.parquet as pq

        ids = set(pq.read_table(samples, columns=["sample_id"]).column("sample_id").to_pylist())
        return len(ids - ledger_ids), len(ids)
    return None


def check_pending(extraction_dir: str | Path, entries: Sequence[LedgerEntry], *, partial: bool) -> int:
    """How many samples are pending; refuses (ConvertInputError, with the counts) unless ``partial``."""
    counts = pending_samples(extraction_dir, {e.sample_id for e in entries})
    pending = counts[0] if counts else 0
    if pending and not partial:
        raise ConvertInputError(
            f"{extraction_dir}: {pending} of {counts[1]} samples are still pending (not captured and validated); "
            "finish the extraction (re-run the same extract command to resume) or convert the "
            f"{len(entries)} validated samples anyway with --partial"
        )
    return pending


def decode_mapped(buf: mmap.mmap, where: str) -> Shard:
    """contract.decode_shard over a writable buffer, tensors as views of it (no copy)."""
    view = memoryview(buf)
    if len(view) < 8:
        raise ContractError(f"{where}: truncated (size {len(view)} bytes)")
    n = int.from_bytes(view[:8], "little")
    if n <= 0 or 8 + n > len(view):
        raise ContractError(f"{where}: truncated or garbage header (header length {n})")
    try:
        header = json.loads(bytes(view[8 : 8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ContractError(f"{where}: garbage header ({e})") from None
    meta = header.pop("__metadata__", None) or {}
    if meta.get("schema_version") != str(SCHEMA_VERSION):
        raise UnknownSchemaVersion(
            f"{where}: schema_version {meta.get('schema_version')!r} is not supported (this eaglenest reads "
            f"{SCHEMA_VERSION})"
        )
    base = torch.frombuffer(buf, dtype=torch.uint8)
    tensors = {}
    for name in _TENSORS:
        info = header.get(name)
        if not isinstance(info, dict) or info.get("dtype") not in _DTYPES:
            raise ContractError(f"{where}: tensor {name} missing or of an unexpected dtype")
        dtype = _DTYPES[info["dtype"]]
        start, stop = (8 + n + int(o) for o in info["data_offsets"])
        if not 8 + n <= start <= stop <= len(view):
            raise ContractError(f"{where}: tensor {name} lies outside the file")
        raw = base[start:stop]
        if start % dtype.itemsize:
            raw = raw.clone()  # unaligned (never seen from safetensors): copy rather than fail
        try:
            tensors[name] = raw.view(dtype).view(info["shape"])
        except RuntimeError as e:
            raise ContractError(f"{where}: tensor {name} bytes do not match its shape ({e})") from None
    extra = {k: v for k, v in meta.items() if k not in ("schema_version", "sample_id", "provenance")}
    shard = Shard(sample_id=meta.get("sample_id", ""), provenance=Provenance.from_json(meta.get("provenance", "{}")),
                  extra=extra, **tensors)
    shard.check()
    return shard


def map_shard(path: Path) -> mmap.mmap:
    """A shard file mapped copy-on-write (tensors decoded from it are views of the page cache and may be written
    to without touching the file). Raises ContractError for an empty file (it cannot be mapped)."""
    try:
        with open(path, "rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except ValueError:
        raise ContractError(f"{path}: empty shard file") from None


def load_shard(capture_dir: Path, entry: LedgerEntry, provenance: Provenance) -> Shard:
    """Map, hash against the ledger, decode in place and check one shard."""
    path = capture_dir / entry.shard
    try:
        buf = map_shard(path)
    except FileNotFoundError:
        raise ConvertInputError(f"shard {path} of sample {entry.sample_id!r} vanished during conversion") from None
    if hashlib.sha256(buf).hexdigest() != entry.sha256:
        raise ConvertInputError(
            f"{path}: sha256 differs from the ledger entry of {entry.sample_id!r} (changed after validation); "
            "re-validate it (re-run the extraction) before converting"
        )
    shard = decode_mapped(buf, str(path))
    if shard.sample_id != entry.sample_id or shard.num_tokens != entry.num_tokens:
        raise ConvertInputError(
            f"{path}: holds sample {shard.sample_id!r} with {shard.num_tokens} tokens, ledger says "
            f"{entry.sample_id!r} with {entry.num_tokens}"
        )
    provenance.require_match(shard.provenance, what=f"shard {path}")
    return shard


def _load(capture_dir: Path, group: list[LedgerEntry], provenance: Provenance,
          transform: Callable[[list[tuple[LedgerEntry, Shard]]], list[Any]] | None) -> list[Any]:
    loaded = [(e, load_shard(capture_dir, e, provenance)) for e in group]
    return [shard for _, shard in loaded] if transform is None else transform(loaded)


def group_entries(entries: Sequence[LedgerEntry], group_bytes: int) -> list[list[LedgerEntry]]:
    """Greedy packing in order: a group of consecutive entries closes once it holds ``group_bytes`` of shards
    (0: one entry each)."""
    out, cur, size = [], [], 0
    for e in entries:
        cur.append(e)
        size += e.bytes
        if size >= group_bytes:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out


def prefetch_shards(capture_dir: Path, entries: list[LedgerEntry], provenance: Provenance, *,
                    transform: Callable[[list[tuple[LedgerEntry, Shard]]], list[Any]] | None = None,
                    workers: int = 1, group_bytes: int = 0) -> Iterator[tuple[LedgerEntry, Any]]:
    """Load shards in order on helper threads, up to PREFETCH_BYTES ahead (hashing releases the GIL).

    transform: applied on a helper thread to each group of loaded shards, ``[(entry, shard), ...]`` -> one result
    per shard (the converter builds the samples' columns there, fp8 encoding included, while the caller writes
    the previous ones); yields ``(entry, result)`` in order (``(entry, shard)`` without a transform).
    workers: helper threads (more than one where the transform is CPU work: torch ops release the GIL).
    group_bytes: consecutive shards go to one helper together until they hold this many bytes (0: one by one),
    for a transform that is cheaper per byte on several samples at once."""
    groups = group_entries(entries, group_bytes)
    sizes = [sum(e.bytes for e in g) for g in groups]
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="store-read")
    pending: deque[tuple[int, Future]] = deque()
    nxt, inflight = 0, 0
    try:
        while nxt < len(groups) or pending:
            while nxt < len(groups) and (not pending or inflight + sizes[nxt] <= PREFETCH_BYTES):
                pending.append((nxt, pool.submit(_load, capture_dir, groups[nxt], provenance, transform)))
                inflight += sizes[nxt]
                nxt += 1
            g, fut = pending.popleft()
            inflight -= sizes[g]
            yield from zip(groups[g], fut.result(), strict=True)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
