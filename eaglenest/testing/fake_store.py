"""Fake extraction folders and stores for tests and benchmarks.

Owns nothing of the pipeline; builds what the extraction stage would leave behind
(``<dir>/capture/*.safetensors`` + ``<dir>/ledger.jsonl``: real shards and a real ledger, random hidden
states) without a server, via the contract's own writer; :class:`MemoryStore` holds samples in memory
behind the store reader's interface.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from eaglenest.contract import Provenance, Shard, write_shard
from eaglenest.extraction.ledger import Ledger, LedgerEntry
from eaglenest.store.reader import StoreSample


def fake_provenance(*, hidden_size: int = 16, aux_layer_ids: Sequence[int] = (1, 3, 4), num_layers: int = 8,
                    **overrides) -> Provenance:
    fields = dict(engine="embedded", engine_version="test", model_path="/models/fake", model_hash="m" * 8,
                  tokenizer_hash="t" * 8, chat_template_hash="c" * 8, dtype="bfloat16",
                  aux_layer_ids=tuple(aux_layer_ids), hidden_size=hidden_size, num_layers=num_layers)
    fields.update(overrides)
    return Provenance(**fields)


def fake_shard(sample_id: str, num_tokens: int, provenance: Provenance, *, seed: int = 0) -> Shard:
    g = torch.Generator().manual_seed(seed)
    k, h = len(provenance.aux_layer_ids), provenance.hidden_size
    return Shard(
        sample_id=sample_id,
        input_ids=torch.randint(0, 50_000, (num_tokens,), generator=g, dtype=torch.int32),  # [T]
        aux_hidden=torch.randn(num_tokens, k * h, generator=g).to(torch.bfloat16),  # [T, kH]
        final_hidden=torch.randn(num_tokens, h, generator=g).to(torch.bfloat16),  # [T, H]
        provenance=provenance,
    )


def add_samples(extraction_dir: str | Path, shards: Sequence[Shard], *, seed: int = 0) -> list[LedgerEntry]:
    """Write shards into ``<dir>/capture`` and append validated ledger entries (random loss spans)."""
    ledger = Ledger(extraction_dir)
    g = torch.Generator().manual_seed(seed)
    entries = []
    for shard in shards:
        path = write_shard(ledger.capture_dir, shard)
        data = path.read_bytes()
        t = shard.num_tokens
        start = int(torch.randint(0, t, (1,), generator=g))
        spans = ((start, t),) if t > 1 else ()
        entries.append(LedgerEntry(sample_id=shard.sample_id, shard=path.name, sha256=hashlib.sha256(data).hexdigest(),
                                   bytes=len(data), num_tokens=t, loss_tokens=sum(b - a for a, b in spans),
                                   loss_spans=spans))
    ledger.append(entries)
    return entries


def make_extraction(extraction_dir: str | Path, lengths: Sequence[int], *, provenance: Provenance | None = None,
                    prefix: str = "s", seed: int = 0) -> list[LedgerEntry]:
    """A fake extraction with one sample per length (ids ``{prefix}{i}``)."""
    prov = provenance or fake_provenance()
    shards = [fake_shard(f"{prefix}{i}", t, prov, seed=seed * 100_003 + i) for i, t in enumerate(lengths)]
    return add_samples(extraction_dir, shards, seed=seed)


class MemoryStore:
    """Samples held in memory with the store reader's interface (tests build it from real captures)."""

    def __init__(self, samples: Sequence[StoreSample], provenance: Provenance) -> None:
        self._samples = list(samples)
        self.provenance = provenance
        self.sample_ids = [s.sample_id for s in self._samples]
        self.num_tokens = np.array([int(s.input_ids.numel()) for s in self._samples], dtype=np.int64)
        self.loss_tokens = np.array([int(s.loss_mask.sum()) for s in self._samples], dtype=np.int64)

    def __len__(self) -> int:
        return len(self._samples)

    def __getitem__(self, i: int) -> StoreSample:
        return self._samples[i]
