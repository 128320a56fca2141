"""Training-time test (TTT): the k-step unrolled EAGLE-3 objective and its metrics.

Owns the math that turns one padded batch of captured samples into per-step losses, accuracies and
simulated accept lengths. Convention (the same as :mod:`eaglenest.drafter.model`, i.e. SGLang's
inference): for anchor ``t`` and TTT step ``i`` (0-based)

- the drafter reads token ``x[t+1+i]`` (ground truth, teacher-forced) at position ``t + i``; its
  hidden input is ``fc(aux[t])`` at step 0 and its own pre-norm output of step ``i-1`` after that;
- its attention sees the step-0 keys of positions ``<= t`` plus its own keys of steps ``1..i`` at
  anchor ``t`` (exactly the draft KV cache of a chain anchored at ``t`` in SGLang);
- the target is the target model's distribution at row ``j = t+1+i`` (``final_hidden[j]`` through the
  target LM head, restricted to the draft vocabulary and renormalised): the prediction of ``x[j+1]``;
- the row counts only if ``loss_mask[j]`` (the target row is an assistant token: the drafter is
  trained where the target itself generates) and ``j`` is inside the sample.

Loss of step i = sum over counted rows of KL(p_target || q_draft), rows whose target argmax lies
outside the draft vocabulary excluded (SpecForge's position mask); the caller divides by the
global number of counted rows (``step_counts``) and weighs step i by ``decay ** i``.
Accuracy of step i: draft argmax (mapped to target ids) == target argmax over the FULL vocabulary.
Simulated accept length at depth d: 1 + the number of leading steps that match (bonus token
included; exact for data the target generated greedily, teacher-forced otherwise), averaged two ways:
- per anchor (:func:`accept_lengths`): every anchor whose step-0 row counts weighs the same;
- per verify cycle (:func:`cycle_walk`): the anchors a live greedy decode would actually draft from.
  Live decoding starts a cycle at the first answer token, accepts ``a`` drafts, and starts the next
  cycle ``a + 1`` tokens later, so easy stretches are crossed in few cycles and hard ones in many:
  the per-cycle mean (what SGLang reports: (accepted drafts + verifies) / verifies) is lower than the
  per-anchor mean whenever acceptance varies along the answer. It is the estimate that predicts live.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eaglenest.drafter.kl_loss import draft_kl
from eaglenest.drafter.layers import repeat_kv, rope_cos_sin
from eaglenest.drafter.model import Eagle3Drafter


@dataclass(frozen=True, slots=True)
class RowPlan:
    """Where a batch's loss rows are, worked out on the host from its loss mask.

    A GPU step that indexes with a boolean mask or reads a count back (``int(mask.sum())``) waits there until
    the device has caught up, and the host cannot queue the next kernels meanwhile; with every size known on
    the host, a training step runs without such waits (one read-back at its end)."""

    num_tokens: int
    """Real (unpadded) tokens of the batch."""
    cols: torch.Tensor  # [M] int64 on the host: column j of each loss row (j >= 1), in (b, j) order
    host_flat: torch.Tensor  # [M] int64 on the host: flat index b*T + j of each loss row
    flat: torch.Tensor  # [M] int64 on the batch's device: the same

    @property
    def num_rows(self) -> int:
        return int(self.cols.numel())

    def step_counts(self, k: int) -> list[int]:
        """Rows counted by each TTT step ``i < k``: the loss rows with ``j >= 1 + i``."""
        return (self.cols >= torch.arange(1, k + 1)[:, None]).sum(1).tolist()

    def unrolled(self, k: int, width: int) -> UnrolledRows:
        """The (step, row) pairs of k TTT steps over a batch of ``width`` = B*T positions, as one index set."""
        i = torch.arange(k)[:, None]  # [k, 1]
        valid = self.cols >= 1 + i  # [k, M]
        anchor = self.host_flat - 1 - i  # [k, M] flat index of anchor t = j - 1 - i (where valid)
        src = torch.where(valid, anchor, 0) + i * width
        dst = torch.where(valid, anchor, width) + i * (width + 1)
        packed = torch.stack((src, dst, valid.long())).to(self.flat.device, non_blocking=True)  # [3, k, M]
        return UnrolledRows(src=packed[0].view(-1), dst=packed[1].view(-1), valid=packed[2].bool(),
                            counted=tuple(valid.sum(1).tolist()))

    def to(self, device: torch.device | str) -> RowPlan:
        return RowPlan(self.num_tokens, self.cols, self.host_flat, self.host_flat.to(device, non_blocking=True))


@dataclass(frozen=True, slots=True)
class UnrolledRows:
    """Every TTT step's loss rows in one layout, [k, M]: pair (i, m) is loss row m scored by step i from its
    anchor ``t = j - 1 - i``. A pair whose anchor would fall before the sample (``j < 1 + i``) is not counted:
    it reads position 0 of the step's output and weighs 0, so all k steps share one gather, one head and one
    loss."""

    src: torch.Tensor  # [k*M] int64 on the device: row of the k stacked step outputs [k*B*T] of each pair
    dst: torch.Tensor  # [k*M] int64 on the device: its anchor in [k, B*T + 1] (uncounted pairs: the last slot)
    valid: torch.Tensor  # [k, M] bool on the device: the pair is counted
    counted: tuple[int, ...]  # [k] counted pairs per step, on the host


def row_plan(loss_mask: torch.Tensor, lengths: torch.Tensor) -> RowPlan:
    """The plan of a [B, T] loss mask (row 0 of a sample is never the target of an anchor); computed on the
    host, so call it before the mask moves to a GPU (it syncs otherwise)."""
    mask = loss_mask.detach().cpu().clone()
    mask[:, 0] = False
    b, j = mask.nonzero(as_tuple=True)
    flat = b * mask.shape[1] + j
    return RowPlan(int(lengths.sum()), j, flat, flat.to(loss_mask.device))


@dataclass(frozen=True, slots=True)
class Batch:
    """Right-padded micro-batch (padding rows are never counted)."""

    input_ids: torch.Tensor  # [B, T] int64
    loss_mask: torch.Tensor  # [B, T] bool (False on padding)
    aux_hidden: torch.Tensor  # [B, T, k*Ht]
    final_hidden: torch.Tensor  # [B, T, H]
    lengths: torch.Tensor  # [B] int64
    indices: tuple[int, ...]
    plan: RowPlan | None = None
    """Made on the host before the move to a device (:func:`row_plan`); built on use when missing."""

    @property
    def num_tokens(self) -> int:
        return self.plan.num_tokens if self.plan is not None else int(self.lengths.sum())

    def row_plan(self) -> RowPlan:
        return self.plan if self.plan is not None else row_plan(self.loss_mask, self.lengths)

    def to(self, device: torch.device | str) -> Batch:
        plan = self.row_plan()  # on the host, before the mask moves
        return Batch(self.input_ids.to(device), self.loss_mask.to(device), self.aux_hidden.to(device),
                     self.final_hidden.to(device), self.lengths.to(device), self.indices, plan.to(device))


@dataclass(frozen=True, slots=True)
class TargetRows:
    """Target-side tables for the rows that carry loss (row = a position j with loss_mask[j])."""

    row_of: torch.Tensor  # [B, T] int64, -1 where no row
    p: torch.Tensor  # [M, Vd] fp32 target distribution over the draft vocabulary
    neg_entropy: torch.Tensor  # [M] fp32 sum(p * log p)
    argmax: torch.Tensor  # [M] int64 target id of the full-vocabulary argmax
    in_vocab: torch.Tensor  # [M] bool
    plan: RowPlan | None = None  # the batch's (target_rows sets it; each TTT step's anchors come from it)


@dataclass(frozen=True, slots=True)
class StepResult:
    """One TTT step's share of a :class:`TTTResult`."""

    loss_sum: torch.Tensor  # [] differentiable sum of KL over counted in-vocab rows
    correct: torch.Tensor  # [] int64 on the batch's device (read it when the step is done, not per step)
    counted: int
    match: torch.Tensor  # [B, T] bool at anchors (False where not counted)


