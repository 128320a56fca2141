"""Offline accept length: teacher-forced simulation of EAGLE-3 chain drafting over a store (no engine).

Owns the simulation and its estimator. For one sample (tokens x [T], aux_hidden [T, k*H_t],
final_hidden [T, H_t] captured by the serving engine) and every start position t:

- the target's greedy token after position i is ``g[i] = argmax(lm_head(final_hidden[i]))``,
- draft step 1 reads (embed(x[t+1]), fc(aux[t])) at position t, attending to the draft keys of
  positions 0..t built from target features, exactly the state the live decoder is in when x[t+1]
  is the root; steps j >= 2 read (embed(d[j-1]), the draft's own hidden) at position t+j-1 and
  attend to those keys plus the chain's own earlier keys. All starts run in parallel (one batched
  forward per step with a per-chain mask), sharing ``eaglenest.drafter.model.Eagle3Drafter``'s modules.
- draft j is accepted while d[j] == g[t+j]. The target context behind label g[t+j+1] is the DATA
  token x[t+j+1]; the live target would see d[j] there. Where they differ the chain is censored
  (not evaluable further). Accept length is estimated like a survival curve:
  ``1 + sum_j prod_{i<=j} p_i`` with ``p_i`` = P(step i accepted | steps < i accepted, evaluable),
  which is unbiased under censoring; ``accept_length_lower`` counts censored chains as failures.
  On regenerated data (the target's own greedy answers) nothing is censored and both agree.

Starts are the loss-masked (assistant) positions whose k labels exist. Accept length counts the
bonus token, as everywhere in eaglenest.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from eaglenest.drafter.model import Eagle3Drafter, repeat_kv, rope_cos_sin
from eaglenest.speculative.draft import load_exported_drafter, target_embedding, target_lm_head


class SampleLike(Protocol):
    sample_id: str
    input_ids: torch.Tensor  # int32 [T]
    loss_mask: torch.Tensor  # bool [T]
    aux_hidden: torch.Tensor  # bf16 [T, k*H]
    final_hidden: torch.Tensor  # bf16 [T, H]


class StoreLike(Protocol):
    def __len__(self) -> int: ...
    def __getitem__(self, i: int) -> SampleLike: ...


def heldout_indices(store: StoreLike, fraction: float, max_samples: int | None) -> list[int]:
    """Store indices of the drafter's evaluation split (:func:`eaglenest.store.split.split_indices`:
    the same ids training held out, capped the same way), so the simulation never scores trained-on data."""
    from eaglenest.store.split import split_indices

    ids = getattr(store, "sample_ids", None)
    if ids is None:
        ids = [store[i].sample_id for i in range(len(store))]
    return split_indices(list(ids), fraction, max_eval=max_samples)[1]


def _step_inputs(draft: Eagle3Drafter, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
    """ids [1, M], hidden [1, M, H], positions [1, M] -> q [1,nh,M,d], k/v [1,nkv,M,d] (RoPE applied)."""
    layer, c = draft.midlayer, draft.config
    x = layer.attn_input(draft.embed(ids), hidden)  # [1, M, 2H]
    cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta)
    return layer.self_attn.qkv(x, cos, sin)


def _step_output(draft: Eagle3Drafter, attn: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """attn [1, nh, M, d], residual hidden [1, M, H] -> (pre-norm out [1, M, H], target-id drafts [M])."""
    out = draft.midlayer.finish(draft.midlayer.self_attn.out(attn), hidden)
    return out, draft.to_target_ids(draft.head(out)[0].argmax(-1))


def chain_drafts(draft: Eagle3Drafter, input_ids: torch.Tensor, aux_hidden: torch.Tensor, num_steps: int,
                 *, row_chunk: int = 256) -> torch.Tensor:
    """Drafts of the chain started at every position: [T-1, num_steps] target ids (row t = start t)."""
    dev, dtype = draft.d2t.device, draft.fc.weight.dtype
    x = input_ids.to(dev).long()  # [T]
    m = x.shape[0] - 1
    pos = torch.arange(m, device=dev).view(1, m)  # [1, M]
    hidden = draft.project(aux_hidden[:m].to(dev, dtype)[None])  # [1, M, H] from target features
    q, k1, v1 = _step_inputs(draft, x[1:].view(1, m), hidden, pos)
    rep = draft.config.num_attention_heads // draft.config.num_key_value_heads
    k1e, v1e = repeat_kv(k1, rep), repeat_kv(v1, rep)  # [1, nh, M, d]
    causal = torch.ones(m, m, dtype=torch.bool, device=dev).tril()  # [M, M]
    hidden, d = _step_output(draft, torch.nn.functional.scaled_dot_product_attention(q, k1e, v1e, attn_mask=causal),
                             hidden)
    out, own_k, own_v = [d], [], []
    for j in range(2, num_steps + 1):
        q, kj, vj = _step_inputs(draft, d.view(1, m), hidden, pos + j - 1)
        own_k.append(repeat_kv(kj, rep))
        own_v.append(repeat_kv(vj, rep))
        attn = torch.empty_like(q)  # [1, nh, M, d]
        for r0 in range(0, m, row_chunk):
            rows = slice(r0, min(m, r0 + row_chunk))
            attn[:, :, rows] = _chain_attention(q[:, :, rows], k1e, v1e, [kk[:, :, rows] for kk in own_k],
                                                [vv[:, :, rows] for vv in own_v], causal[rows])
        hidden, d = _step_output(draft, attn, hidden)
        out.append(d)
    return torch.stack(out, dim=1)  # [M, k]


def _chain_attention(q, k_base, v_base, own_k, own_v, mask):
    """q [1,nh,C,d]; base k/v [1,nh,M,d] under mask [C, M]; own k/v lists of [1,nh,C,d] (diagonal)."""
    scale = q.shape[-1] ** -0.5
    s_base = (q @ k_base.transpose(-1, -2)).float() * scale  # [1, nh, C, M]
    s_base = s_base.masked_fill(~mask, float("-inf"))
    s_own = torch.stack([(q * kk).sum(-1) for kk in own_k], dim=-1).float() * scale  # [1, nh, C, j-1]
    p = torch.softmax(torch.cat([s_base, s_own], dim=-1), dim=-1).to(q.dtype)
    p_base, p_own = p[..., : k_base.shape[2]], p[..., k_base.shape[2]:]
    out = p_base @ v_base  # [1, nh, C, d]
    for i, vv in enumerate(own_v):
        out = out + p_own[..., i: i + 1] * vv
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class SampleChains:
    accepted: list[int]
    censored: list[bool]
    """censored[c]: the chain's data left the drafted path after ``accepted[c]`` acceptances."""
    agree: int
    """Loss tokens whose data token is the target's greedy choice."""
    loss_tokens: int


