"""Extraction data: prompt sources, chat-template tokenization with assistant loss spans, samples.

- :mod:`eaglenest.data.sources`: records from JSONL / Parquet / (ShareGPT) JSON on any fsspec URL, the
  built-in ShareGPT bundle, bad-record accounting.
- :mod:`eaglenest.data.chat`: :class:`ChatEncoder` (target tokenizer + template, prefix-rendered
  assistant mask), :func:`build_samples` (context-length skipping, counted).
- :mod:`eaglenest.data.samples`: :class:`Sample` and its atomic Parquet file.

Nothing here talks HTTP or imports Prefect.
"""

from eaglenest.data.chat import (
    ChatEncoder,
    SampleError,
    Skipped,
    build_sample,
    build_samples,
    fit_turns,
    truncate_turns,
)
from eaglenest.data.samples import Sample, batch_digest, read_samples, write_samples
from eaglenest.data.sources import (
    BUILTIN_SHAREGPT,
    BadRecord,
    Message,
    Record,
    SourceError,
    SourceReport,
    read_records,
    source_fingerprint,
)

__all__ = [
    "BUILTIN_SHAREGPT", "BadRecord", "ChatEncoder", "Message", "Record", "Sample", "SampleError", "Skipped",
    "SourceError", "SourceReport", "batch_digest", "build_sample", "build_samples", "fit_turns", "read_records",
    "read_samples", "source_fingerprint", "truncate_turns", "write_samples",
]
