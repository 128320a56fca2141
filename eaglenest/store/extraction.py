"""An extraction folder read in place as a store (``capture/`` shards + ``ledger.jsonl``), for training
straight from an extraction without converting it.

:class:`ExtractionStore` has the store's reader interface (``sample_ids``, ``num_tokens``, ``loss_tokens``,
``provenance``, ``len``, indexing to :class:`~eaglenest.store.reader.StoreSample`). The loss mask comes from
the ledger's spans; shards are read lazily and each is checked against the ledger's sha256 the first time this
view reads it (as an Arrow store checks a data file on its first read in a process): later epochs do not hash
it again, which would cost a reading thread about as much time as the read itself.
:func:`open_samples` opens either kind: an extraction folder, or an Arrow store URL.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from eaglenest import contract
from eaglenest.store.reader import Store, StoreSample, open_store


class ExtractionStore:
    """Read-only store view of ``<extraction>/capture`` + ``<extraction>/ledger.jsonl``."""

    def __init__(self, extraction_dir: str | Path) -> None:
        from eaglenest.extraction.ledger import Ledger

        ledger = Ledger(extraction_dir)
        self._entries = sorted(ledger.entries().values(), key=lambda e: e.sample_id)
        if not self._entries:
            raise contract.ContractError(f"{extraction_dir}: the ledger lists no validated samples")
        self._capture = ledger.capture_dir
        self.sample_ids = [e.sample_id for e in self._entries]
        self.num_tokens = np.array([e.num_tokens for e in self._entries], dtype=np.int64)
        self.loss_tokens = np.array([e.loss_tokens for e in self._entries], dtype=np.int64)
        self._verified: set[int] = set()  # entries whose shard matched the ledger's sha256 in this view
        self.provenance = self._read(0).provenance

    def __len__(self) -> int:
        return len(self._entries)

    def _read(self, i: int) -> contract.Shard:
        """The shard mapped (copy-on-write) and decoded in place: its tensors are views of the page cache, so a
        batch's padding copy is the only copy of its bytes."""
        from eaglenest.store.shards import decode_mapped, map_shard

        entry = self._entries[i]
        path = self._capture / entry.shard
        buf = map_shard(path)
        if i not in self._verified:
            if hashlib.sha256(buf).hexdigest() != entry.sha256:
                raise contract.ContractError(f"{path}: sha256 differs from the ledger's")
            self._verified.add(i)
        return decode_mapped(buf, str(path))

    def __getitem__(self, i: int) -> StoreSample:
        from eaglenest.extraction.ledger import spans_to_mask

        shard, entry = self._read(i), self._entries[i]
        mask = torch.tensor(spans_to_mask(entry.loss_spans, entry.num_tokens), dtype=torch.bool)
        return StoreSample(shard.sample_id, shard.input_ids, mask, shard.aux_hidden, shard.final_hidden)


def open_samples(url: str | Path, *, check_sha256: bool = True) -> Store | ExtractionStore:
    """An Arrow store URL, or a local extraction folder (``ledger.jsonl`` + ``capture/``) read in place.

    check_sha256: an Arrow store sha256-checks each data file on its first read (an extraction folder checks
    every shard against the ledger anyway)."""
    path = Path(str(url).removeprefix("file://"))
    if (path / "ledger.jsonl").is_file():
        return ExtractionStore(path)
    return open_store(str(url), check_sha256=check_sha256)
