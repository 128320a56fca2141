"""The draft vocabulary: which target tokens the drafter's LM head can propose.

Owns choosing the draft vocabulary from data and its two maps, in SGLang/SpecForge form:

- ``d2t`` int64 [Vd]: ``target_id - draft_id`` for each draft id (SGLang adds ``arange(Vd)`` back:
  ``hot_token_id = d2t + arange``).
- ``t2d`` bool [V]: which target ids are in the draft vocabulary (SGLang ignores it; SpecForge and
  vLLM speculators carry it).

Invariants: the chosen target ids are distinct and sorted ascending (so ``d2t`` is non-decreasing
and ``d2t >= 0``); the choice is deterministic: the ``size`` most frequent loss-masked tokens, ties
broken by the smaller id; when the data has fewer distinct tokens, the remaining slots take the
smallest unused ids (never-seen tokens cost nothing but a row of the head).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from eaglenest import contract


@dataclass(frozen=True, slots=True)
class DraftVocab:
    target_ids: torch.Tensor  # [Vd] int64, ascending
    vocab_size: int
    coverage: float = float("nan")
    """Share of the counted loss-masked token occurrences whose token is in the draft vocabulary."""

    @property
    def size(self) -> int:
        return int(self.target_ids.numel())

    @property
    def d2t(self) -> torch.Tensor:  # [Vd] int64
        return self.target_ids - torch.arange(self.size, dtype=torch.int64)

    @property
    def t2d(self) -> torch.Tensor:  # [V] bool
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[self.target_ids] = True
        return mask

    @classmethod
    def from_counts(cls, counts: np.ndarray | torch.Tensor, size: int) -> DraftVocab:
        """The ``size`` most frequent ids of ``counts`` [V] (ties: smaller id first)."""
        counts = np.asarray(counts, dtype=np.int64)
        vocab_size = int(counts.shape[0])
        if not 0 < size <= vocab_size:
            raise contract.ContractError(f"draft vocabulary size {size} must be in 1..{vocab_size}")
        order = np.argsort(-counts, kind="stable")  # by count desc, id asc
        vocab = cls(torch.from_numpy(np.sort(order[:size]).astype(np.int64)), vocab_size)
        return dataclasses.replace(vocab, coverage=vocab.share_of(counts))

    def most_frequent(self, counts: np.ndarray | torch.Tensor, size: int) -> tuple[DraftVocab, torch.Tensor]:
        """The ``size`` ids of this vocabulary most frequent in ``counts`` [V] (ties: smaller id first), and their
        positions here (ascending: the rows of this vocabulary's LM head to keep)."""
        counts = np.asarray(counts, dtype=np.int64)
        if counts.shape != (self.vocab_size,):
            raise contract.ContractError(f"token counts cover {counts.shape[0]} ids; the target vocabulary has "
                                         f"{self.vocab_size}")
        if not 0 < size <= self.size:
            raise contract.ContractError(f"draft vocabulary size {size} must be in 1..{self.size} (the current size)")
        mine = counts[self.target_ids.numpy()]
        keep = torch.from_numpy(np.sort(np.argsort(-mine, kind="stable")[:size]).astype(np.int64))
        vocab = DraftVocab(self.target_ids[keep], self.vocab_size)
        return dataclasses.replace(vocab, coverage=vocab.share_of(counts)), keep

    def widened(self, counts: np.ndarray | torch.Tensor, size: int) -> DraftVocab:
        """This vocabulary with the ids most frequent in ``counts`` [V] that it lacks added up to ``size`` (ties:
        smaller id first; unseen ids, smallest first, when the counts run out). Its LM head: :func:`widen_head`."""
        counts = np.asarray(counts, dtype=np.int64)
        if counts.shape != (self.vocab_size,):
            raise contract.ContractError(f"token counts cover {counts.shape[0]} ids; the target vocabulary has "
                                         f"{self.vocab_size}")
        if not self.size < size <= self.vocab_size:
            raise contract.ContractError(f"a wider draft vocabulary needs a size in {self.size + 1}..{self.vocab_size} "
                                         f"(it has {self.size}), got {size}")
        rank = counts.astype(np.float64)
        rank[self.target_ids.numpy()] = np.inf  # the current ids first, then by count desc, id asc
        ids = np.sort(np.argsort(-rank, kind="stable")[:size]).astype(np.int64)
        vocab = DraftVocab(torch.from_numpy(ids), self.vocab_size)
        return dataclasses.replace(vocab, coverage=vocab.share_of(counts))

    def share_of(self, counts: np.ndarray | torch.Tensor) -> float:
        """Share of the occurrences counted in ``counts`` [V] whose token is in this vocabulary (nan: none)."""
        counts = np.asarray(counts, dtype=np.int64)
        total = int(counts.sum())
        return float(counts[self.target_ids.numpy()].sum() / total) if total else float("nan")

    @classmethod
    def from_d2t(cls, d2t: torch.Tensor, vocab_size: int) -> DraftVocab:
        ids = d2t.to(torch.int64) + torch.arange(d2t.numel(), dtype=torch.int64)
        if ids.numel() and (bool((ids[1:] <= ids[:-1]).any()) or int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise contract.ContractError(
                f"d2t does not describe {d2t.numel()} distinct ascending target ids below {vocab_size}"
            )
        return cls(ids, vocab_size)


def widen_head(head: torch.Tensor, own: DraftVocab, wider: DraftVocab) -> torch.Tensor:
    """The draft LM head [Vd, H] of vocabulary ``own`` for ``wider`` (:meth:`DraftVocab.widened`): its rows at
    their tokens' new places, zeros for the added tokens. A zero row's logit is 0, below any top logit worth
    drafting, so the widened drafter drafts as before until training moves those rows (the KL's gradient reaches
    them wherever the target puts mass). Rows from the target's head, scaled to the draft head's, did not: n13-avg
    widened that way from 16,000 to 32,000 tokens lost 0.10 accept length at steps 3 on MT-Bench offline before any
    training (results/2026-12-06d-cpu); with zero rows it accepts exactly as n13-avg."""
    old_at = torch.searchsorted(wider.target_ids, own.target_ids)
    held = wider.target_ids[old_at.clamp_max(wider.size - 1)] == own.target_ids
    if head.shape[0] != own.size or not bool(held.all()):
        raise contract.ContractError(f"an LM head of {tuple(head.shape)} for {own.size} draft ids does not widen to "
                                     f"{wider.size} ids holding them all")
    out = head.new_zeros(wider.size, head.shape[1])
    out[old_at] = head
    return out


def count_tokens(samples: Iterable[tuple[torch.Tensor, torch.Tensor]], vocab_size: int) -> np.ndarray:
    """Occurrences [V] of each token id where the loss mask is set; ``samples`` yields (ids, mask)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids, mask in samples:
        picked = np.asarray(ids)[np.asarray(mask, dtype=bool)].astype(np.int64)
        if picked.size:
            if int(picked.max()) >= vocab_size or int(picked.min()) < 0:
                raise contract.ContractError(
                    f"token id {int(picked.max())} outside the target vocabulary ({vocab_size})"
                )
            counts += np.bincount(picked, minlength=vocab_size)
    return counts


def loss_tokens(store, indices: Sequence[int] | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, loss_mask) of a store's samples ``indices`` (None: all), each sample read once."""
    for i in range(len(store)) if indices is None else indices:
        sample = store[i]
        yield sample.input_ids, sample.loss_mask


def count_answer_tokens(path: str | Path, vocab_size: int) -> np.ndarray:
    """Occurrences [V] of each id in the ``output_ids`` of a JSON-lines file: the target's answers as the
    regeneration recipe records them (``answers.jsonl`` of an extraction folder), i.e. its loss-masked tokens."""
    answers = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                answers.append(np.asarray(json.loads(line)["output_ids"], dtype=np.int64).reshape(-1))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                raise contract.ContractError(f"{path}:{n}: not a JSON object with a list of output_ids") from None
    ids = np.concatenate(answers) if answers else np.zeros(0, dtype=np.int64)
    return count_tokens([(ids, np.ones(ids.shape, dtype=bool))], vocab_size)


def build_draft_vocab(
    samples: Iterable[tuple[torch.Tensor, torch.Tensor]], *, vocab_size: int, size: int
) -> DraftVocab:
    """Draft vocabulary from loss-masked token frequencies of (input_ids, loss_mask) pairs."""
    return DraftVocab.from_counts(count_tokens(samples, vocab_size), size)
