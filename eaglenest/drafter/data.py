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

from collections.abc import Iterator, Sequence

import torch

from eaglenest import contract
from eaglenest.drafter.ttt import Batch
from eaglenest.store.sampler import LengthBucketSampler

__all__ = ["BatchStream", "collate"]


def collate(samples: Sequence, indices: Sequence[int], *, max_seq_len: int, dtype: torch.dtype,
            device: torch.device | str | None = None) -> Batch:
    """Right-pad samples (each cut to its first ``max_seq_len`` tokens) into one Batch on ``device``.

    Samples of an fp8 store travel as their codes and scales (half the bytes of bf16) and are decoded on
    ``device``; any other sample's states are padded on the CPU in ``dtype`` and moved."""
    lens = [min(int(s.input_ids.numel()), max_seq_len) for s in samples]
    b, t = len(samples), max(lens)
    ids = torch.zeros(b, t, dtype=torch.int64)
    mask = torch.zeros(b, t, dtype=torch.bool)
    for r, (s, n) in enumerate(zip(samples, lens, strict=True)):
        ids[r, :n] = s.input_ids[:n].to(torch.int64)
        mask[r, :n] = s.loss_mask[:n].to(torch.bool)
    if all(getattr(s, "fp8", None) is not None for s in samples):
        aux, final = _padded_fp8(samples, lens, dtype, device)
    else:
        aux, final = _padded_states(samples, lens, dtype)
    if not (contract.all_finite(aux) and contract.all_finite(final)):
        bad = [sid for sid, s in zip(indices, samples, strict=True)
               if not (contract.all_finite(s.aux_hidden) and contract.all_finite(s.final_hidden))]
        raise contract.ContractError(f"non-finite hidden states in store samples {bad}; re-validate the store")
    batch = Batch(input_ids=ids, loss_mask=mask, aux_hidden=aux, final_hidden=final,
                  lengths=torch.tensor(lens, dtype=torch.int64), indices=tuple(int(i) for i in indices))
    return batch.to(device) if device is not None else batch


def _padded_states(samples: Sequence, lens: Sequence[int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    b, t, first = len(samples), max(lens), samples[0]
    aux = torch.zeros(b, t, first.aux_hidden.shape[-1], dtype=dtype)  # [B, T, k*H]
    final = torch.zeros(b, t, first.final_hidden.shape[-1], dtype=dtype)  # [B, T, H]
    for r, (s, n) in enumerate(zip(samples, lens, strict=True)):
        aux[r, :n] = s.aux_hidden[:n].to(dtype)
        final[r, :n] = s.final_hidden[:n].to(dtype)
    return aux, final


def _padded_fp8(samples: Sequence, lens: Sequence[int], dtype: torch.dtype,
                device: torch.device | str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad codes and scales on the CPU (zero codes with zero scales decode to the zero padding), move them,
    decode on the device."""
    from eaglenest.store.encoding import Fp8States

    b, t, first = len(samples), max(lens), samples[0].fp8
    parts = [torch.zeros(b, t, x.shape[-1], dtype=x.dtype)
             for x in (first.aux_codes, first.aux_scale, first.final_codes, first.final_scale)]
    for r, (s, n) in enumerate(zip(samples, lens, strict=True)):
        for dst, src in zip(parts, (s.fp8.aux_codes, s.fp8.aux_scale, s.fp8.final_codes, s.fp8.final_scale),
                            strict=True):
            dst[r, :n] = src[:n]
    return Fp8States(*parts).decode(dtype, device)


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
