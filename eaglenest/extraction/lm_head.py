"""The target's LM head and the argmax check of regenerated samples: does argmax(lm_head @ final_hidden[t]) equal
token t + 1 on the answer spans (the capture predicts the target's own greedy tokens)? Validation reports the
agreement per sample and may refuse a shard below a floor (:mod:`eaglenest.extraction.validate`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from eaglenest import contract


def load_lm_head(model_dir: str | Path) -> torch.Tensor:
    """The target's LM head [V, H] (or its tied input embedding), read alone from the safetensors files."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        for f in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as sf:
                if name in sf.keys():  # noqa: SIM118 (safe_open has no __contains__)
                    return sf.get_tensor(name).float()  # [V, H]
    raise contract.ContractError(f"{model_dir}: no lm_head.weight or model.embed_tokens.weight in its safetensors")


ArgmaxItem = tuple[torch.Tensor, torch.Tensor, Sequence[tuple[int, int]]]
"""(final_hidden [T, H], input_ids [T], loss spans) of one sample."""


ARGMAX_GROUP_ROWS = 1 << 16
"""Answer positions sent to the LM head's device in one copy (and, in validation, checked in one pass)."""


def argmax_agreements(items: Sequence[ArgmaxItem], lm_head: torch.Tensor, *, chunk: int = 1024,
                      group_rows: int = ARGMAX_GROUP_ROWS) -> list[tuple[int, int]]:
    """(matches, positions) per item: argmax(lm_head @ final_hidden[t]) == input_ids[t + 1] for t + 1 in a span.

    The items' rows go to ``lm_head``'s device in one copy per ``group_rows`` rows and their hits come back in
    one: on a GPU that the capture servers share, each round trip waits for the GPU's time slice, so there are
    few per validation chunk instead of one per 256 rows of every sample (on the H200, validation was busy 8.7 ms
    per regenerated sample of 233 tokens, several times what its CPU checks cost)."""
    out: list[tuple[int, int]] = []
    group: list[tuple[torch.Tensor, torch.Tensor]] = []
    rows = 0
    for final_hidden, input_ids, spans in items:
        group.append(answer_rows(final_hidden, input_ids, spans))
        rows += int(group[-1][1].numel())
        if rows >= group_rows:
            out += argmax_hits(group, lm_head, chunk)
            group, rows = [], 0
    return out + (argmax_hits(group, lm_head, chunk) if group else [])


def predicting_positions(spans: Sequence[tuple[int, int]]) -> list[int]:
    """The positions t whose final state predicts a span token t + 1 (a span's first token at 0 has none)."""
    return [t - 1 for a, b in spans for t in range(max(a, 1), b)]


def answer_rows(final_hidden: torch.Tensor, input_ids: torch.Tensor, spans: Sequence[tuple[int, int]]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(final_hidden at the predicting positions [P, H], the span tokens they predict [P]) of one sample."""
    pos = torch.tensor(predicting_positions(spans), dtype=torch.long)  # [P]
    return final_hidden[pos], input_ids[pos + 1].long()


def argmax_hits(group: Sequence[tuple[torch.Tensor, torch.Tensor]], lm_head: torch.Tensor,
                 chunk: int) -> list[tuple[int, int]]:
    sizes = [int(y.numel()) for _, y in group]
    if not sum(sizes):
        return [(0, 0) for _ in group]
    dev = lm_head.device
    x = torch.cat([x for x, _ in group]).to(dev)  # [P, H]
    y = torch.cat([y for _, y in group]).to(dev)  # [P]
    hits = torch.empty(x.shape[0], dtype=torch.bool, device=dev)  # [P]
    for i in range(0, x.shape[0], chunk):
        logits = x[i : i + chunk].float() @ lm_head.T  # [c, V]
        hits[i : i + chunk] = logits.argmax(-1) == y[i : i + chunk]
    return [(int(h.sum()), n) for h, n in zip(hits.cpu().split(sizes), sizes, strict=True)]


def argmax_agreement(final_hidden: torch.Tensor, input_ids: torch.Tensor, spans: Sequence[tuple[int, int]],
                     lm_head: torch.Tensor) -> tuple[int, int]:
    """(matches, positions) of one sample; see :func:`argmax_agreements`."""
    return argmax_agreements([(final_hidden, input_ids, spans)], lm_head)[0]
