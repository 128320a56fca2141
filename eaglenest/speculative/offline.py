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

Any shape, trees included (EAGLE-2 dynamic trees as SGLang drafts them with --speculative-eagle-topk > 1), is
estimated by replay (:func:`replay_cycles`): the embedded decoder's own proposer drafts from the captured target
features cycle by cycle, and the data, which the target wrote greedily, plays the verify. One proposer call per
cycle instead of one batched forward per step, so slower than the chain simulation; CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from eaglenest.drafter.layers import repeat_kv, rope_cos_sin
from eaglenest.drafter.model import Eagle3Drafter
from eaglenest.drafter.ttt import answer_turns, cycle_walk
from eaglenest.speculative.draft import load_exported_drafter, target_embedding, target_lm_head
from eaglenest.speculative.tree import SpecShape, accept

if TYPE_CHECKING:
    from eaglenest.speculative.decoder import Proposer


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
    cycles: list[int] = dataclasses.field(default_factory=list)
    """Accepted drafts per verify cycle of the live greedy decode (:func:`~eaglenest.drafter.ttt.cycle_walk`)."""


def sample_drafts(draft: Eagle3Drafter, lm_head: torch.Tensor, sample: SampleLike, num_steps: int
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(g [T]: the target's greedy next token at each position, drafts [T-1, num_steps] or None)."""
    x = sample.input_ids.long()  # [T]
    with torch.inference_mode():
        g = (sample.final_hidden.to(lm_head.device, lm_head.dtype) @ lm_head.T).argmax(-1).cpu()  # [T] next token
        drafts = chain_drafts(draft, x, sample.aux_hidden, num_steps).cpu() if x.shape[0] > 1 else None
    return g, drafts


def chains_at_depth(sample: SampleLike, g: torch.Tensor, drafts: torch.Tensor | None, num_steps: int
                    ) -> SampleChains:
    """Score every start (and the live cycle walk) using the first ``num_steps`` drafts of each chain."""
    x = sample.input_ids.long()  # [T]
    t_len = x.shape[0]
    mask = sample.loss_mask.bool()  # [T]
    agree = int(((g[:-1] == x[1:]) & mask[1:]).sum())
    accepted, censored = [], []
    lead = [0] * t_len  # accepted drafts of the chain rooted at t + 1, for the cycle walk
    for t in range(0, t_len - 1):
        if not mask[t + 1]:
            continue
        a, cut = 0, False
        for j in range(1, min(num_steps, t_len - 1 - t) + 1):
            dj = int(drafts[t, j - 1])
            if dj != int(g[t + j]):
                break
            a = j
            if j < num_steps and t + j + 1 < t_len and int(x[t + j + 1]) != dj:
                cut = True
                break
        lead[t] = a
        if t < t_len - num_steps:  # the survival estimate uses chains whose k labels all exist
            accepted.append(a)
            censored.append(cut)
    return SampleChains(accepted=accepted, censored=censored, agree=agree, loss_tokens=int(mask[1:].sum()),
                        cycles=cycle_walk(mask.tolist(), lead))


def score_sample(draft: Eagle3Drafter, lm_head: torch.Tensor, sample: SampleLike, num_steps: int) -> SampleChains:
    g, drafts = sample_drafts(draft, lm_head, sample, num_steps)
    return chains_at_depth(sample, g, drafts, num_steps)


@dataclass(frozen=True, kw_only=True, slots=True)
class OfflineResult:
    samples: int
    chains: int
    num_steps: int
    accept_length: float
    """Survival estimate 1 + sum_j prod_{i<=j} p_i (bonus counted) over every start; censoring-robust."""
    accept_length_lower: float
    """Mean of (accepted + 1) counting censored chains as stopped (a lower bound)."""
    conditional_at: tuple[float, ...]
    censored_share: float
    target_agreement: float
    """Share of loss tokens equal to the target's greedy choice (1.0 on regenerated data)."""
    sample_ids: tuple[str, ...]
    accept_length_cycles: float = float("nan")
    """Mean (accepted + 1) over the verify cycles a live greedy decode runs (bonus counted): what
    SGLang reports. Exact on data the target generated greedily (target_agreement 1.0); the number to
    compare with live. Lower than ``accept_length`` when acceptance varies along an answer."""
    cycles: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def per_cycle(accepted: Sequence[int]) -> float:
    """Accept length per verify cycle (bonus counted) of cycles that accepted ``accepted`` drafts; NaN for none."""
    return (sum(accepted) + len(accepted)) / len(accepted) if accepted else float("nan")


def summarize(chains: Iterable[SampleChains], num_steps: int, sample_ids: Sequence[str]) -> OfflineResult:
    accepted, censored, cycles, agree, loss = [], [], [], 0, 0
    for c in chains:
        accepted += c.accepted
        censored += c.censored
        cycles += c.cycles
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
                         target_agreement=agree / loss if loss else 0.0, sample_ids=tuple(sample_ids),
                         accept_length_cycles=per_cycle(cycles),
                         cycles=len(cycles))


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
    if not indices:
        raise ValueError(f"no held-out samples among {len(store)} (heldout_fraction={heldout_fraction}, "
                         f"sample_ids={'given' if sample_ids is not None else 'none'}): raise the fraction")
    return simulate_depths(store, draft, lm_head, indices, (num_steps,))[num_steps]


def simulate_depths(store: StoreLike, draft: Eagle3Drafter, lm_head: torch.Tensor, indices: Sequence[int],
                    depths: Sequence[int]) -> dict[int, OfflineResult]:
    """One chain simulation per sample at the deepest depth, scored at every depth in ``depths``."""
    return simulate_groups(store, draft, lm_head, {None: indices}, depths)[None]


def simulate_groups(store: StoreLike, draft: Eagle3Drafter, lm_head: torch.Tensor,
                    groups: Mapping[Hashable, Sequence[int]], depths: Sequence[int]
                    ) -> dict[Hashable, dict[int, OfflineResult]]:
    """:func:`simulate_depths` for each group of ``groups`` (name -> indices; groups may overlap, e.g. a prompt set
    and its kinds), every sample drafted once."""
    deepest = max(depths)
    per_sample: dict[int, tuple[str, dict[int, SampleChains]]] = {}
    for i in dict.fromkeys(i for idx in groups.values() for i in idx):
        sample = store[i]
        g, drafts = sample_drafts(draft, lm_head, sample, deepest)
        per_sample[i] = (sample.sample_id, {d: chains_at_depth(sample, g, drafts, d) for d in depths})
    return {name: {d: summarize([per_sample[i][1][d] for i in idx], d, [per_sample[i][0] for i in idx])
                   for d in depths} for name, idx in groups.items()}


def replay_cycles(make_proposer: Callable[[], Proposer], sample: SampleLike, depth: int) -> list[int]:
    """Accepted drafts of each verify cycle of a live greedy decode of this sample's answers, drafted by
    ``make_proposer()`` (chain or tree) on the captured target features, the data standing in for the verify.

    Exact on answers the target wrote greedily (the regeneration recipe, a calibration capture): per turn the
    proposer begins after the prompt with the answer's first token as root; each cycle drafts ``depth`` deep
    (as SGLang does up to the end of a request), accepts the longest drafted path the data follows up to the
    turn's last token (:func:`eaglenest.speculative.tree.accept`) and advances by it; the next root is the token
    after it, and a root on the turn's last token ends the turn, as the request has ended there
    (:func:`cycle_walk`'s rule)."""
    x = sample.input_ids.long().tolist()
    aux = sample.aux_hidden
    cycles: list[int] = []
    with torch.inference_mode():
        for s, e in answer_turns(sample.loss_mask.tolist()):
            proposer = make_proposer()
            proposer.begin(x[:s], aux[:s], x[s])
            r = s
            while r < e:
                tree = proposer.propose(depth)
                # the target's greedy token after the root and after each node on the data's path is the data
                # (nodes off it are never read: accept follows matching children only)
                verdict = [x[r + 1], *(x[r + d + 1] if r + d + 1 <= e else -1 for d in tree.depths())]
                a = len(accept(tree, verdict)[0])
                cycles.append(a)
                if r + a + 1 >= e:
                    break
                proposer.advance(x[r + 1 : r + a + 2], aux[r : r + a + 1])
                r += a + 1
    return cycles


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplayResult:
    shape: str
    samples: int
    cycles: int
    accept_length_cycles: float
    """Mean (accepted + 1) over the verify cycles (bonus counted): what SGLang reports for this shape."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def replay_shapes(store: StoreLike, draft: Eagle3Drafter, indices: Sequence[int], shapes: Sequence[SpecShape]
                  ) -> dict[str, ReplayResult]:
    """Accept length per verify cycle of each shape, replayed (:func:`replay_cycles`) over ``store[indices]``
    (on the CPU: the embedded decoder's proposer; a drafter elsewhere is copied there)."""
    from eaglenest.speculative.drafting import Eagle3Proposer, FastDrafter
    from eaglenest.speculative.kernels import amx

    if draft.d2t.device.type != "cpu":
        import copy

        draft = copy.deepcopy(draft).cpu()
    fast: dict[str, FastDrafter] = {}
    out = {}
    for shape in shapes:
        if shape.quant not in fast:
            fast[shape.quant] = FastDrafter(draft, quant=shape.quant)
        fd = fast[shape.quant]
        # a bf16 drafter runs the embedded decoder's kernels, on AMX where the CPU has it (a tree's rows cost what one
        # row does); an fp32 one (load_offline_draft's default) plain torch
        with amx() if fd.dtype == torch.bfloat16 else contextlib.nullcontext():
            cycles = [a for i in indices for a in replay_cycles(lambda fd=fd, sh=shape: Eagle3Proposer(fd, sh),
                                                                store[i], shape.depth)]
        out[shape.name] = ReplayResult(shape=shape.name, samples=len(indices), cycles=len(cycles),
                                       accept_length_cycles=per_cycle(cycles))
    return out


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
