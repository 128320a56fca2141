"""Training-side access to a store: a torch Dataset and a resumable length-bucketing batch sampler.

Owns the order in which samples reach a trainer. Invariants:

- The batch list of an epoch is a pure function of (lengths, max_tokens, shuffle, seed, epoch, pool):
  every rank computes the same list and takes ``batches[rank::world_size]`` after the list is padded
  (repeating its first batches) or cut (``drop_last``) to a multiple of ``world_size``, so every rank
  gets the same number of batches.
- A batch's padded size, ``len(batch) * max(length in batch)``, stays <= max_tokens; a sample longer
  than max_tokens travels alone (it cannot be split).
- ``state_dict()`` records (epoch, position); after ``load_state_dict`` the next iteration yields exactly
  the batch that an uninterrupted run would have yielded next. position == len(sampler) means the epoch
  is finished (the trainer moves on with ``set_epoch(epoch + 1)``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch.utils.data

from eaglenest.store.reader import Store, StoreSample


class StoreDataset(torch.utils.data.Dataset):
    """Samples of a store (optionally a subset, by store index) as :class:`StoreSample`."""

    def __init__(self, store: Store, indices: Sequence[int] | None = None) -> None:
        self.store = store
        self.indices = np.arange(len(store)) if indices is None else np.asarray(indices, dtype=np.int64)
        if len(self.indices) and (self.indices.min() < 0 or self.indices.max() >= len(store)):
            raise IndexError(f"indices out of range for a store of {len(store)} samples")

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> StoreSample:
        return self.store[int(self.indices[i])]

    def __getitems__(self, items: Sequence[int]) -> list[StoreSample]:
        """A whole batch (DataLoader calls this with a batch sampler): prefetch all, then read each."""
        real = [int(self.indices[i]) for i in items]
        self.store.prefetch(real)
        return [self.store[i] for i in real]

    @property
    def lengths(self) -> np.ndarray:
        """Token count per dataset item (feed it to :class:`LengthBucketSampler`)."""
        return self.store.num_tokens[self.indices]


class LengthBucketSampler(torch.utils.data.Sampler[list[int]]):
    """Batches of indices whose padded size stays under ``max_tokens``; deterministic per (seed, epoch).

    Shuffled: a seeded permutation is cut into pools of ``pool_size``, each pool is sorted by length and
    packed greedily, then the batch order is shuffled. Not shuffled: all indices sorted by length.
    Use as ``DataLoader(dataset, batch_sampler=sampler, collate_fn=...)``. Call ``set_epoch`` each epoch.
    """

    def __init__(self, lengths: Sequence[int], *, max_tokens: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, rank: int = 0, world_size: int = 1, pool_size: int = 4096) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if self.lengths.ndim != 1 or (self.lengths < 0).any():
            raise ValueError("lengths must be a 1-D sequence of non-negative token counts")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank} world_size={world_size}")
        if pool_size < 1:
            raise ValueError(f"pool_size must be >= 1, got {pool_size}")
        self.max_tokens, self.shuffle, self.seed, self.drop_last = int(max_tokens), bool(shuffle), int(seed), drop_last
        self.rank, self.world_size, self.pool_size = int(rank), int(world_size), int(pool_size)
        self.epoch = 0
        self._position = 0
        self._cache: tuple[int, list[list[int]]] | None = None

    def _pack(self, order: np.ndarray) -> list[list[int]]:
        batches, cur, longest = [], [], 0
        for i in order.tolist():
            n = int(self.lengths[i])
            if cur and (len(cur) + 1) * max(longest, n) > self.max_tokens:
                batches.append(cur)
                cur, longest = [], 0
            cur.append(i)
            longest = max(longest, n)
        if cur:
            batches.append(cur)
        return batches

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """All ranks' batches of ``epoch``, before the split across ranks."""
        if not self.shuffle:
            return self._pack(np.argsort(self.lengths, kind="stable"))
        rng = np.random.default_rng([self.seed, epoch])
        perm = rng.permutation(len(self.lengths))
        batches: list[list[int]] = []
        for s in range(0, len(perm), self.pool_size):
            pool = perm[s : s + self.pool_size]
            batches += self._pack(pool[np.argsort(self.lengths[pool], kind="stable")])
        return [batches[j] for j in rng.permutation(len(batches))]

    def _rank_batches(self) -> list[list[int]]:
        if self._cache is None or self._cache[0] != self.epoch:
            batches = self.epoch_batches(self.epoch)
            ws, extra = self.world_size, len(batches) % self.world_size
            if extra and self.drop_last:
                batches = batches[: len(batches) - extra]
            elif extra and batches:
                need = ws - extra
                batches = batches + [batches[j % len(batches)] for j in range(need)]
            self._cache = (self.epoch, batches[self.rank :: ws])
        return self._cache[1]

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch; a different epoch than the current one starts at its first batch."""
        if int(epoch) != self.epoch:
            self.epoch, self._position = int(epoch), 0

    def __len__(self) -> int:
        return len(self._rank_batches())

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._rank_batches()
        if self._position >= len(batches):
            self._position = 0  # iterating a finished epoch again starts it over
        while self._position < len(batches):
            self._position += 1
            yield list(batches[self._position - 1])

    def _config(self) -> dict:
        digest = hashlib.sha256(self.lengths.tobytes()).hexdigest()[:16]
        return {"lengths_sha256": digest, "num_samples": len(self.lengths), "max_tokens": self.max_tokens,
                "shuffle": self.shuffle, "seed": self.seed, "drop_last": self.drop_last, "rank": self.rank,
                "world_size": self.world_size, "pool_size": self.pool_size}

    def state_dict(self, *, consumed: int | None = None) -> dict:
        """Epoch and position in it. ``position`` counts batches handed out by this iterator; when a
        DataLoader prefetches ahead, pass ``consumed`` (batches the trainer actually used this epoch)."""
        position = self._position if consumed is None else int(consumed)
        return {"epoch": self.epoch, "position": position, **self._config()}

    def load_state_dict(self, state: dict) -> None:
        """Restore the position; refuses a state saved under another configuration, naming the field."""
        mine = self._config()
        for key, value in mine.items():
            if state.get(key) != value:
                raise ValueError(f"sampler state was saved with {key}={state.get(key)!r}, this sampler has "
                                 f"{key}={value!r}; resume with the same data and sampler settings")
        self.epoch, self._position = int(state["epoch"]), int(state["position"])
        if not 0 <= self._position <= len(self):
            raise ValueError(f"sampler position {self._position} outside epoch of {len(self)} batches")
