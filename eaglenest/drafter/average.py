"""The average of exported drafters' weights (a "model soup"): one export whose every weight is the mean of theirs.

Owns averaging drafters of one lineage, e.g. a drafter and its continuation on new data: each continuation ends in
a nearby minimum, and their mean can generalize better than either (n9 and n10, results/2026-12-05g-cpu: offline
accept length at steps 3 above both on MT-Bench, HumanEval and ShareGPT). Drafters trained apart from different
initializations share no basin: their average is not a drafter, which no check here can tell; averaging is for one
lineage.

Invariants: the sources must agree on everything but their weights' values (drafter shape, draft vocabulary, target
and capture convention), else ContractError naming what differs and nothing is written; the result is a regular
export (:func:`~eaglenest.drafter.export.export_drafter`) in the first source's format and dtype, means taken in
float32.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch

from eaglenest import contract
from eaglenest.drafter.export import export_drafter, read_export, speculative_tokens

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
        if v.is_floating_point():
            mean[k] = sum(x * d.weights[k].float() for x, (_, d) in zip(w, read, strict=True))
        else:
            mean[k] = v
    training = {"averaged": {"from": [str(s) for s in srcs], "weights": w,
                             "training": [d.training for _, d in read]}}
    return export_drafter(dataclasses.replace(first, weights=mean, training=training), out_dir,
                          fmt=manifest["format"], dtype=manifest["dtype"], overwrite=overwrite,
                          **speculative_tokens(srcs[0], manifest["format"]))


def _check_same(a_path: Path, a, b_path: Path, b) -> None:
    problems = []
    if a.config != b.config:
        diff = {f.name for f in dataclasses.fields(a.config) if getattr(a.config, f.name) != getattr(b.config, f.name)}
        problems.append(f"drafter config ({', '.join(sorted(diff))})")
    for field in _SAME_PROVENANCE:
        if getattr(a.provenance, field) != getattr(b.provenance, field):
            problems.append(f"{field} {getattr(a.provenance, field)!r} != {getattr(b.provenance, field)!r}")
    if not problems:
        if a.weights.keys() != b.weights.keys():
            problems.append(f"weight names ({', '.join(sorted(a.weights.keys() ^ b.weights.keys()))})")
        else:
            for k, v in a.weights.items():
                if v.shape != b.weights[k].shape:
                    problems.append(f"{k} shape {tuple(v.shape)} != {tuple(b.weights[k].shape)}")
                elif not v.is_floating_point() and not torch.equal(v, b.weights[k]):
                    problems.append(f"{k} (the draft vocabulary)" if k in ("d2t", "t2d") else k)
    if problems:
        raise contract.ContractError(f"{b_path} cannot be averaged with {a_path}: " + "; ".join(problems))
