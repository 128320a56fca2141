"""Training batches for the drafter: collation into padded batches and the resumable batch stream.

Owns collation of store samples into padded :class:`~eaglenest.drafter.ttt.Batch` es and
:class:`BatchStream`, the endless, resumable stream of micro-batches across epochs (over the store's
:class:`~eaglenest.store.LengthBucketSampler`). The store opens the data (:func:`eaglenest.store.open_samples`)
and owns the held-out split (:mod:`eaglenest.store.split`).

Invariants: every rank iterates the same global stream (rank-independent sampler, world_size=1 there)
and picks its own micro-batches, so N processes consume exactly what 1 process with N times the
accumulation does; the stream position after a step is exactly restorable.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from eaglenest import contract
from eaglenest.drafter.ttt import Batch, row_plan
from eaglenest.store.sampler import LengthBucketSampler

__all__ = ["BatchStream", "Lookahead", "Staged", "collate", "prompt_set_view", "stage", "store_view"]


class _View:
    """Read-only subset of a store (same sample interface), by store index."""

    def __init__(self, store, indices: Sequence[int]) -> None:
        self._store, self._idx = store, list(indices)
        self.provenance = store.provenance
        self.sample_ids = [store.sample_ids[i] for i in self._idx]
        self.num_tokens = [int(store.num_tokens[i]) for i in self._idx]

    def __len__(self) -> int:
        return len(self._idx)

    def __getitem__(self, i: int):
        return self._store[self._idx[i]]


def store_view(store, indices: Sequence[int]):
    """The samples ``indices`` of ``store`` (in that order) as a store the trainer and evaluator accept:
    same provenance, ``sample_ids`` and ``num_tokens`` of the subset (e.g. training on the first N samples)."""
    return _View(store, indices)


def prompt_set_view(store, name: str):
    """The samples of prompt set ``name`` when the store holds several (calibration captures name their
    samples ``<set>:<id>``), else the whole store."""
    idx = [i for i, sid in enumerate(store.sample_ids) if str(sid).startswith(f"{name}:")]
    return _View(store, idx) if idx and len(idx) < len(store) else store


@dataclass(slots=True)
class Staged:
    """A micro-batch padded on the CPU, not yet on its device: bf16/fp32 states (finite-checked), or an fp8
    store's codes and scales (half the bytes travel; decoded and checked on the device by :meth:`to_batch`)."""

    input_ids: torch.Tensor  # [B, T] int64
    loss_mask: torch.Tensor  # [B, T] bool
    lengths: torch.Tensor  # [B] int64
    indices: tuple[int, ...]
    samples: Sequence  # kept only to name a damaged sample
    dtype: torch.dtype
    states: tuple[torch.Tensor, torch.Tensor] | None = None  # (aux [B, T, k*H], final [B, T, H])
    fp8_parts: tuple[torch.Tensor, ...] | None = None  # aux codes, aux scales, final codes, final scales

    def to_batch(self, device: torch.device | str | None = None) -> Batch:
        """Move (asynchronously from pinned memory) and decode; raises ContractError on NaN/inf states."""
        def move(x: torch.Tensor) -> torch.Tensor:
            return x if device is None else x.to(device, non_blocking=True)

        if self.fp8_parts is not None:
            from eaglenest.store.encoding import Fp8States

            aux, final = Fp8States(*(move(x) for x in self.fp8_parts)).decode(self.dtype, device)
            _check_finite(aux, final, self.samples, self.indices)
        else:
            aux, final = (move(x) for x in self.states)
        plan = row_plan(self.loss_mask, self.lengths)  # on the host: a GPU step then never waits to learn a size
        return Batch(input_ids=move(self.input_ids), loss_mask=move(self.loss_mask), aux_hidden=aux,
                     final_hidden=final, lengths=move(self.lengths), indices=self.indices,
                     plan=plan if device is None else plan.to(device))


