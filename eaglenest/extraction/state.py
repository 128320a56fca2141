"""Extraction, end to end, for a plain Python caller: prompts -> samples -> capture -> validated ledger.

Owns the extraction folder (layout shared with the store and training stages)::

    <output_dir>/<extraction_id>/
      extraction.json   identity of the request (a resume with other content-defining params is refused)
      prepare.json      written after samples.parquet: the samples' content key, skipped and bad records
      samples.parquet   tokenized samples (eaglenest.data.samples)
      answers.jsonl     every answer the target generated, as it arrived (append-only, torn tail ignored)
      regenerated.jsonl samples rebuilt from the target's own answers, and regeneration's skips (same)
      lock              held (flock) by the one process running this extraction: its pid and command line
      provenance.json   the run's pinned provenance (every later shard and resume must match it)
      capture/          shards, one per sample id (written by the servers)
      ledger.jsonl      one entry per VALIDATED sample (eaglenest.extraction.ledger)
      quarantine/       invalid shards + <name>.reason.json
      logs/, servers.json, report.json

The steps (:func:`open_extraction`, :func:`prepare`, :func:`plan`, :func:`connect`,
:func:`regenerate_batch`, :func:`prefill_batch`, :func:`validate_step`, and
:func:`~eaglenest.extraction.report.write_report`) are what the Prefect tasks wrap; :func:`run_extraction`
(in :mod:`eaglenest.extraction.run`) composes them.

Invariants: a sample is done only when its ledger entry exists (appended after validation); a re-run
plans only samples without one (zero requests when complete); a shard already present for a pending
sample is validated instead of re-requested (so nothing answered before a kill is asked for twice);
skipped and bad records are counted, never sent; a persisted answer is never asked for again; one
process at a time runs an extraction (a second one is refused, naming the holder); a bad source or
model is refused before any folder is created.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from eaglenest import contract
from eaglenest import models as model_lib
from eaglenest.atomic import atomic_write_bytes, clean_temporaries
from eaglenest.data.chat import ChatEncoder, Skipped, build_samples
from eaglenest.data.samples import Sample, read_samples, write_samples
from eaglenest.data.sources import BadRecord, SourceError, detect_format, read_records, source_fingerprint
from eaglenest.extraction.config import ExtractParams
from eaglenest.extraction.ledger import Ledger

PREPARE_VERSION = 1


class ExtractionError(RuntimeError):
    """The extraction cannot proceed as asked (terminal: the message says what to change)."""


class ConfigChanged(ExtractionError):
    """A resume asked for different content than the extraction folder holds."""


class ExtractionBusy(ExtractionError):
    """Another process is running this extraction."""


@dataclass
class Extraction:
    """An opened extraction folder and what the model says about it."""

    params: ExtractParams
    id: str
    dir: Path
    model_dir: Path
    num_layers: int
    hidden_size: int
    context_length: int
    aux_layer_ids: tuple[int, ...]
    fingerprint: dict[str, str]
    source_key: str
    """The source's content fingerprint (read once: hashing a large local file is not free)."""
    ledger: Ledger = field(init=False)

    def __post_init__(self) -> None:
        self.ledger = Ledger(self.dir)

    @property
    def capture_dir(self) -> Path:
        return self.ledger.capture_dir

    def path(self, name: str) -> Path:
        return self.dir / name

    @property
    def token_limit(self) -> int:
        """Most tokens a sample may have: context minus headroom (and max_tokens when given)."""
        limit = self.context_length - self.params.context_headroom
        return min(limit, self.params.max_tokens) if self.params.max_tokens else limit

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the extraction for this process: a second run of it at once would send every request and
        write every ledger entry twice. Refused naming the holder; the lock dies with its process."""
        path = self.path("lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
                raise ExtractionBusy(f"extraction {self.id} in {self.dir} is being run by {holder}; wait for it "
                                     "to end (or stop it), then run the same command again to resume") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} ({' '.join(sys.argv)[:300]})\n".encode(), 0)
            yield
        finally:
            os.close(fd)  # releases the flock


def write_json(path: Path, data: dict) -> None:
    """A JSON file of the extraction folder, written atomically."""
    atomic_write_bytes(path, json.dumps(data, indent=1, sort_keys=True, default=str).encode())


def check_source(params: ExtractParams) -> str:
    """The source's content fingerprint; a missing source, an unknown protocol or format is refused here,
    before anything is created."""
    try:
        detect_format(params.source, params.source_format)
        return source_fingerprint(params.source)
    except SourceError as e:
        raise ExtractionError(f"source: {e}") from None
    except (ValueError, ImportError, OSError) as e:  # fsspec: unknown protocol, missing backend, bad URL
        raise ExtractionError(f"source {params.source!r} cannot be read: {e}") from None


def open_extraction(params: ExtractParams) -> Extraction:
    """Check the source and the model, create or reopen the folder, refuse a changed request, clean
    temporaries."""
    source_key = check_source(params)
    model_dir = model_lib.resolve_model(params.model)
    cfg = model_lib.load_config(model_dir)
    layers, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    ctx = int(cfg.get("max_position_embeddings") or 0) or 1 << 30
    aux = contract.check_aux_layer_ids(
        params.aux_layer_ids if params.aux_layer_ids is not None else contract.default_aux_layer_ids(layers), layers)
    ext = Extraction(params=params, id=params.resolved_extraction_id(),
                     dir=Path(params.output_path).expanduser().resolve() / params.resolved_extraction_id(),
                     model_dir=model_dir, num_layers=layers, hidden_size=hidden, context_length=ctx,
                     aux_layer_ids=aux, fingerprint=model_lib.model_fingerprint(model_dir), source_key=source_key)
    ext.capture_dir.mkdir(parents=True, exist_ok=True)
    clean_temporaries(ext.capture_dir)
    clean_temporaries(ext.dir)
    identity = {**params.identity(), "model": ext.fingerprint["model_hash"], "aux_layer_ids": list(aux)}
    meta_path = ext.path("extraction.json")
    if meta_path.is_file():
        before = json.loads(meta_path.read_text()).get("identity", {})
        diff = sorted(k for k in set(before) | set(identity) if before.get(k) != identity.get(k))
        if diff:
            detail = "; ".join(f"{k}: {before.get(k)!r} -> {identity.get(k)!r}" for k in diff)
            raise ConfigChanged(f"extraction {ext.id} in {ext.dir} was made with other settings ({detail}); "
                                "use another extraction_id (or the original settings) to resume")
    else:
        write_json(meta_path, {"extraction_id": ext.id, "identity": identity, "created": time.time()})
    return ext


# ------------------------------------------------------------------------------ prepare
@dataclass
class Prepared:
    samples: list[Sample]
    skipped: list[Skipped]
    bad: list[BadRecord]
    key: str
    """Content key: source content, tokenizer, template, limits."""
    reused: bool = False


def partition_of(record_id: str, count: int) -> int:
    """The part (0 .. count-1) a record belongs to when a source is split over nodes: a stable hash of its id,
    so every node computes the same split without talking to the others."""
    return int.from_bytes(hashlib.sha256(record_id.encode()).digest()[:8], "big") % count


def prepare_key(ext: Extraction) -> str:
    p = ext.params
    key = {"v": PREPARE_VERSION, "source": ext.source_key, "format": p.source_format,
           "limit": p.limit, "max_turns": p.max_turns, "tokenizer": ext.fingerprint["tokenizer_hash"],
           "template": ext.fingerprint["chat_template_hash"], "token_limit": ext.token_limit,
           "regenerate": p.regeneration.enabled,
           **({"partition": [p.partition_index, p.partition_count]} if p.partition_count > 1 else {}),
           **({"self_prompts": p.self_prompts.identity()} if p.self_prompts.count else {})}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def prepare(ext: Extraction, *, encoder: ChatEncoder | None = None) -> Prepared:
    """Read the source (after the target's own prompts, when asked for) and tokenize it once; a later call with
    the same content key reuses the files."""
    key = prepare_key(ext)
    manifest, samples_path = ext.path("prepare.json"), ext.path("samples.parquet")
    if manifest.is_file() and samples_path.is_file():
        meta = json.loads(manifest.read_text())
        if meta.get("key") == key:
            return Prepared(read_samples(samples_path), [Skipped(**s) for s in meta["skipped"]],
                            [BadRecord(**b) for b in meta["bad"]], key, reused=True)
    p = ext.params
    source = read_records(p.source, fmt=p.source_format, limit=p.limit)
    records = source.records
    if p.self_prompts.count:  # the target's own prompts first (ask_for_extraction wrote them)
        own = ext.path(SELF_PROMPTS)
        if not own.is_file():
            raise ExtractionError(f"{own}: the self prompts are not written yet (run_extraction asks for them first)")
        records = read_records(str(own)).records + records
    if p.partition_count > 1:
        records = [r for r in records if partition_of(r.id, p.partition_count) == p.partition_index]
    encoder = encoder or ChatEncoder(ext.model_dir)
    samples, skipped = build_samples(records, encoder, max_tokens=ext.token_limit,
                                     regenerate=p.regeneration.enabled, max_turns=p.max_turns)
    if not samples:
        raise ExtractionError(_nothing_usable(p.source, len(records), skipped, source.bad))
    write_samples(samples_path, samples)
    write_json(manifest, {"key": key, "samples": len(samples), "skipped": [asdict(s) for s in skipped],
                          "bad": [asdict(b) for b in source.bad], "source_exhausted": source.exhausted})
    return Prepared(samples, skipped, source.bad, key)


def _nothing_usable(source: str, records: int, skipped: Sequence[Skipped], bad: Sequence[BadRecord]) -> str:
    if not records and not bad:
        return f"source {source!r} holds no records: nothing to extract (give a non-empty source)"
    kinds: dict[str, int] = {}
    for s in skipped:
        kinds[s.kind] = kinds.get(s.kind, 0) + 1
    why = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    example = f"; first bad record: {bad[0].reason}" if bad else ""
    return (f"source {source!r} gave no usable sample: {records} records ({why or 'none kept'}), "
            f"{len(bad)} bad{example}")


# ------------------------------------------------------------------------------ persisted answers
class JsonlLog:
    """An append-only JSON-lines file. Each write reaches the OS at once (a killed process loses nothing it
    wrote); a thread of its own fsyncs it every ``fsync_s`` while there is something new, and close() does
    once more (a machine crash loses at most about that much).

    The fsync never runs on the writer's thread: the writer is the extraction's event loop, and an fsync
    may wait behind the shard writes on the same disk, during which no request would be sent or answered."""

    def __init__(self, path: Path, *, fsync_s: float = 0.5) -> None:
        self.path, self.fsync_s = path, fsync_s
        self._lock = threading.Lock()
        self._f = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        if self._f.tell() > 0:
            with open(path, "rb") as r:
                r.seek(-1, os.SEEK_END)
                if r.read(1) != b"\n":  # a torn last line from a crash: start on a fresh one
                    self._f.write("\n")
        self._dirty = threading.Event()
        self._closing = threading.Event()
        self._syncer = threading.Thread(target=self._sync_loop, name=f"fsync-{path.name}", daemon=True)
        self._syncer.start()

    def write(self, rows: Iterable[dict]) -> None:
        text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows)
        if not text:
            return
        with self._lock:
            self._f.write(text)
            self._f.flush()
        self._dirty.set()

    def _sync_loop(self) -> None:
        while not self._closing.is_set():
            self._dirty.wait()
            if self._closing.is_set():
                return
            self._dirty.clear()
            with contextlib.suppress(OSError, ValueError):  # closed meanwhile: close() syncs
                os.fsync(self._f.fileno())
            self._closing.wait(self.fsync_s)

    def close(self) -> None:
        self._closing.set()
        self._dirty.set()
        self._syncer.join()
        with self._lock:
            if not self._f.closed:
                self._f.flush()
                os.fsync(self._f.fileno())
                self._f.close()

    def __enter__(self) -> JsonlLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def read(path: Path) -> Iterator[dict]:
        """Every complete line (a torn last line is ignored; an unparsable one is skipped)."""
        if not path.is_file():
            return
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.endswith("\n"):
                    break
                with contextlib.suppress(ValueError):
                    d = json.loads(line)
                    if isinstance(d, dict):
                        yield d


ANSWERS, REGENERATED = "answers.jsonl", "regenerated.jsonl"
SELF_PROMPTS = "self-prompts.jsonl.xz"
"""The prompts the target wrote for this extraction (ExtractParams.self_prompts), read before the source."""


def load_answers(ext: Extraction) -> dict[tuple[str, int], dict]:
    """(sample id, turn) -> the persisted answer (as written by the regeneration's ``on_answer``)."""
    return {(d["sample_id"], d["turn"]): d for d in JsonlLog.read(ext.path(ANSWERS))
            if isinstance(d.get("sample_id"), str) and isinstance(d.get("turn"), int)}


def load_regenerated(ext: Extraction) -> tuple[dict[str, Sample], dict[str, Skipped]]:
    """Samples already rebuilt from the target's answers, and those regeneration skipped."""
    from eaglenest.data.samples import messages_from_json

    out, skipped = {}, {}
    for d in JsonlLog.read(ext.path(REGENERATED)):
        try:
            if "skipped" in d:
                skipped[d["sample_id"]] = Skipped(**d["skipped"])
                continue
            out[d["sample_id"]] = Sample(
                sample_id=d["sample_id"], input_ids=d["input_ids"], loss_spans=d["loss_spans"],
                messages=messages_from_json(d["messages"]), regenerated=True,
                source_index=d["source_index"], meta=d["meta"])
        except (ValueError, KeyError, TypeError):
            continue
    return out, skipped


def regenerated_row(item: Sample | Skipped) -> dict:
    """The ``regenerated.jsonl`` line of a finished sample or of regeneration's skip decision."""
    from eaglenest.data.samples import messages_to_json

    if isinstance(item, Skipped):
        return {"sample_id": item.sample_id, "skipped": asdict(item)}
    s = item
    return {"sample_id": s.sample_id, "input_ids": s.input_ids.tolist(), "loss_spans": [list(x) for x in s.loss_spans],
            "messages": messages_to_json(s.messages), "source_index": s.source_index, "meta": s.meta}


# ------------------------------------------------------------------------------ plan
def plan(ext: Extraction, prepared: Prepared) -> list[Sample]:
    """The samples the ledger does not hold (their regenerated versions where those exist), minus those
    regeneration skipped."""
    done = ext.ledger.done_ids()
    regen, regen_skipped = load_regenerated(ext) if ext.params.regeneration.enabled else ({}, {})
    return [regen.get(s.sample_id, s) for s in prepared.samples
            if s.sample_id not in done and s.sample_id not in regen_skipped]
