"""The extraction ledger: which samples of an extraction are captured AND validated.

Owns the record that makes a sample "done". One ledger per extraction id, a JSON-lines file
``<extraction_dir>/ledger.jsonl``, append-only. An entry is appended only after the sample's shard
validated; it names the shard (file name inside ``<extraction_dir>/capture``), its sha256, token
counts and the loss mask as half-open spans of assistant tokens.

Invariants:
- Appends are flushed and fsynced per batch (:meth:`Ledger.append`), so an entry on disk means a
  validated, durable shard.
- A torn last line (a crash mid-append) is ignored on load: that sample is simply redone.
- A sample id appears at most once; a later entry for the same id (re-validation) replaces the
  earlier one on load.
- Resume = the samples not in the ledger (and a re-run of a complete extraction sends no request).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

LEDGER_NAME = "ledger.jsonl"
LEDGER_VERSION = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class LedgerEntry:
    sample_id: str
    shard: str
    """Shard file name inside the extraction's capture folder."""
    sha256: str
    bytes: int
    num_tokens: int
    loss_tokens: int
    loss_spans: tuple[tuple[int, int], ...] = ()
    """Half-open [start, end) token spans that carry loss (assistant tokens)."""
    regenerated: bool = False
    stats: dict = field(default_factory=dict)
    """Validation statistics (per-layer norms, argmax agreement, ...)."""
    version: int = LEDGER_VERSION

    def loss_mask(self) -> list[int]:
        return spans_to_mask(self.loss_spans, self.num_tokens)

    def to_json(self) -> str:
        d = asdict(self)
        d["loss_spans"] = [list(s) for s in self.loss_spans]
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict) -> LedgerEntry:
        if int(d.get("version", -1)) != LEDGER_VERSION:
            raise ValueError(f"ledger entry version {d.get('version')!r} is not supported")
        d = dict(d)
        d["loss_spans"] = tuple((int(a), int(b)) for a, b in d.get("loss_spans", ()))
        return cls(**d)


def mask_to_spans(mask: Sequence[int | bool]) -> tuple[tuple[int, int], ...]:
    """[0,1,1,0,1] -> ((1, 3), (4, 5))."""
    spans, start = [], None
    for i, m in enumerate(mask):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    if start is not None:
        spans.append((start, len(mask)))
    return tuple(spans)


def spans_to_mask(spans: Iterable[tuple[int, int]], length: int) -> list[int]:
    mask = [0] * length
    for a, b in spans:
        if not 0 <= a <= b <= length:
            raise ValueError(f"loss span [{a}, {b}) outside a sequence of {length} tokens")
        mask[a:b] = [1] * (b - a)
    return mask


class Ledger:
    """Append-only record of validated samples for one extraction folder."""

    def __init__(self, extraction_dir: str | Path) -> None:
        self.dir = Path(extraction_dir)
        self.path = self.dir / LEDGER_NAME
        self._lock = threading.Lock()

    @property
    def capture_dir(self) -> Path:
        return self.dir / "capture"

    def entries(self) -> dict[str, LedgerEntry]:
        """sample_id -> latest entry; a torn trailing line is skipped."""
        out: dict[str, LedgerEntry] = {}
        if not self.path.is_file():
            return out
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                if not line.endswith("\n"):
                    break  # torn append from a crash: the sample will be redone
                try:
                    e = LedgerEntry.from_dict(json.loads(line))
                except (json.JSONDecodeError, TypeError, ValueError):
                    continue
                out[e.sample_id] = e
        return out

    def __iter__(self) -> Iterator[LedgerEntry]:
        return iter(self.entries().values())

    def done_ids(self) -> set[str]:
        return set(self.entries())

    def append(self, entries: Iterable[LedgerEntry]) -> int:
        """Append entries durably (one write, flush, fsync). Returns how many were written."""
        lines = [e.to_json() + "\n" for e in entries]
        if not lines:
            return 0
        self.dir.mkdir(parents=True, exist_ok=True)
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            if f.tell() > 0:
                self._repair_tail(f)
            f.write("".join(lines))
            f.flush()
            os.fsync(f.fileno())
        return len(lines)

    def _repair_tail(self, f) -> None:
        """If the file ends mid-line (a crash), start the next entry on a fresh line."""
        with open(self.path, "rb") as r:
            r.seek(-1, os.SEEK_END)
            if r.read(1) != b"\n":
                f.write("\n")


def content_key(extraction_dir: str | Path, config: object) -> str:
    """sha256 of ``config`` (JSON) and every validated sample's id, shard sha256 and loss spans: what a
    conversion of this ledger computes from (never the folder's path, so a moved extraction keeps its key)."""
    h = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for sid, e in sorted(Ledger(extraction_dir).entries().items()):
        h.update(json.dumps([sid, e.sha256, e.loss_spans]).encode() + b"\n")
    return h.hexdigest()
