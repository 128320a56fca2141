"""The drafter at decode time: a lean forward of :class:`~eaglenest.drafter.model.Eagle3Drafter`.

Owns how the embedded decoder runs the drafter per cycle, cheaply on a 2-core CPU:

- :class:`FastDrafter`: the drafter's weights regrouped once (q/k/v and gate/up fused into one
  matmul each), RoPE tables computed once, attention over grouped KV heads without copying them
  (``enable_gqa``); rows are batch-1 and 2-D ([S, H]), no module dispatch per op. In bf16 on a CPU with
  the kernels of :mod:`~eaglenest.speculative.kernels`, each norm, the RoPE of q and k, the attention and the
  argmax is one kernel call (a 1-row draft forward was ~290 torch ops, ~0.45 ms of a 2-core CPU's time).
- :class:`DraftState`: one request's preallocated keys/values (no ``torch.cat`` per step; rolling
  back speculative rows is setting the length).
- :class:`Eagle3Proposer`: the :class:`~eaglenest.speculative.decoder.Proposer` over them: one extend over
  the accepted tokens (their target features), then a chain or an EAGLE-2 dynamic tree.

Invariant: the math is ``Eagle3Drafter.forward``'s (same norms in fp32, same RoPE, same attention);
results differ only by matmul rounding, and drafts are proposals, so the decoder stays lossless.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from eaglenest.drafter.layers import apply_rope, rope_cos_sin
from eaglenest.drafter.model import Eagle3Drafter
from eaglenest.speculative.fastpath import one_query_attention
from eaglenest.speculative.kernels import decode_attention, rms_norm_out, rope_, row_argmax
from eaglenest.speculative.onednn import OneDNN, linear, phase, prepack
from eaglenest.speculative.quant import GROUP, QuantWeight
from eaglenest.speculative.tree import DraftTree, SpecShape

MAX_KERNEL_ROWS = 16
"""Rows up to which a bf16 draft forward attends with the decode kernel (longer extends: SDPA)."""


class FastDrafter:
    """Inference-only view of a drafter (shares its tensors; fused copies of q/k/v and gate/up).

    ``quant``: the linear weights also in ``q8`` (int8, a scale per output row) or ``q4`` (int4, a scale per group
    of inputs), :mod:`~eaglenest.speculative.quant`; a forward of a few bf16 rows then streams a half or a quarter
    of the bytes on the kernel; longer extends and machines without the kernel use the dequantized weights."""

    def __init__(self, draft: Eagle3Drafter, *, quant: str = "") -> None:
        cfg, layer = draft.config, draft.midlayer
        at = layer.self_attn
        self.draft, self.cfg = draft, cfg
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        w = {"qkv": torch.cat((at.q_proj.weight, at.k_proj.weight, at.v_proj.weight)).contiguous(),
             "o": at.o_proj.weight, "gate_up": torch.cat((layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight)),
             "down": layer.mlp.down_proj.weight, "fc": draft.fc.weight, "head": draft.lm_head.weight}
        self.quant = quant
        self.q: dict[str, QuantWeight] = {}
        if quant:
            kinds = {k: quant if QuantWeight.holds(quant, v.shape) else "q8" for k, v in w.items()}
            if any(kind != quant for kind in kinds.values()):  # (the measured default shape may ask q4 of any drafter)
                warnings.warn(f"drafter linears {sorted(k for k, kind in kinds.items() if kind != quant)} cannot be "
                              f"{quant} (input features not a multiple of {GROUP}): kept in q8", stacklevel=2)
            self.q = {k: QuantWeight.of(v, kinds[k], name=f"drafter linear {k!r}") for k, v in w.items()}
            w = {k: q.dequantize(w[k].dtype) for k, q in self.q.items()}
        self.w = {k: (v.detach().contiguous(), prepack(v)) for k, v in w.items()}  # name -> (weight, packed)
        self.n_in, self.n_hid = layer.input_layernorm.weight.float(), layer.hidden_norm.weight.float()
        self.n_post, self.n_final = layer.post_attention_layernorm.weight.float(), draft.norm.weight.float()
        self.embed_weight, self.d2t = draft.embed_weight, draft.d2t
        self.dtype = draft.fc.weight.dtype
        self._kernels = (self.dtype == torch.bfloat16 and self.d2t.device.type == "cpu" and self.hd % 32 == 0
                         and self.hd <= 128 and cfg.hidden_size % 16 == 0 and decode_attention() is not None)
        """bf16 on a CPU with the decode kernels: norms, RoPE, attention and argmax are one kernel call each."""
        self._cos = self._sin = torch.empty(0)
        self._rope(max(cfg.max_position_embeddings, 1))

    def _rope(self, n: int) -> None:
        if n > self._cos.shape[0]:  # positions beyond the table (long contexts): grow it once
            self._cos, self._sin = rope_cos_sin(torch.arange(n, device=self.d2t.device), self.hd,
                                                self.cfg.rope_theta)  # [n, hd] fp32

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """Target aux states [S, k*Ht] -> [S, H]."""
        return self._lin(aux.to(self.dtype), "fc")

    def _lin(self, x: torch.Tensor, name: str) -> torch.Tensor:
        if self.quant and self.q[name].fits(x):
            return self.q[name].matmul(x)
        return linear(x, *self.w[name])

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def forward(self, st: DraftState, ids: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor,
                mask: torch.Tensor | None, *, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """S new rows appended to ``st``: ids [S] target ids, hidden [S, H], positions [S]; ``mask``
        [S, length + S] bool (True = attend) or None (every row sees all earlier rows and itself:
        S == 1, or a causal extend built here). Returns (pre-norm output [S, H], logits [S, Vd]).
        ``last_only``: output [1, H] and logits [1, Vd] of the last row only; the other rows only
        write their keys/values (all that later rows read of them in a one-layer drafter)."""
        s = ids.shape[0]
        nh, nkv, hd = self.nh, self.nkv, self.hd
        x = hidden.new_empty(s, 2 * hidden.shape[-1])  # [S, 2H]: the normed embeddings, then the normed features
        self._rms(F.embedding(ids, self.embed_weight).to(self.dtype), self.n_in, x[:, : hidden.shape[-1]])
        self._rms(hidden, self.n_hid, x[:, hidden.shape[-1]:])
        qkv = self._lin(x, "qkv")
        self._rope(int(pos.max()) + 1)
        qk = self._rotate(qkv[:, : (nh + nkv) * hd].view(s, nh + nkv, hd), self._cos[pos], self._sin[pos])
        st.append(qk[:, nh:].transpose(0, 1), qkv[:, (nh + nkv) * hd:].view(s, nkv, hd).transpose(0, 1))
        q = qk[:, :nh]  # [S, nh, hd]
        if last_only and s > 1:  # only the last row goes on; it attends to every row (no mask)
            q, hidden, mask = q[-1:], hidden[-1:], None
        residual = self._attend(q, st, mask) + hidden
        gate, up = self._lin(self._rms(residual, self.n_post), "gate_up").chunk(2, dim=-1)
        out = self._lin(F.silu(gate) * up, "down") + residual
        return out, self._lin(self._rms(out, self.n_final), "head")

    def _rms(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm of rows ``x`` [S, N] in fp32 (``w`` fp32), rounded once to the drafter's dtype, into ``out``
        where given: the kernel's one call in bf16 (a chain of eight torch ops otherwise)."""
        if self._kernels and x.stride(-1) == 1:
            out = x.new_empty(x.shape) if out is None else out
            rms_norm_out()(x, w, self.eps, out, False)
            return out
        h = x.float()
        y = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * w).to(x.dtype)
        return y if out is None else out.copy_(y)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Neox RoPE of q and k heads ``x`` [S, heads, hd] at the positions of ``cos``/``sin`` [S, hd] (fp32): in
        place by the kernel in bf16, else by :func:`~eaglenest.drafter.layers.apply_rope` into a new tensor."""
        if self._kernels:
            rope_()(x, cos, sin, False)
            return x
        return apply_rope(x, cos, sin)

    def _attend(self, q: torch.Tensor, st: DraftState, mask: torch.Tensor | None) -> torch.Tensor:
        """q [rows, nh, hd] (the newest rows of ``st``) over its keys/values -> o_proj output [rows, H]. bf16: the
        decode attention kernel (keys and values read in place); else SDPA (one row: the target's grouped
        single-query attention, :func:`~eaglenest.speculative.fastpath.one_query_attention`)."""
        s, end = q.shape[0], st.length
        if self._kernels and s <= MAX_KERNEL_ROWS:
            return self._lin(decode_attention()(q, st.k, st.v, end, mask), "o")
        q = q.transpose(0, 1)  # [nh, rows, hd]
        keys, values = st.k[:, :end], st.v[:, :end]
        if s == 1 and mask is None:
            attn = one_query_attention(q[None], keys[None], values[None])  # [1, nh, 1, hd]
            return self._lin(attn.reshape(1, self.nh * self.hd), "o")
        if mask is None:
            mask = torch.ones(s, end, dtype=torch.bool).tril(diagonal=end - s)
        attn = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask,
                                              enable_gqa=self.nh != self.nkv)  # [1, nh, S, hd]
        return self._lin(attn[0].transpose(0, 1).reshape(s, self.nh * self.hd), "o")


def _top_prob(logits: torch.Tensor) -> float:
    """The softmax probability of the argmax of ``logits`` [Vd]."""
    lf = logits.float()
    return float(1.0 / torch.exp(lf - lf.max()).sum())


class DraftState:
    """One request's draft keys/values, preallocated and grown by doubling: [nkv, capacity, hd]."""

    def __init__(self, fd: FastDrafter, capacity: int) -> None:
        shape = (fd.nkv, max(capacity, 16), fd.hd)
        self.k = torch.empty(shape, dtype=fd.dtype, device=fd.d2t.device)
        self.v = torch.empty_like(self.k)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[1]
        if end > self.k.shape[1]:
            k2, v2 = (self.k.new_empty(self.k.shape[0], 2 * end, self.k.shape[2]) for _ in range(2))
            k2[:, : self.length], v2[:, : self.length] = self.k[:, : self.length], self.v[:, : self.length]
            self.k, self.v = k2, v2
        self.k[:, self.length: end], self.v[:, self.length: end] = k, v
        self.length = end
        return self.k[:, :end], self.v[:, :end]