def _check_finite(aux: torch.Tensor, final: torch.Tensor, samples: Sequence, indices: Sequence[int]) -> None:
    if not (contract.all_finite(aux) and contract.all_finite(final)):
        bad = [sid for sid, s in zip(indices, samples, strict=True)
               if not (contract.all_finite(s.aux_hidden) and contract.all_finite(s.final_hidden))]
        raise contract.ContractError(f"non-finite hidden states in store samples {bad}; re-validate the store")


def stage(samples: Sequence, indices: Sequence[int], *, max_seq_len: int, dtype: torch.dtype,
          pin_memory: bool = False) -> Staged:
    """Right-pad samples (each cut to its first ``max_seq_len`` tokens) on the CPU (page-locked when
    ``pin_memory``, so the move to a GPU is asynchronous). Safe to call from a helper thread."""
    lens = [min(int(s.input_ids.numel()), max_seq_len) for s in samples]
    b, t = len(samples), max(lens)
    ids = torch.empty(b, t, dtype=torch.int64, pin_memory=pin_memory)
    mask = torch.empty(b, t, dtype=torch.bool, pin_memory=pin_memory)
    for r, (s, n) in enumerate(zip(samples, lens, strict=True)):
        _put_row(ids, r, s.input_ids, n)
        _put_row(mask, r, s.loss_mask, n)
    staged = Staged(input_ids=ids, loss_mask=mask, lengths=torch.tensor(lens, dtype=torch.int64),
                    indices=tuple(int(i) for i in indices), samples=samples, dtype=dtype)
    if all(getattr(s, "fp8", None) is not None for s in samples):
        staged.fp8_parts = _padded_fp8(samples, lens, pin_memory)
    else:
        staged.states = _padded_states(samples, lens, dtype, pin_memory)
        _check_finite(*staged.states, samples, staged.indices)
    return staged


def collate(samples: Sequence, indices: Sequence[int], *, max_seq_len: int, dtype: torch.dtype,
            device: torch.device | str | None = None) -> Batch:
    """Right-pad samples (each cut to its first ``max_seq_len`` tokens) into one Batch on ``device``.

    Samples of an fp8 store travel as their codes and scales (half the bytes of bf16) and are decoded on
    ``device``; any other sample's states are padded on the CPU in ``dtype`` and moved."""
    return stage(samples, indices, max_seq_len=max_seq_len, dtype=dtype).to_batch(device)


def _put_row(dst: torch.Tensor, r: int, src: torch.Tensor, n: int) -> None:
    """Row ``r`` of an unfilled padded buffer: the first ``n`` entries of ``src`` (converted to ``dst``'s dtype),
    zeros after them. Each byte is written once, where a zero-filled buffer would be written twice."""
    dst[r, :n] = src[:n]
    dst[r, n:] = 0


