"""Stand-in for ``eaglenest.store`` (same names and signatures) until the Arrow store is merged.

Owns two readers with the store's interface, used by tests and by training straight from an
extraction folder:

- :class:`MemoryStore`: samples held in memory (tests build it from real captures of the tiny target).
- :class:`ExtractionStore`: an extraction folder (``capture/`` shards + ``ledger.jsonl``); the loss
  mask comes from the ledger's spans, shards are read lazily and checked against the ledger's sha256.

:class:`LengthBucketSampler` is a reference implementation of the store's sampler contract: batches
of indices whose padded size (rows x longest) stays within ``max_tokens`` (a longer sample goes
alone), deterministic per (seed, epoch), ``state_dict()`` = exact position inside the epoch.

Samples are the store's own :class:`eaglenest.store.reader.StoreSample`, so both kinds of reader yield one type.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from eaglenest import contract
from eaglenest.store.reader import StoreSample


class MemoryStore:
    def __init__(self, samples: Sequence[StoreSample], provenance: contract.Provenance) -> None:
        self._samples = list(samples)
        self.provenance = provenance
        self.sample_ids = [s.sample_id for s in self._samples]
        self.num_tokens = np.array([int(s.input_ids.numel()) for s in self._samples], dtype=np.int64)
        self.loss_tokens = np.array([int(s.loss_mask.sum()) for s in self._samples], dtype=np.int64)

    def __len__(self) -> int:
        return len(self._samples)

    def __getitem__(self, i: int) -> StoreSample:
        return self._samples[i]


class ExtractionStore:
    """Read-only store view of ``<extraction>/capture`` + ``<extraction>/ledger.jsonl``."""

    def __init__(self, extraction_dir: str | Path) -> None:
        from eaglenest.extraction.ledger import Ledger, spans_to_mask

        ledger = Ledger(extraction_dir)
        self._entries = sorted(ledger.entries().values(), key=lambda e: e.sample_id)
        if not self._entries:
            raise contract.ContractError(f"{extraction_dir}: the ledger lists no validated samples")
        self._capture = ledger.capture_dir
        self._spans_to_mask = spans_to_mask
        self.sample_ids = [e.sample_id for e in self._entries]
        self.num_tokens = np.array([e.num_tokens for e in self._entries], dtype=np.int64)
        self.loss_tokens = np.array([e.loss_tokens for e in self._entries], dtype=np.int64)
        self.provenance = self._read(0).provenance

    def __len__(self) -> int:
        return len(self._entries)

    def _read(self, i: int) -> contract.Shard:
        entry = self._entries[i]
        data = (self._capture / entry.shard).read_bytes()
        if hashlib.sha256(data).hexdigest() != entry.sha256:
            raise contract.ContractError(f"{self._capture / entry.shard}: sha256 differs from the ledger's")
        return contract.decode_shard(data, where=str(self._capture / entry.shard))

    def __getitem__(self, i: int) -> StoreSample:
        shard, entry = self._read(i), self._entries[i]
        mask = torch.tensor(self._spans_to_mask(entry.loss_spans, entry.num_tokens), dtype=torch.bool)
        return StoreSample(shard.sample_id, shard.input_ids, mask, shard.aux_hidden, shard.final_hidden)


def open_store(url: str | Path) -> ExtractionStore:
    path = Path(str(url).removeprefix("file://"))
    if not (path / "ledger.jsonl").is_file():
        raise contract.ContractError(
            f"{url}: not an extraction folder (no ledger.jsonl); the Arrow store reader (eaglenest.store) "
            "is not installed in this checkout"
        )
    return ExtractionStore(path)


class StoreDataset(torch.utils.data.Dataset):
    def __init__(self, store, indices: Sequence[int] | None = None) -> None:
        self.store = store
        self.indices = list(range(len(store))) if indices is None else list(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> StoreSample:
        return self.store[self.indices[i]]


class LengthBucketSampler:
    """Token-budget batches of similar lengths; deterministic per (seed, epoch); resumable mid-epoch."""

    def __init__(self, lengths: Sequence[int], *, max_tokens: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, rank: int = 0, world_size: int = 1) -> None:
        self.lengths = [int(n) for n in lengths]
        self.max_tokens, self.shuffle, self.seed, self.drop_last = max_tokens, shuffle, seed, drop_last
        self.rank, self.world_size = rank, world_size
        self.epoch, self.position = 0, 0

    def _batches(self) -> list[list[int]]:
        order = list(range(len(self.lengths)))
        rng = random.Random(f"{self.seed}:{self.epoch}")
        if self.shuffle:
            rng.shuffle(order)
        window = 64 * max(1, self.max_tokens // max(1, max(self.lengths, default=1)))
        batches: list[list[int]] = []
        for w in range(0, len(order), window):  # sort within windows: similar lengths, still random
            chunk = sorted(order[w : w + window], key=lambda i: self.lengths[i])
            cur: list[int] = []
            for i in chunk:
                if cur and (len(cur) + 1) * max(self.lengths[j] for j in [*cur, i]) > self.max_tokens:
                    batches.append(cur)
                    cur = []
                cur.append(i)
            if cur:
                batches.append(cur)
        if self.shuffle:
            rng.shuffle(batches)
        usable = len(batches) - len(batches) % self.world_size if self.drop_last else len(batches)
        return batches[self.rank : usable : self.world_size]

    def __len__(self) -> int:
        return len(self._batches())

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._batches()
        if self.position >= len(batches):
            self.position = 0  # iterating a finished epoch again starts it over (as eaglenest.store's sampler)
        while self.position < len(batches):
            self.position += 1
            yield batches[self.position - 1]

    def set_epoch(self, epoch: int) -> None:
        """A different epoch starts at its first batch; the current one keeps its position."""
        if int(epoch) != self.epoch:
            self.epoch, self.position = int(epoch), 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