def score_sample(draft: Eagle3Drafter, lm_head: torch.Tensor, sample: SampleLike, num_steps: int) -> SampleChains:
    x = sample.input_ids.long()  # [T]
    t_len = x.shape[0]
    mask = sample.loss_mask.bool()  # [T]
    with torch.inference_mode():
        g = (sample.final_hidden.to(lm_head.dtype) @ lm_head.T).argmax(-1).cpu()  # [T]: target's next token
        drafts = chain_drafts(draft, x, sample.aux_hidden, num_steps).cpu() if t_len > 1 else None  # [T-1, k]
    agree = int(((g[:-1] == x[1:]) & mask[1:]).sum())
    accepted, censored = [], []
    for t in range(0, t_len - num_steps):
        if not mask[t + 1]:
            continue
        a, cut = 0, False
        for j in range(1, num_steps + 1):
            dj = int(drafts[t, j - 1])
            if dj != int(g[t + j]):
                break
            a = j
            if j < num_steps and int(x[t + j + 1]) != dj:
                cut = True
                break
        accepted.append(a)
        censored.append(cut)
    return SampleChains(accepted=accepted, censored=censored, agree=agree, loss_tokens=int(mask[1:].sum()))


@dataclass(frozen=True, kw_only=True, slots=True)
class OfflineResult:
    samples: int
    chains: int
    num_steps: int
    accept_length: float
    """Survival estimate 1 + sum_j prod_{i<=j} p_i (bonus counted); censoring-robust."""
    accept_length_lower: float
    """Mean of (accepted + 1) counting censored chains as stopped (a lower bound)."""
    conditional_at: tuple[float, ...]
    censored_share: float
    target_agreement: float
    """Share of loss tokens equal to the target's greedy choice (1.0 on regenerated data)."""
    sample_ids: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(chains: Iterable[SampleChains], num_steps: int, sample_ids: Sequence[str]) -> OfflineResult:
    accepted, censored, agree, loss = [], [], 0, 0
    for c in chains:
        accepted += c.accepted
        censored += c.censored
        agree += c.agree
        loss += c.loss_tokens
    cond = []
    for j in range(1, num_steps + 1):
        reached = [a for a, cut in zip(accepted, censored, strict=True) if a >= j or (a == j - 1 and not cut)]
        cond.append(sum(a >= j for a in reached) / len(reached) if reached else 0.0)
    survival = 1.0 + sum(math.prod(cond[:j]) for j in range(1, num_steps + 1))
    n = len(accepted)
    return OfflineResult(samples=len(sample_ids), chains=n, num_steps=num_steps, accept_length=survival,
                         accept_length_lower=(sum(accepted) + n) / n if n else 0.0, conditional_at=tuple(cond),
                         censored_share=sum(censored) / n if n else 0.0,
                         target_agreement=agree / loss if loss else 0.0, sample_ids=tuple(sample_ids))