class Eagle3Proposer:
    """Drafting with an EAGLE-3 drafter: extend over the accepted tokens' target features, then a
    chain (argmax per step; with ``shape.min_prob``, stopped once the product of the drafts' probabilities
    falls below it) or an EAGLE-2 dynamic tree (expand the ``topk`` best nodes by cumulative
    draft log-probability per depth, keep the ``nodes`` best overall)."""

    def __init__(self, fd: FastDrafter, shape: SpecShape = SpecShape(), onednn: OneDNN = OneDNN(),
                 capacity: int = 1024) -> None:
        self.fd, self.shape, self.onednn = fd, shape, onednn
        self.state = DraftState(fd, capacity)
        self.last_hidden: torch.Tensor | None = None  # [1, H] output of the row before the root
        self.last_logits: torch.Tensor | None = None  # [Vd]
        self.root_pos = 0  # target position of the current root token

    def _forward(self, ids: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor,
                 mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        with phase(self.onednn.rows(ids.shape[0])):
            return self.fd.forward(self.state, ids, hidden, pos, mask)

    def _extend(self, tokens: Sequence[int], aux_hidden: torch.Tensor, onednn: bool | None = None) -> None:
        """Rows over target features (``onednn``: the phase's setting; None: by row count)."""
        start = self.state.length
        ids = torch.tensor(list(tokens), device=self.fd.d2t.device)
        pos = torch.arange(start, start + len(tokens), device=ids.device)
        with phase(self.onednn.rows(len(tokens)) if onednn is None else onednn):
            out, logits = self.fd.forward(self.state, ids, self.fd.project(aux_hidden), pos, None, last_only=True)
        self.last_hidden, self.last_logits = out[-1:], logits[-1]

    def begin(self, prompt_ids: Sequence[int], aux_hidden: torch.Tensor, root: int) -> None:
        # position i reads (token i + 1, aux_i): the drafter predicts the token after next
        self._extend([*list(prompt_ids)[1:], root], aux_hidden, self.onednn.prefill)
        self.root_pos = len(prompt_ids)

    def advance(self, tokens: Sequence[int], aux_hidden: torch.Tensor) -> None:
        self.state.length = self.root_pos  # forget the drafter's own steps; rebuild from target features
        self._extend(tokens, aux_hidden)
        self.root_pos += len(tokens)

    def propose(self, max_depth: int) -> DraftTree:
        depth = min(self.shape.depth, max_depth)
        if depth <= 0:
            return DraftTree([], [])
        if self.shape.is_chain:
            return self._chain(depth)
        return self._tree(depth)

    def _chain(self, depth: int) -> DraftTree:
        fd, stop = self.fd, self.shape.min_prob
        last = self.last_logits  # [Vd]: the logits the newest draft was taken from
        d = fd.to_target(row_argmax(last[None]))  # [1]
        drafts, h = [d], self.last_hidden
        sure = 1.0  # the product of the drafts' own draft probabilities
        for i in range(depth - 1):
            if stop:
                sure *= _top_prob(last)
                if sure < stop:  # the drafts after this one would rarely be reached: verify what there is
                    break
            h, logits = self._forward(d, h, torch.tensor([self.root_pos + i]), None)
            last = logits[0]
            d = fd.to_target(row_argmax(last[None]))
            drafts.append(d)
        return DraftTree.chain(torch.cat(drafts).tolist())

    def _tree(self, depth: int) -> DraftTree:
        fd, k = self.fd, self.shape.topk
        base = self.state.length  # == root_pos: rows of the committed prefix
        logp = torch.log_softmax(self.last_logits.float(), dim=-1)  # [Vd]
        score, idx = logp.topk(k)  # level 1: the root's best children
        tokens, parents, scores = [fd.to_target(idx)], [torch.full((k,), -1)], [score]
        frontier = torch.arange(k)  # node ids being expanded
        hidden = self.last_hidden.expand(k, -1)  # [k, H]
        ancestors = torch.zeros(k, 0, dtype=torch.bool)  # [k, draft rows so far]: rows each frontier node sees
        n_nodes = k
        for level in range(1, depth):
            mask = torch.cat((torch.ones(k, base, dtype=torch.bool), ancestors, torch.eye(k, dtype=torch.bool)), 1)
            toks = torch.cat(tokens)[frontier]
            h, logits = self._forward(toks, hidden, torch.full((k,), self.root_pos + level - 1), mask)
            cand = torch.cat(scores)[frontier][:, None] + torch.log_softmax(logits.float(), dim=-1)  # [k, Vd]
            child_score, child_idx = cand.topk(k, dim=-1)  # [k, k]: each node's best children
            tokens.append(fd.to_target(child_idx.reshape(-1)))
            parents.append(frontier.repeat_interleave(k))
            scores.append(child_score.reshape(-1))
            best = child_score.reshape(-1).topk(k).indices  # the next frontier: k best of k*k
            parent_row = best // k  # which of this level's rows each new frontier node hangs under
            frontier, hidden = n_nodes + best, h[parent_row]
            ancestors = torch.cat((ancestors, torch.eye(k, dtype=torch.bool)), 1)[parent_row]  # [k, rows + k]
            n_nodes += k * k
        all_scores = torch.cat(scores)
        keep = all_scores.topk(min(self.shape.nodes, all_scores.numel())).indices.sort().values.tolist()
        all_tokens, all_parents = torch.cat(tokens).tolist(), torch.cat(parents).tolist()
        new_id: dict[int, int] = {-1: -1}
        out_t, out_p = [], []
        for i in keep:  # ids ascend, so a parent is seen before its children
            if all_parents[i] in new_id:
                new_id[i] = len(out_t)
                out_t.append(all_tokens[i])
                out_p.append(new_id[all_parents[i]])
        return DraftTree(out_t, out_p)

