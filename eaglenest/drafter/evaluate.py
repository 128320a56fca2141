"""Held-out evaluation of a drafter: per-step loss and accuracy, simulated accept length.

Owns :func:`evaluate` (teacher-forced TTT over store samples, no gradients) and :class:`EvalResult`.
Definitions are those of :mod:`eaglenest.drafter.ttt`: accuracy of step i compares the draft's top
token with the target's full-vocabulary argmax at the same row; the simulated accept length at depth
d counts the bonus token (1 + leading matches, at most d + 1). SGLang's ``--speculative-num-steps 3``
corresponds to depth 3 (``--speculative-num-draft-tokens 4`` counts the root).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from eaglenest.drafter.data import collate
from eaglenest.drafter.model import Eagle3Drafter
from eaglenest.drafter.ttt import accept_lengths, accepted_drafts, cycle_walk, target_rows, ttt_forward


@dataclass(frozen=True, slots=True)
class EvalResult:
    samples: int
    tokens: int
    anchors: int
    step_loss: list[float]
    """Mean KL(target || draft) per TTT step over counted in-vocabulary rows."""
    step_acc: list[float]
    """Top-1 agreement with the target's argmax per TTT step (out-of-vocabulary targets count as misses)."""
    accept_length: dict[int, float]
    """Simulated accept length (bonus token included) per draft depth 1..k, averaged over anchors."""
    accept_length_cycles: dict[int, float] = dataclasses.field(default_factory=dict)
    """The same per verify cycle of a live greedy decode (:func:`~eaglenest.drafter.ttt.cycle_walk`):
    the estimate that predicts SGLang's accept length on data the target generated greedily."""
    cycles: int = 0
    target_in_vocab: float = float("nan")
    """Share of counted step-0 rows whose target argmax is in the draft vocabulary (the ceiling of step_acc[0])."""

    def to_dict(self) -> dict:
        d = asdict(self)
        d["accept_length"] = {str(k): v for k, v in self.accept_length.items()}
        d["accept_length_cycles"] = {str(k): v for k, v in self.accept_length_cycles.items()}
        return d


def eval_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Positions into ``lengths`` packed by length under a padded-token budget (deterministic)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    out: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and (len(cur) + 1) * lengths[i] > max_tokens:
            out.append(cur)
            cur = []
        cur.append(i)
    return out + ([cur] if cur else [])


@torch.no_grad()
def evaluate(
    model: Eagle3Drafter,
    store,
    indices: Sequence[int],
    *,
    head_full: torch.Tensor,
    k: int,
    max_tokens: int = 4096,
    max_seq_len: int = 2048,
    dtype: torch.dtype = torch.float32,
    autocast: contextlib.AbstractContextManager | None = None,
) -> EvalResult:
    """Teacher-forced TTT metrics of ``model`` over store samples ``indices`` (the held-out split)."""
    was_training = model.training
    model.eval()
    device = model.fc.weight.device
    lengths = [min(int(store.num_tokens[i]), max_seq_len) for i in indices]
    loss_sum, kept, correct, counted = [0.0] * k, [0] * k, [0] * k, [0] * k
    al_sum, anchors, tokens = [0.0] * k, 0, 0
    cyc_sum, cyc_n = [0] * k, [0] * k
    draft_ids = model.to_target_ids(torch.arange(model.config.draft_vocab_size, device=device))
    try:
        for group in eval_batches(lengths, max_tokens):
            idx = [indices[g] for g in group]
            batch = collate([store[i] for i in idx], idx, max_seq_len=max_seq_len, dtype=dtype, device=device)
            tokens += batch.num_tokens
            with autocast or contextlib.nullcontext():
                rows = target_rows(batch, head_full, draft_ids, model.t2d)
                results = ttt_forward(model, batch, rows, k)
            step_kept, step_loss, step_correct = (x.tolist() for x in (results.kept, results.loss_sum,
                                                                       results.correct))
            for i in range(k):
                kept[i] += int(step_kept[i])
                loss_sum[i] += float(step_loss[i])
                correct[i] += int(step_correct[i])
                counted[i] += results.counted[i]
            masks = [m[:n].tolist() for m, n in zip(batch.loss_mask.cpu(), batch.lengths.tolist(), strict=True)]
            for d in range(1, k + 1):
                al_sum[d - 1] += accept_lengths(results, rows, d)[0]
                acc = accepted_drafts(results, d).cpu()
                for b, m in enumerate(masks):
                    walk = cycle_walk(m, acc[b, : len(m)].tolist())
                    cyc_sum[d - 1] += sum(walk) + len(walk)
                    cyc_n[d - 1] += len(walk)
            anchors += accept_lengths(results, rows, 1)[1]
    finally:
        model.train(was_training)
    return EvalResult(
        samples=len(indices), tokens=tokens, anchors=anchors,
        step_loss=[loss_sum[i] / max(kept[i], 1) for i in range(k)],
        step_acc=[correct[i] / max(counted[i], 1) for i in range(k)],
        accept_length={d: (al_sum[d - 1] / anchors if anchors else float("nan")) for d in range(1, k + 1)},
        target_in_vocab=kept[0] / max(counted[0], 1),
        accept_length_cycles={d: (cyc_sum[d - 1] / cyc_n[d - 1] if cyc_n[d - 1] else float("nan"))
                              for d in range(1, k + 1)},
        cycles=cyc_n[0],
    )