@dataclass(frozen=True, slots=True)
class TTTResult:
    """The k TTT steps of one batch, each statistic one tensor over the steps (read back once, not per step)."""

    loss_sum: torch.Tensor  # [k] differentiable sum of KL over counted in-vocab rows
    correct: torch.Tensor  # [k] int64 on the batch's device
    kept: torch.Tensor  # [k] int64: counted rows whose target argmax is in the draft vocabulary
    counted: tuple[int, ...]  # [k] on the host
    match: torch.Tensor  # [k, B, T] bool at anchors (False where not counted)

    def __len__(self) -> int:
        return len(self.counted)

    def __getitem__(self, i: int) -> StepResult:
        return StepResult(self.loss_sum[i], self.correct[i], self.counted[i], self.match[i])


def step_counts(loss_mask: torch.Tensor, k: int) -> torch.Tensor:
    """[k] number of counted rows per TTT step: loss rows j with j >= 1 + i."""
    col = torch.arange(loss_mask.shape[1], device=loss_mask.device)
    first = torch.arange(1, k + 1, device=loss_mask.device)[:, None]  # [k, 1]
    return (loss_mask[:, None, :] & (col >= first)).sum((0, 2)).to(torch.float64)


@torch.no_grad()
def target_rows(batch: Batch, head_full: torch.Tensor, draft_ids: torch.Tensor, t2d: torch.Tensor,
                *, chunk: int = 2048) -> TargetRows:
    """Target log-probs over the draft vocabulary and full argmax at every loss row."""
    plan = batch.row_plan()
    b, t = batch.loss_mask.shape
    n, dev = plan.num_rows, batch.loss_mask.device
    row_of = torch.full((b * t,), -1, dtype=torch.int64, device=dev)
    row_of[plan.flat] = torch.arange(n, device=dev)
    row_of = row_of.view(b, t)
    rows = batch.final_hidden.reshape(b * t, -1).index_select(0, plan.flat).to(head_full.dtype)  # [M, H]
    ps, negents, argmaxes = [], [], []
    head_draft = head_full[draft_ids]  # [Vd, H]
    for s in range(0, n, chunk):
        h = rows[s : s + chunk]
        argmaxes.append((h @ head_full.T).max(-1).indices)  # [m]  (max() is ~5x faster than argmax in bf16)
        logp = F.log_softmax((h @ head_draft.T).float(), dim=-1)  # [m, Vd]
        p = logp.exp()
        ps.append(p)
        negents.append((p * logp).sum(-1))
    vd = draft_ids.numel()
    p = torch.cat(ps) if ps else torch.zeros(0, vd, device=dev)
    negent = torch.cat(negents) if negents else torch.zeros(0, device=dev)
    argmax = torch.cat(argmaxes) if argmaxes else torch.zeros(0, dtype=torch.int64, device=dev)
    return TargetRows(row_of=row_of, p=p, neg_entropy=negent, argmax=argmax, in_vocab=t2d[argmax], plan=plan)


