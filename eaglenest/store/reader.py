"""Reading a store: open a committed version by URL, get samples as zero-copy tensors, verify it.

Owns the read side. Invariants:

- Only committed versions are visible: a version is its ``manifest.json``; without one, nothing.
- Opening checks the manifest (format, schema version), the index (size, sha256, columns) and every
  data file's size: a truncated or missing file is a :class:`StoreCorrupt` at open, never partial rows.
- Each data file's sha256 is checked against the manifest the first time this process reads it (default on;
  ``check_sha256=False`` opts out): a byte flipped on storage after conversion fails the read naming the
  file, so nothing trains on it. A file whose identity (inode, size, mtime) and sha256 were checked once is
  not hashed again by later Stores of the same process.
- Sample i is one range of one data file (offset + length from the index): locally a slice of a private
  (copy-on-write) memory map, so tensors are views of the page cache and an accidental in-place write
  never reaches the file; remotely exactly that byte range is fetched, nothing else.
- A Store pickles without its memory maps (DataLoader workers map files again on first use).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import operator
import os
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import torch

from eaglenest.contract import Provenance, UnknownSchemaVersion
from eaglenest.store import layout as L
from eaglenest.store import storage
from eaglenest.store.encoding import Fp8States, StoreSample

_WILLNEED_MIN = 1 << 20
_CHECKED: set[tuple] = set()
"""(file identity, sha256) of data files whose bytes matched their manifest in this process."""


def _read(fs, path: str) -> bytes:
    try:
        return fs.cat_file(path)
    except FileNotFoundError:
        raise L.StoreCorrupt(f"{path} is missing; re-run `eaglenest store convert` to rebuild it") from None


def _parse_manifest(data: bytes, where: str) -> dict:
    try:
        m = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise L.StoreCorrupt(f"{where}: garbage manifest ({e}); re-run `eaglenest store convert`") from None
    if not isinstance(m, dict) or m.get("format") != "eaglenest-store":
        raise L.StoreCorrupt(f"{where}: not an eaglenest store manifest")
    encoding = m.setdefault("encoding", "bf16")  # manifests from before encodings are bf16
    if m.get("schema_version") != L.STORE_SCHEMA_VERSION or L.LAYOUTS.get(encoding) != m.get("layout"):
        known = ", ".join(f"{lay} ({enc})" for enc, lay in L.LAYOUTS.items())
        raise UnknownSchemaVersion(
            f"{where}: store schema_version {m.get('schema_version')!r} / layout {m.get('layout')!r} / encoding "
            f"{encoding!r} is not supported (this eaglenest reads {L.STORE_SCHEMA_VERSION} / {known}); "
            "upgrade eaglenest or re-convert"
        )
    missing = {"version", "created_at", "provenance", "index", "files", "num_samples"} - set(m)
    if missing:
        raise L.StoreCorrupt(f"{where}: manifest lacks {sorted(missing)}")
    return m


def list_versions(url: str, *, storage_options: dict | None = None) -> list[dict]:
    """Manifests of every committed version at ``url``, oldest first."""
    fs, root = storage.resolve(url, storage_options)
    found = []
    for path in fs.glob(L.join(root, L.VERSIONS_DIR, "*", L.MANIFEST_NAME)):
        found.append(_parse_manifest(_read(fs, path), path))
    return sorted(found, key=lambda m: (m["created_at"], m["version"]))


def open_store(
    url: str, *, verify: bool = False, check_sha256: bool = True, storage_options: dict | None = None,
    version: str | None = None,
) -> Store:
    """Open the latest committed version at ``url`` (or ``version``; a ``.../versions/<id>`` URL works too).

    verify: also run :meth:`Store.verify` (reads every byte) and raise StoreCorrupt listing the problems.
    check_sha256: sha256-check each data file against the manifest the first time this process reads it
    (costs one extra pass over each file, at hashing speed; off only for stores you trust).
    """
    store = _open(url, storage_options, version, check_sha256=check_sha256, check_sizes=True)
    if verify:
        problems = store.verify()
        if problems:
            raise L.StoreCorrupt(f"store {url} failed verification:\n  " + "\n  ".join(problems))
    return store


def _open(url: str, storage_options: dict | None, version: str | None, *, check_sha256: bool,
          check_sizes: bool) -> Store:
    fs, root = storage.resolve(url, storage_options)
    parts = root.rsplit("/", 2)
    if version is None and len(parts) == 3 and parts[1] == L.VERSIONS_DIR:
        root, version = parts[0], parts[2]
    if version is None:
        paths = fs.glob(L.join(root, L.VERSIONS_DIR, "*", L.MANIFEST_NAME))
        manifests = [_parse_manifest(_read(fs, p), p) for p in paths]
        if not manifests:
            raise L.StoreNotFound(
                f"no committed store at {url} (no {L.VERSIONS_DIR}/*/{L.MANIFEST_NAME}); "
                "convert an extraction with `eaglenest store convert`"
            )
        manifest = max(manifests, key=lambda m: (m["created_at"], m["version"]))
    else:
        path = L.version_path(root, version, L.MANIFEST_NAME)
        if not fs.exists(path):
            raise L.StoreNotFound(f"store version {version} at {url} is not committed (no {path})")
        manifest = _parse_manifest(_read(fs, path), path)
    return Store(url, fs, root, manifest, check_sha256=check_sha256, check_sizes=check_sizes)


class Store:
    """One committed store version. Indexable: ``store[i]`` -> :class:`StoreSample`."""

    def __init__(self, url: str, fs, root: str, manifest: dict, *, check_sha256: bool = True,
                 check_sizes: bool = True) -> None:
        self.url = url
        self.check_sha256 = check_sha256
        self.fs = fs
        self.root = root
        self.manifest = manifest
        self.encoding: str = manifest["encoding"]
        self.provenance = Provenance.from_json(manifest["provenance"])
        self._check_encodings()
        self._schema = L.data_schema(self.provenance)
        self._local = storage.is_local(fs)
        self._paths = [L.join(root, f["path"]) for f in manifest["files"]]
        index_path = L.join(root, manifest["index"]["path"])
        data = _read(fs, index_path)
        expect = manifest["index"]
        if len(data) != expect["bytes"] or hashlib.sha256(data).hexdigest() != expect["sha256"]:
            raise L.StoreCorrupt(f"{index_path}: size or sha256 differs from the manifest; re-run convert")
        idx = L.decode_index(data, index_path)
        self.sample_ids: list[str] = idx["sample_id"]
        self.shard_sha256: list[str] = idx["shard_sha256"]
        self.num_tokens: np.ndarray = idx["num_tokens"]
        self.loss_tokens: np.ndarray = idx["loss_tokens"]
        self._file, self._batch = idx["file"], idx["batch"]
        self._offset, self._length = idx["offset"], idx["length"]
        if len(self.sample_ids) != manifest["num_samples"] or (
            len(self._file) and (self._file.min() < 0 or self._file.max() >= len(self._paths))
        ):
            raise L.StoreCorrupt(f"{index_path}: index disagrees with the manifest (sample count or file numbers)")
        if check_sizes and (problems := self._size_problems()):
            raise L.StoreCorrupt(problems[0])
        self._maps: dict[int, tuple] = {}
        self._by_id: dict[str, int] | None = None

    # ------------------------------------------------------------ basics

    def __len__(self) -> int:
        return len(self.sample_ids)

    def __repr__(self) -> str:
        return f"Store({self.url!r}, version={self.manifest['version']}, samples={len(self)})"

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_maps"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def _check_encodings(self) -> None:
        """One version holds one encoding: its provenance and every file record must say the manifest's."""
        where = L.version_path(self.root, self.manifest["version"], L.MANIFEST_NAME)
        if self.provenance.store_encoding != self.encoding:
            raise L.StoreCorrupt(f"{where}: encoding {self.encoding!r} but its provenance says "
                                 f"{self.provenance.store_encoding!r}; re-convert the extraction")
        other = [f"{f['path']} ({f.get('encoding', 'bf16')})" for f in self.manifest["files"]
                 if f.get("encoding", "bf16") != self.encoding]
        if other:
            raise L.StoreCorrupt(
                f"{where}: mixed encodings in one version: the version is {self.encoding} but lists "
                f"{', '.join(other[:3])}{' ...' if len(other) > 3 else ''}; a version holds one encoding: convert "
                "the extraction again into a fresh store with one --encoding"
            )

    def _size_problems(self) -> list[str]:
        """One line per data file that is missing or whose size differs from the manifest."""
        folder = L.join(self.root, L.DATA_DIR)
        try:
            sizes = {i["name"].rstrip("/"): int(i["size"]) for i in self.fs.ls(folder, detail=True)}
        except FileNotFoundError:
            sizes = {}
        problems = []
        for path, f in zip(self._paths, self.manifest["files"], strict=True):
            got = sizes.get(path)
            if got != f["bytes"]:
                what = "missing" if got is None else f"{got} bytes, manifest says {f['bytes']} (truncated or replaced)"
                problems.append(f"data file {path} is {what}; {self._remedy()}")
        return problems

    def _remedy(self) -> str:
        return (f"re-run `eaglenest store convert <extraction> {self.url} --rehash` to quarantine and rebuild it "
                f"(`eaglenest store verify {self.url}` lists every bad file)")

    def _identity(self, f: int) -> tuple:
        path = self._paths[f]
        if self._local:
            st = os.stat(path)
            return (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        return (str(self.fs.protocol), path, self.manifest["files"][f]["bytes"])

    def _check_sha256(self, f: int, data=None) -> None:
        """Hash data file f (``data``: its mapped bytes; else streamed) unless this process already did."""
        if not self.check_sha256:
            return
        want = self.manifest["files"][f]["sha256"]
        key = (self._identity(f), want)
        if key in _CHECKED:
            return
        got = hashlib.sha256(data).hexdigest() if data is not None else storage.sha256_file(self.fs, self._paths[f])[1]
        if got != want:
            raise L.StoreCorrupt(f"data file {self._paths[f]}: sha256 {got[:16]}... differs from the manifest's "
                                 f"{want[:16]}... (its bytes changed after conversion); {self._remedy()}")
        _CHECKED.add(key)

    def _remember_checked(self, f: int) -> None:
        """Data file f was just hashed and matched its manifest: its first read need not hash it again."""
        _CHECKED.add((self._identity(f), self.manifest["files"][f]["sha256"]))

    def get(self, sample_id: str) -> StoreSample:
        if self._by_id is None:
            self._by_id = {s: i for i, s in enumerate(self.sample_ids)}
        try:
            return self[self._by_id[sample_id]]
        except KeyError:
            version = self.manifest["version"]
            raise KeyError(f"sample {sample_id!r} is not in store {self.url} (version {version})") from None

    def __getitem__(self, i: int) -> StoreSample:
        i = operator.index(i)
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample index {i} out of range for a store of {n} samples")
        i %= n
        f, off, ln = int(self._file[i]), int(self._offset[i]), int(self._length[i])
        base, base_addr, msg_buf = self._region(f, off, ln)
        try:
            batch = pa.ipc.read_record_batch(pa.ipc.read_message(msg_buf), self._schema)
            if batch.num_rows != self.num_tokens[i]:
                raise ValueError(f"{batch.num_rows} rows, index says {self.num_tokens[i]}")
            c = L.batch_tensors(batch, base, base_addr)
        except (pa.ArrowException, ValueError, OSError) as e:
            raise L.StoreCorrupt(
                f"{self._paths[f]}: sample {self.sample_ids[i]!r} (bytes {off}..{off + ln}) is unreadable ({e}); "
                "run `eaglenest store verify` and re-convert"
            ) from None
        if self.encoding == "fp8":
            return StoreSample(self.sample_ids[i], c["input_ids"], c["loss_mask"],
                               fp8=Fp8States(c["aux_hidden"], c["aux_scale"], c["final_hidden"], c["final_scale"]))
        return StoreSample(self.sample_ids[i], c["input_ids"], c["loss_mask"], c["aux_hidden"], c["final_hidden"])

    def prefetch(self, indices) -> None:
        """Local stores: start reading these samples' bytes in the background (MADV_WILLNEED), so that a
        batch read in random order keeps several disk reads in flight. Remote stores: nothing to do."""
        if not self._local:
            return
        indices = list(indices)
        new = sorted({int(self._file[i]) for i in indices} - self._maps.keys())
        if len(new) > 1:  # first reads of several files: map (and sha256-check) them side by side
            with ThreadPoolExecutor(min(len(new), os.cpu_count() or 1), thread_name_prefix="store-map") as pool:
                list(pool.map(self._mapped, new))
        for i in indices:
            f, off, ln = int(self._file[i]), int(self._offset[i]), int(self._length[i])
            mm = self._mapped(f)[0]
            start = off - off % mmap.PAGESIZE
            with contextlib.suppress(OSError, AttributeError):
                mm.madvise(mmap.MADV_WILLNEED, start, off + ln - start)

    def _region(self, f: int, off: int, ln: int) -> tuple[torch.Tensor, int, pa.Buffer]:
        if not self._local:
            if f not in self._maps:  # first use of this file: check its magic (two tiny range reads), sha256
                path = self._paths[f]
                size = self.manifest["files"][f]["bytes"]
                self._check_magic(f, self.fs.cat_file(path, start=0, end=6),
                                  self.fs.cat_file(path, start=size - 6, end=size))
                self._check_sha256(f)
                self._maps[f] = ()
            data = bytearray(self.fs.cat_file(self._paths[f], start=off, end=off + ln))
            buf = pa.py_buffer(data)
            return torch.frombuffer(data, dtype=torch.uint8), buf.address, buf
        mm, base, buf = self._mapped(f)
        if ln >= _WILLNEED_MIN and hasattr(mm, "madvise"):
            start = off - off % mmap.PAGESIZE
            with contextlib.suppress(OSError):
                mm.madvise(mmap.MADV_WILLNEED, start, off + ln - start)
        return base, buf.address, buf.slice(off, ln)

    def _check_magic(self, f: int, head: bytes, tail: bytes) -> None:
        if head != b"ARROW1" or tail != b"ARROW1":
            raise L.StoreCorrupt(f"{self._paths[f]}: garbage header or trailer (no Arrow IPC file magic); "
                                 "run `eaglenest store convert --rehash` to quarantine and rebuild it")

    def _mapped(self, f: int) -> tuple:
        m = self._maps.get(f)
        if m is not None:
            return m
        path = self._paths[f]
        with open(path, "rb") as fh:
            try:  # private copy-on-write map: writable views, writes never reach the file
                mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
            except OSError:  # e.g. a commit limit on a huge file: fall back to a read-only map
                mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only fallback map
            base = torch.frombuffer(mm, dtype=torch.uint8)
        buf = pa.py_buffer(mm)
        self._check_magic(f, bytes(mm[:6]), bytes(mm[-6:]))
        self._check_sha256(f, mm)
        try:
            schema = pa.ipc.open_file(buf).schema
        except (pa.ArrowException, OSError) as e:
            raise L.StoreCorrupt(
                f"{path}: not a readable Arrow IPC file ({e}); re-run `eaglenest store convert --rehash`"
            ) from None
        if not schema.equals(self._schema, check_metadata=True):
            if (enc := L.schema_encoding(schema)) != self.encoding:
                raise L.StoreCorrupt(f"{path}: holds {enc} states but the version is {self.encoding}: mixed encodings "
                                     "in one version are refused; convert the extraction again into a fresh store "
                                     "with one --encoding")
            raise L.StoreCorrupt(f"{path}: schema differs from the store's (k*H, H or provenance); re-convert")
        self._maps[f] = (mm, base, buf)
        return self._maps[f]

    # ------------------------------------------------------------ checks and bookkeeping

    def verify(self) -> list[str]:
        """Every problem found (empty when fine): sizes, sha256, and index <-> data consistency."""
        from eaglenest.store.verify import verify  # verify.py builds on this module

        return verify(self)

    def file_records(self) -> list[dict]:
        """Per data file: key, bytes, sha256 and index rows (what the converter's sidecars hold)."""
        out = []
        for f, rec in enumerate(self.manifest["files"]):
            rows = [dict(sample_id=self.sample_ids[i], offset=int(self._offset[i]), length=int(self._length[i]),
                         num_tokens=int(self.num_tokens[i]), loss_tokens=int(self.loss_tokens[i]),
                         shard_sha256=self.shard_sha256[i]) for i in np.flatnonzero(self._file == f)]
            key = rec["path"].rsplit("/", 1)[-1].removesuffix(L.DATA_SUFFIX)
            out.append({"key": key, "bytes": rec["bytes"], "sha256": rec["sha256"], "rows": rows})
        return out

    def info(self) -> dict:
        m = self.manifest
        nbytes, tokens = sum(f["bytes"] for f in m["files"]), int(self.num_tokens.sum())
        return {"url": self.url, "version": m["version"], "parent": m.get("parent"), "created_at": m["created_at"],
                "extraction": m.get("extraction"), "samples": len(self), "tokens": tokens,
                "loss_tokens": int(self.loss_tokens.sum()), "files": len(self._paths), "bytes": nbytes,
                "encoding": self.encoding, "bytes_per_token": round(nbytes / max(tokens, 1), 1),
                "aux_layer_ids": list(self.provenance.aux_layer_ids),
                "hidden_size": self.provenance.hidden_size, "engine": self.provenance.engine,
                "model_path": self.provenance.model_path}
