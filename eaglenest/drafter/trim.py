"""A smaller draft vocabulary for an exported drafter: the LM head cut to its most frequent tokens.

Owns trimming an export (either format) to the ``size`` draft tokens most frequent in the drafter's training
answers. A draft forward streams its weights, and the head is the largest of them (32,000 x 576 of a 44M-value
drafter), so on a CPU a smaller head is a cheaper draft step; tokens outside it can no longer be drafted, which costs
accept length in proportion to their share of the answers (the coverage the result reports).

Invariants: the trimmed folder is a regular export (same writer, :func:`~eaglenest.drafter.export.export_drafter`),
with every weight but the head's rows, ``d2t`` and ``t2d`` unchanged; the kept head rows are the source's rows for
the same target ids, so for any input the trimmed drafter's logits are the source's at those ids.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eaglenest import contract
from eaglenest.drafter.export import export_drafter, read_export, speculative_tokens
from eaglenest.drafter.vocab import DraftVocab, count_answer_tokens, count_tokens, loss_tokens


@dataclass(frozen=True, slots=True)
class TrimReport:
    out_dir: Path
    size_before: int
    size: int
    coverage_before: float
    """Share of the counted tokens the source's draft vocabulary holds."""
    coverage: float
    """Share of the counted tokens the trimmed one holds."""

    def to_dict(self) -> dict:
        return {"out_dir": str(self.out_dir), "size_before": self.size_before, "size": self.size,
                "coverage_before": self.coverage_before, "coverage": self.coverage}


def token_counts(source: str | Path, vocab_size: int) -> np.ndarray:
    """Loss-masked token occurrences [V] of ``source``: a store URL or extraction folder (its samples' loss masks),
    or a JSON-lines file of the target's answers (``output_ids``, the regeneration recipe's ``answers.jsonl``)."""
    path = Path(str(source).removeprefix("file://"))
    if path.is_file():
        return count_answer_tokens(path, vocab_size)
    from eaglenest.store.extraction import open_samples

    return count_tokens(loss_tokens(open_samples(source)), vocab_size)


def trim_export(src: str | Path, out_dir: str | Path, *, size: int, counts: np.ndarray | str | Path,
                overwrite: bool = False) -> TrimReport:
    """Write ``src`` (an eaglenest export) to ``out_dir`` with its draft vocabulary cut to the ``size`` ids most
    frequent in ``counts`` [V] (:meth:`DraftVocab.most_frequent`), or in what :func:`token_counts` counts there
    (a store, an extraction folder, an answers file: read once the export and the size are known good)."""
    src = Path(src)
    manifest, drafter = read_export(src, what="trim-vocab takes an eaglenest export")
    cfg, weights = drafter.config, dict(drafter.weights)
    vocab = DraftVocab.from_d2t(weights["d2t"], cfg.vocab_size)
    if size >= vocab.size:
        raise contract.ContractError(f"{src}: its draft vocabulary has {vocab.size} tokens; trimming needs a smaller "
                                     f"size, got {size}")
    if not isinstance(counts, np.ndarray):
        counts = token_counts(counts, cfg.vocab_size)
    trimmed, keep = vocab.most_frequent(counts, size)
    weights.update({"lm_head.weight": weights["lm_head.weight"][keep].contiguous(), "d2t": trimmed.d2t,
                    "t2d": trimmed.t2d})
    before = vocab.share_of(counts)
    training = drafter.training
    training["trimmed"] = {"from": str(src), "draft_vocab_before": vocab.size, "draft_vocab": size,
                           "coverage_before": before, "coverage": trimmed.coverage}
    source = dataclasses.replace(drafter, weights=weights, config=dataclasses.replace(cfg, draft_vocab_size=size),
                                 training=training)
    out = export_drafter(source, out_dir, fmt=manifest["format"], dtype=manifest["dtype"], overwrite=overwrite,
                         **speculative_tokens(src, manifest["format"]))
    return TrimReport(out, vocab.size, size, before, trimmed.coverage)