def _padded_states(samples: Sequence, lens: Sequence[int], dtype: torch.dtype,
                   pin_memory: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    b, t, first = len(samples), max(lens), samples[0]
    aux = torch.empty(b, t, first.aux_hidden.shape[-1], dtype=dtype, pin_memory=pin_memory)  # [B, T, k*H]
    final = torch.empty(b, t, first.final_hidden.shape[-1], dtype=dtype, pin_memory=pin_memory)  # [B, T, H]
    for r, (s, n) in enumerate(zip(samples, lens, strict=True)):
        _put_row(aux, r, s.aux_hidden, n)
        _put_row(final, r, s.final_hidden, n)
    return aux, final


def _padded_fp8(samples: Sequence, lens: Sequence[int], pin_memory: bool = False) -> tuple[torch.Tensor, ...]:
    """Codes and scales padded on the CPU (zero codes with zero scales decode to the zero padding)."""
    b, t, first = len(samples), max(lens), samples[0].fp8
    parts = tuple(torch.empty(b, t, x.shape[-1], dtype=x.dtype, pin_memory=pin_memory)
                  for x in (first.aux_codes, first.aux_scale, first.final_codes, first.final_scale))
    for r, (s, n) in enumerate(zip(samples, lens, strict=True)):
        for dst, src in zip(parts, (s.fp8.aux_codes, s.fp8.aux_scale, s.fp8.final_codes, s.fp8.final_scale),
                            strict=True):
            _put_row(dst, r, src, n)
    return parts


class Lookahead:
    """The optimizer steps' micro-batches, the next ``ahead`` steps' staged on helper threads while this one computes.

    ``next()`` hands out one step's index lists and ``stage_fn(index lists)`` (what the step reads, e.g. this
    rank's :class:`Staged` batches). With ``ahead`` > 0 the stream is advanced that many steps further at once
    and each of those steps is read and padded (and page-locked) on a helper thread of its own, so reading
    overlaps the device's work and several steps can be read at once (the H200 trained at 80K tokens/s with one
    reading thread, where its step alone computes about 300K). :meth:`state_dict` is the stream's state as of
    the last step handed out, never of a prefetched one: a checkpoint resumes exactly where a run without
    look-ahead would. What is computed does not depend on ``ahead``."""

    def __init__(self, stream: BatchStream, per_step: int, stage_fn, *, ahead: int = 0) -> None:
        self.stream, self.per_step, self.stage_fn, self.ahead = stream, per_step, stage_fn, ahead
        self._pool = ThreadPoolExecutor(ahead, thread_name_prefix="eaglenest-stage") if ahead > 0 else None
        self._queue: deque[tuple[list[list[int]], dict, int, Future]] = deque()
        self._state: dict | None = None
        self.epoch = stream.epoch

    def _take(self) -> tuple[list[list[int]], dict, int]:
        """One step's micro-batches and the stream's state and epoch right after them."""
        micro = self.stream.take(self.per_step)
        return micro, self.stream.state_dict(), self.stream.epoch

    def next(self, *, following: int = 1) -> tuple[list[list[int]], object]:
        """This step's micro-batches; ``following``: how many more steps will be asked for (none is read past)."""
        if self._queue:
            micro, self._state, self.epoch, fut = self._queue.popleft()
        else:
            (micro, self._state, self.epoch), fut = self._take(), None
        while self._pool is not None and len(self._queue) < min(self.ahead, following):
            m, state, epoch = self._take()
            self._queue.append((m, state, epoch, self._pool.submit(self.stage_fn, m)))
        return micro, fut.result() if fut is not None else self.stage_fn(micro)

    def state_dict(self) -> dict:
        return self._state if self._state is not None else self.stream.state_dict()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


class BatchStream:
    """Endless stream of global micro-batches (index lists) over epochs, resumable at any step."""

    def __init__(self, lengths: Sequence[int], *, max_tokens: int, seed: int) -> None:
        self._args = dict(lengths=list(lengths), max_tokens=max_tokens, seed=seed)
        self.sampler = self._make()
        self.epoch = 0
        self._it: Iterator[list[int]] | None = None

    def _make(self):
        a = self._args
        return LengthBucketSampler(a["lengths"], max_tokens=a["max_tokens"], shuffle=True, seed=a["seed"],
                                   drop_last=False, rank=0, world_size=1)

    def next(self) -> list[int]:
        for _ in range(2):
            if self._it is None:
                self.sampler.set_epoch(self.epoch)
                self._it = iter(self.sampler)
            try:
                return list(next(self._it))
            except StopIteration:
                self.epoch += 1
                self._it = None
        raise contract.ContractError("the training split yields no batches (empty split?)")

    def take(self, n: int) -> list[list[int]]:
        return [self.next() for _ in range(n)]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.sampler.set_epoch(self.epoch)
        self.sampler.load_state_dict(state["sampler"])
        if int(self.sampler.state_dict()["position"]) >= len(self.sampler):  # that epoch was used up
            self.epoch += 1
            self.sampler.set_epoch(self.epoch)
        self._it = iter(self.sampler)

    def batches_per_epoch(self) -> int:
        """Micro-batches in one epoch (epoch 0's bucketing; counted without disturbing the position)."""
        probe = self._make()
        probe.set_epoch(0)
        return sum(1 for _ in probe)
