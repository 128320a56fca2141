"""The average of exported drafters' weights (a "model soup"): one export whose every weight is the mean of theirs.

Owns averaging drafters of one lineage, e.g. a drafter and its continuation on new data: each continuation ends in
a nearby minimum, and their mean can generalize better than either (n9 and n10, results/2026-12-05g-cpu: offline
accept length at steps 3 above both on MT-Bench, HumanEval and ShareGPT). Drafters trained apart from different
initializations share no basin: their average is not a drafter, which no check here can tell; averaging is for one
lineage.

Invariants: the sources must agree on everything but their weights' values (drafter shape, target and capture
convention), else ContractError naming what differs and nothing is written; the result is a regular export
(:func:`~eaglenest.drafter.export.export_drafter`) in the first source's format, dtype and draft vocabulary, means
taken in float32. Draft vocabularies may differ across a widening (``train --init-from D --draft-vocab N``): the first
source's must hold every other's, and each LM-head row is the mean over the sources that hold its token (weights
renormalized), so a token the widening added keeps its trained row instead of half of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch

from eaglenest import contract
from eaglenest.drafter.export import export_drafter, read_export, speculative_tokens
from eaglenest.drafter.vocab import DraftVocab, widen_head

_SAME_PROVENANCE = ("model_hash", "hidden_size", "aux_layer_ids", "convention")


def average_exports(srcs: Sequence[str | Path], out_dir: str | Path, *, weights: Sequence[float] | None = None,
                    overwrite: bool = False) -> Path:
    """Write the (``weights``-weighted, default equal) mean of the exports ``srcs`` to ``out_dir``."""
    srcs = [Path(s) for s in srcs]
    if len(srcs) < 2:
        raise contract.ContractError(f"averaging needs two exports or more, got {len(srcs)}")
    w = [1.0] * len(srcs) if weights is None else [float(x) for x in weights]
    if len(w) != len(srcs) or any(not x > 0 for x in w):
        raise contract.ContractError(f"weights {list(w)}: one positive weight per export ({len(srcs)})")
    total = sum(w)
    w = [x / total for x in w]
    read = [read_export(s, what="averaging takes eaglenest exports") for s in srcs]
    (manifest, first), rest = read[0], read[1:]
    for src, (_, other) in zip(srcs[1:], rest, strict=True):
        _check_same(srcs[0], first, src, other)
    mean = {}
    for k, v in first.weights.items():
        if k == _HEAD:
            mean[k] = _head_mean(first, [d for _, d in read], w)
        elif v.is_floating_point():
            mean[k] = sum(x * d.weights[k].float() for x, (_, d) in zip(w, read, strict=True))
        else:
            mean[k] = v
    training = {"averaged": {"from": [str(s) for s in srcs], "weights": w,
                             "training": [d.training for _, d in read]}}
    return export_drafter(dataclasses.replace(first, weights=mean, training=training), out_dir,
                          fmt=manifest["format"], dtype=manifest["dtype"], overwrite=overwrite,
                          **speculative_tokens(srcs[0], manifest["format"]))


_HEAD = "lm_head.weight"
_VOCAB_WEIGHTS = (_HEAD, "d2t", "t2d")


def _vocab(d) -> DraftVocab:
    return DraftVocab.from_d2t(d.weights["d2t"], d.config.vocab_size)


def _head_mean(first, drafters: list, w: list[float]) -> torch.Tensor:
    """The LM head's mean in the first drafter's vocabulary: each row over the drafters that hold its token."""
    vocab = _vocab(first)
    total = torch.zeros(vocab.size, first.weights[_HEAD].shape[1])
    mass = torch.zeros(vocab.size, 1)
    for x, d in zip(w, drafters, strict=True):
        own, head = _vocab(d), d.weights[_HEAD].float()
        held = torch.ones(vocab.size, 1)
        if own.size != vocab.size:  # a narrower vocabulary the first holds (_check_same)
            head = widen_head(head, own, vocab)
            held = torch.isin(vocab.target_ids, own.target_ids).float()[:, None]
        total += x * head
        mass += x * held
    # rows every drafter holds (all of them when no vocabulary is narrower) stay the plain weighted mean: the weights
    # sum to 1 only up to float32 rounding
    return torch.where(mass == mass.max(), total, total / mass)


def _check_same(a_path: Path, a, b_path: Path, b) -> None:
    problems = []
    diff = {f.name for f in dataclasses.fields(a.config) if getattr(a.config, f.name) != getattr(b.config, f.name)}
    widened = diff == {"draft_vocab_size"} and a.config.draft_vocab_size > b.config.draft_vocab_size
    if widened and not bool(torch.isin(_vocab(b).target_ids, _vocab(a).target_ids).all()):
        problems.append(f"draft vocabulary: {a_path}'s ({a.config.draft_vocab_size} tokens) does not hold all of "
                        f"{b_path}'s ({b.config.draft_vocab_size}); only a widening of it averages with it")
    elif diff and not widened:
        hint = " (list the widest drafter first: its vocabulary must hold the others')" \
            if diff == {"draft_vocab_size"} else ""
        problems.append(f"drafter config ({', '.join(sorted(diff))}){hint}")
    for field in _SAME_PROVENANCE:
        if getattr(a.provenance, field) != getattr(b.provenance, field):
            problems.append(f"{field} {getattr(a.provenance, field)!r} != {getattr(b.provenance, field)!r}")
    if not problems:
        if a.weights.keys() != b.weights.keys():
            problems.append(f"weight names ({', '.join(sorted(a.weights.keys() ^ b.weights.keys()))})")
        else:
            for k, v in a.weights.items():
                if widened and k in _VOCAB_WEIGHTS:
                    continue  # (the vocabulary's containment is checked above)
                if v.shape != b.weights[k].shape:
                    problems.append(f"{k} shape {tuple(v.shape)} != {tuple(b.weights[k].shape)}")
                elif not v.is_floating_point() and not torch.equal(v, b.weights[k]):
                    problems.append(f"{k} (the draft vocabulary)" if k in ("d2t", "t2d") else k)
    if problems:
        raise contract.ContractError(f"{b_path} cannot be averaged with {a_path}: " + "; ".join(problems))
