"""The one train/eval split: which samples are held out for evaluation.

Used by training (the eval metrics) and by the offline benchmark (which must score only samples the
drafter never trained on), so both sides always agree. A sample is held out when a salted hash of its id
falls below the fraction: the split depends only on the sample id, never on store order, machine or run,
and a sample never changes side when the store grows. The salt ``eaglenest-eval:`` is part of the
contract: changing it would move samples between train and eval of drafters already trained.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

SALT = "eaglenest-eval:"


def held_out(sample_id: str, fraction: float) -> bool:
    """True for the ~``fraction`` of sample ids that form the evaluation split."""
    h = int.from_bytes(hashlib.sha256(f"{SALT}{sample_id}".encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def split_indices(
    sample_ids: Sequence[str], fraction: float, *, max_eval: int | None = None
) -> tuple[list[int], list[int]]:
    """(train indices, eval indices); eval capped at ``max_eval`` (the rest go back to training)."""
    train, evals = [], []
    for i, sid in enumerate(sample_ids):
        (evals if held_out(sid, fraction) else train).append(i)
    if max_eval is not None and len(evals) > max_eval:
        train = sorted(train + evals[max_eval:])
        evals = evals[:max_eval]
    return train, evals
