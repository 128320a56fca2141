"""Tokenized samples: what the extraction sends (token ids) and trains on (assistant loss spans).

Owns the :class:`Sample` record and its on-disk form, a Parquet table written atomically
(``samples.parquet`` in an extraction folder): one row per sample with ``sample_id``, ``input_ids``
(int32 [T]), ``loss_spans`` (flat int32 [2 * n_spans], half-open [start, end) pairs), ``messages``
(JSON; the conversation the ids were rendered from), ``regenerated`` and ``source_index``.

Invariants: ``input_ids`` is exactly what the server is asked to prefill (its shard must hold the
same ids); spans are sorted, disjoint and inside [0, T); :meth:`Sample.digest` is a content key
(id, ids, spans) used for caching and resume, never a path.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from eaglenest.atomic import atomic_write_bytes
from eaglenest.data.sources import Message


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class Sample:
    sample_id: str
    input_ids: np.ndarray  # [T] int32, read-only
    loss_spans: tuple[tuple[int, int], ...]
    messages: tuple[Message, ...] = ()
    regenerated: bool = False
    source_index: int = -1
    meta: dict = field(default_factory=dict)
    """Free-form notes (regeneration finish reasons, dropped turns)."""

    def __post_init__(self) -> None:
        ids = np.asarray(self.input_ids, dtype=np.int32).reshape(-1)  # [T]
        ids.setflags(write=False)
        object.__setattr__(self, "input_ids", ids)
        spans = tuple((int(a), int(b)) for a, b in self.loss_spans)
        last = 0
        for a, b in spans:
            if not last <= a < b <= len(ids):
                raise ValueError(f"sample {self.sample_id!r}: loss spans {spans} are not sorted, disjoint spans "
                                 f"inside [0, {len(ids)})")
            last = b
        object.__setattr__(self, "loss_spans", spans)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def loss_tokens(self) -> int:
        return sum(b - a for a, b in self.loss_spans)

    def loss_mask(self) -> np.ndarray:
        mask = np.zeros(self.num_tokens, dtype=np.bool_)  # [T]
        for a, b in self.loss_spans:
            mask[a:b] = True
        return mask

    def digest(self) -> str:
        h = hashlib.sha256(self.sample_id.encode("utf-8", "surrogatepass"))
        h.update(self.input_ids.tobytes())
        h.update(np.asarray(self.loss_spans, dtype=np.int64).tobytes())
        return h.hexdigest()

    def with_ids(self, input_ids: Sequence[int], loss_spans: Sequence[tuple[int, int]], **changes) -> Sample:
        return replace(self, input_ids=np.asarray(input_ids, dtype=np.int32), loss_spans=tuple(loss_spans),
                       **changes)


def batch_digest(samples: Iterable[Sample]) -> str:
    """Content key of a list of samples (order matters)."""
    h = hashlib.sha256()
    for s in samples:
        h.update(s.digest().encode())
    return h.hexdigest()


def messages_to_json(messages: Sequence[Message]) -> str:
    return json.dumps([[m.role, m.content] for m in messages], ensure_ascii=False)


def messages_from_json(text: str) -> tuple[Message, ...]:
    return tuple(Message(r, c) for r, c in json.loads(text))


def write_samples(path: str | Path, samples: Sequence[Sample]) -> Path:
    """Write samples as one Parquet file, atomically."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({
        "sample_id": pa.array([s.sample_id for s in samples], pa.string()),
        "input_ids": pa.array([s.input_ids for s in samples], pa.list_(pa.int32())),
        "loss_spans": pa.array([np.asarray(s.loss_spans, dtype=np.int32).reshape(-1) for s in samples],
                               pa.list_(pa.int32())),
        "messages": pa.array([messages_to_json(s.messages) for s in samples], pa.string()),
        "regenerated": pa.array([s.regenerated for s in samples], pa.bool_()),
        "source_index": pa.array([s.source_index for s in samples], pa.int64()),
        "meta": pa.array([json.dumps(s.meta, sort_keys=True) for s in samples], pa.string()),
    })
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    return atomic_write_bytes(path, sink.getvalue().to_pybytes())


def read_samples(path: str | Path) -> list[Sample]:
    import pyarrow.parquet as pq

    table = pq.read_table(str(path))
    ids_col = table.column("input_ids").combine_chunks()
    spans_col = table.column("loss_spans").combine_chunks()
    out = []
    for i, (sid, msgs, regen, index, meta) in enumerate(zip(
        table.column("sample_id").to_pylist(), table.column("messages").to_pylist(),
        table.column("regenerated").to_pylist(), table.column("source_index").to_pylist(),
        table.column("meta").to_pylist(), strict=True,
    )):
        ids = ids_col[i].values.to_numpy(zero_copy_only=False)
        flat = spans_col[i].values.to_numpy(zero_copy_only=False)
        out.append(Sample(
            sample_id=sid, input_ids=ids, loss_spans=tuple(zip(flat[0::2].tolist(), flat[1::2].tolist(), strict=True)),
            messages=messages_from_json(msgs), regenerated=bool(regen), source_index=int(index),
            meta=json.loads(meta),
        ))
    return out