def load_offline_draft(model_dir: str | Path, draft_dir: str | Path, *, dtype: str = "float32"
                       ) -> tuple[Eagle3Drafter, torch.Tensor]:
    """The draft (with the target's embedding) and the target's LM head [V, H], without the target model."""
    from eaglenest.speculative.draft import check_export_matches

    check_export_matches(draft_dir, model_dir)
    dt = getattr(torch, dtype)
    draft = load_exported_drafter(draft_dir, embed_weight=target_embedding(model_dir).to(dt), dtype=dt)
    return draft, target_lm_head(model_dir).to(dt)


def offline_accept_length(
    store: StoreLike, draft: Eagle3Drafter, lm_head: torch.Tensor, *, num_steps: int = 3,
    heldout_fraction: float = 0.05, sample_ids: Sequence[str] | None = None, max_samples: int | None = 200,
    aux_layer_ids: Sequence[int] | None = None,
) -> OfflineResult:
    """Accept length of ``draft`` simulated on the held-out samples of ``store`` (or ``sample_ids``).

    The default split is the drafter trainer's (``eval_fraction`` 0.05, ``eval_max_samples`` 200):
    pass the values the drafter was trained with. ``aux_layer_ids`` (the store's, if known) must equal
    the drafter's; a mismatch is refused.
    """
    if aux_layer_ids is not None and tuple(aux_layer_ids) != draft.config.aux_layer_ids:
        raise ValueError(f"store captured aux layers {list(aux_layer_ids)}, the drafter reads "
                         f"{list(draft.config.aux_layer_ids)}: simulate on a store captured for this draft")
    if sample_ids is not None:
        wanted = set(sample_ids)
        ids = getattr(store, "sample_ids", None) or [store[i].sample_id for i in range(len(store))]
        indices = [i for i, sid in enumerate(ids) if sid in wanted]
    else:
        indices = heldout_indices(store, heldout_fraction, max_samples)
    chains, used = [], []
    for i in indices:
        sample = store[i]
        chains.append(score_sample(draft, lm_head, sample, num_steps))
        used.append(sample.sample_id)
    if not used:
        raise ValueError(f"no held-out samples among {len(store)} (heldout_fraction={heldout_fraction}, "
                         f"sample_ids={'given' if sample_ids is not None else 'none'}): raise the fraction")
    return summarize(chains, num_steps, used)


@dataclass(frozen=True, kw_only=True, slots=True)
class Calibration:
    offline_accept_length: float
    live_accept_length: float
    ratio: float
    """offline / live (1.0 = perfectly calibrated)."""
    error: float
    """offline - live, in tokens per verify forward."""

    def to_json(self) -> dict[str, float]:
        return asdict(self)


def calibrate(offline_accept_length: float, live_accept_length: float) -> Calibration:
    """How well the store simulation predicted the accept length the server measured."""
    est = offline_accept_length
    return Calibration(offline_accept_length=est, live_accept_length=live_accept_length,
                       ratio=est / live_accept_length if live_accept_length else float("nan"),
                       error=est - live_accept_length)