def shift_left(x: torch.Tensor, n: int, fill: int = 0) -> torch.Tensor:
    """x[:, t] <- x[:, t + n] (tail filled)."""
    out = torch.full_like(x, fill)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


def ttt_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, ks: list[torch.Tensor],
                  vs: list[torch.Tensor], future: torch.Tensor) -> torch.Tensor:
    """Query of step i at anchor t over step-0 keys (causal) and its own chain keys of steps 1..i.

    q, k0, v0, ks[j], vs[j]: [B, nh, T, hd] (kv already repeated to nh heads); future [T, T] bool, True above
    the diagonal (the step-0 keys a query may not see) -> [B, nh, T, hd].
    One softmax over [T step-0 scores ; i chain scores] per query (in the compute dtype: the CPU
    kernel accumulates in fp32).
    """
    t = q.shape[2]
    q = q * q.shape[-1] ** -0.5
    s0 = (q @ k0.transpose(-1, -2)).masked_fill_(future, float("-inf"))  # [B, nh, T, T]
    sd = (torch.stack(ks, dim=-2) @ q[..., None]).squeeze(-1)  # [B, nh, T, i]
    p0, pd = torch.softmax(torch.cat((s0, sd), dim=-1), dim=-1).split([t, len(ks)], dim=-1)
    return p0 @ v0 + (pd[..., None, :] @ torch.stack(vs, dim=-2)).squeeze(-2)


def unroll(model: Eagle3Drafter, batch: Batch, k: int):
    """Yield the drafter's pre-norm output [B, T, H] of each TTT step (anchor t in column t).

    What does not depend on the step is computed once for all k: the normalised embeddings of every token a
    step reads (step i reads column ``t + 1 + i``, zeros past the end), RoPE's tables for positions
    ``0 .. T + k - 2`` (step i reads ``t + i``), the causal mask and the stacked q|k|v and gate|up weights."""
    cfg = model.config
    layer, attn = model.midlayer, model.midlayer.self_attn
    n_rep = cfg.num_attention_heads // cfg.num_key_value_heads
    t = batch.input_ids.shape[1]
    hidden = model.project(batch.aux_hidden)  # [B, T, H]
    ids = F.pad(batch.input_ids, (0, k))  # [B, T + k] token x[c] in column c, 0 past the end
    embeds = model.embed(ids)  # [B, T + k, H]
    normed = layer.input_layernorm.normalize(embeds)  # [B, T + k, H] fp32, before the norm's weight
    cos, sin = rope_cos_sin(torch.arange(t + k - 1, device=hidden.device)[None], cfg.head_dim, cfg.rope_theta)
    future = torch.ones(t, t, dtype=torch.bool, device=hidden.device).triu(1)
    w_qkv, w_gate_up = attn.fused_qkv_weight(), layer.mlp.fused_gate_up_weight()
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for i in range(k):
        e = layer.input_layernorm.scale(normed[:, 1 + i : 1 + i + t], embeds.dtype)  # [B, T, H] token x[t+1+i]
        q, key, val = attn.qkv_fused(layer.join(e, hidden), w_qkv, cos[:, i : i + t], sin[:, i : i + t])  # pos t+i
        key, val = repeat_kv(key, n_rep), repeat_kv(val, n_rep)
        if i == 0:
            a = F.scaled_dot_product_attention(q, key, val, is_causal=True)
        else:
            a = ttt_attention(q, keys[0], values[0], [*keys[1:], key], [*values[1:], val], future)
        keys.append(key)
        values.append(val)
        hidden = layer.finish(attn.out(a), hidden, w_gate_up)  # [B, T, H] fed back to the next step
        yield hidden


def ttt_forward(model: Eagle3Drafter, batch: Batch, rows: TargetRows, k: int) -> TTTResult:
    """Unroll k TTT steps over a batch and score all of them at once (the losses keep their graph).

    The counted (step, row) pairs of every step are gathered from the stacked step outputs into one
    [k*M, H] block, so the head, the log-softmax, the KL and the accuracy run once per batch, not per step."""
    outs = torch.stack(list(unroll(model, batch, k)))  # [k, B, T, H]
    _, b, t, h = outs.shape
    u = rows.plan.unrolled(k, b * t)
    m = rows.p.shape[0]
    z = model.head(outs.view(k * b * t, h).index_select(0, u.src))  # [k*M, Vd] draft logits (bf16 under autocast)
    kl, top = draft_kl(z, rows.p, rows.neg_entropy)  # KL(p || q) = sum p log p - sum p log q, each row's argmax
    keep = u.valid & rows.in_vocab  # [k, M]
    loss_sum = (kl.view(k, m) * keep).sum(-1)  # [k]
    with torch.no_grad():
        hit = (model.to_target_ids(top).view(k, m) == rows.argmax) & u.valid
        match = torch.zeros(k * (b * t + 1), dtype=torch.bool, device=outs.device).index_copy_(0, u.dst, hit.view(-1))
        match = match.view(k, b * t + 1)[:, : b * t].view(k, b, t)
    return TTTResult(loss_sum=loss_sum, correct=hit.sum(-1), kept=keep.sum(-1), counted=u.counted, match=match)


class TTTObjective(nn.Module):
    """The drafter behind one forward returning the step's weighted loss, so DDP sees every parameter use in
    ``forward``."""

    def __init__(self, drafter: Eagle3Drafter) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, batch: Batch, rows: TargetRows, k: int, scales: torch.Tensor) -> tuple[torch.Tensor, TTTResult]:
        """``scales`` [k] fp32 on the device: the weight of each step's loss sum."""
        results = ttt_forward(self.drafter, batch, rows, k)
        return (results.loss_sum * scales).sum(), results


def accepted_drafts(results: TTTResult, depth: int) -> torch.Tensor:
    """[B, T] int64: leading matching steps (accepted drafts) of the chain anchored at t, at most ``depth``."""
    return results.match[:depth].long().cumprod(0).sum(0)


def accept_lengths(results: TTTResult, rows: TargetRows, depth: int) -> tuple[float, int]:
    """(sum of simulated accept lengths, number of anchors) at draft depth ``depth`` (bonus included)."""
    anchors = shift_left(rows.row_of, 1, fill=-1) >= 0  # [B, T]
    accepted = accepted_drafts(results, depth)
    n = int(anchors.sum())
    return float((1 + accepted[anchors]).sum()), n


def cycle_walk(loss_mask: Sequence[bool], accepted: Sequence[int]) -> list[int]:
    """Accepted drafts of each verify cycle of the live greedy decode that wrote this sample's answers.

    ``loss_mask`` [T]: the answer tokens (each maximal run is one turn the target generated, its last
    token the end of turn or the length cap); ``accepted`` [T]: accepted drafts of the chain whose root
    is token ``t + 1`` (anchor t). A turn's first token comes from the prefill; a cycle rooted at token
    r accepts ``a`` drafts (never past the turn's last token e) and the next root is ``r + a + 1``; a
    root at e is never drafted from (the request has ended). Turns are :func:`answer_turns` (a run of answer
    tokens at token 0 has no prompt and is left out).
    """
    out: list[int] = []
    for s, e in answer_turns(loss_mask):
        r = s
        while r < e:
            a = min(int(accepted[r - 1]), e - r)
            out.append(a)
            r += a + 1
    return out


def answer_turns(loss_mask: Sequence[bool]) -> list[tuple[int, int]]:
    """(first, last) token index of each maximal run of answer tokens with a prompt before it (a run at token 0
    has no prompt: no live decode wrote it)."""
    mask = [bool(m) for m in loss_mask]
    out = []
    t = 0
    while t < len(mask):
        if not mask[t]:
            t += 1
            continue
        e = t
        while e + 1 < len(mask) and mask[e + 1]:
            e += 1
        if t > 0:
            out.append((t, e))
        t = e + 1
    return out
