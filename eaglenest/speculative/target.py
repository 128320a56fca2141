"""The target at decode time: one forward interface over a lean Llama forward or transformers' own.

Owns how the embedded decoders run the target (prefill, 1-row decode steps, k-row verify forwards)
and its KV cache:

- :class:`LeanTarget`: Llama-style models (``LlamaForCausalLM``: RMSNorm, RoPE, grouped-query
  attention, SiLU MLP) run as a flat loop over the layers' weight tensors, without transformers'
  module stack, kwargs plumbing and ``DynamicCache`` concatenations (a 1-row step ran ~12 ms of
  non-matmul work there, bf16, 2 cores); ``q/k/v`` and ``gate/up`` are one matmul each and the keys
  and values live in a preallocated :class:`TargetCache` (dropping rejected rows is setting a length).
- :class:`HFTarget`: any other causal LM, through transformers' forward and ``DynamicCache``
  (with :func:`~eaglenest.speculative.fastpath.prepare_target`'s fused projections and attention).
- :func:`decode_target`: the one a runner's model gets.

Both take the verify inputs of :func:`~eaglenest.speculative.tree.verify_inputs` and return the new
rows' logits and aux hidden states (``hidden_states[i + 1]`` of transformers' output for each aux
layer ``i``). Invariant: LeanTarget computes what the transformers forward computes, op for op in
the same order and dtypes (fp32 results are bit-identical; the tests compare them); linears go
through :func:`~eaglenest.speculative.onednn.linear` like the prepared transformers model's. In bf16,
forwards of up to 16 rows attend with the kernel of :mod:`~eaglenest.speculative.kernels` instead of
SDPA: with its linears, every row is computed exactly as a 1-row step computes it, so bf16
speculation reproduces bf16 plain decoding token for token (measured: 0 of 24 MT-Bench outputs differ,
83% did before). Also in bf16 with the kernels, each RMSNorm and the RoPE of q and k are one kernel call
(a 1-row step 13.3 -> 10.6 ms on 2 cores): the RoPE rounds as the torch ops do (bit for bit), the norm sums
its squares in another order (its outputs can differ in the last bf16 bit; the argmax of SmolLM2's logits
differed in 6 of 240 steps from the torch ops' path), the same for plain steps and verifies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from eaglenest.speculative.fastpath import FusedMatmul, one_query_attention, prepare_target
from eaglenest.speculative.kernels import decode_attention, rms_norm_out, rope_, skinny_linear
from eaglenest.speculative.onednn import linear, prepack

FEW_ROWS = 16
"""New rows up to which bf16 attention runs the decode kernel (else SDPA: prefills)."""
Weight = tuple[torch.Tensor, torch.Tensor | None]  # (weight [out, in], oneDNN-prepacked copy or None)


class TargetCache:
    """Every layer's keys and values, preallocated: ``k``, ``v`` [layers, kv_heads, capacity, head_dim];
    rows ``[0, length)`` are valid. Grows by doubling."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.k = torch.empty(layers, kv_heads, max(capacity, 16), head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.length = 0

    def reserve(self, end: int) -> None:
        if end <= self.k.shape[2]:
            return
        grown = max(end, 2 * self.k.shape[2])
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_empty(old.shape[0], old.shape[1], grown, old.shape[3])
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def keep_rows(self, past: int, rows: Sequence[int]) -> None:
        """Keep the cached prefix ``[0, past)`` and the rows ``past + r`` (in order) after it; drop the rest."""
        rows = list(rows)
        if rows != list(range(len(rows))):  # a tree path: gather it into place first
            src = torch.tensor([past + r for r in rows], device=self.k.device)
            self.k[:, :, past: past + len(rows)] = self.k[:, :, src]
            self.v[:, :, past: past + len(rows)] = self.v[:, :, src]
        self.length = past + len(rows)


class _Layer:
    __slots__ = ("down", "gate_up", "n_in", "n_in32", "n_post", "n_post32", "o", "qkv")


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm: normalize in fp32, cast back, then scale."""
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _weights(*parts: nn.Module) -> Weight:
    """The (weight, packed) of a linear, or of sibling linears fused into one matmul: the tensors
    :func:`~eaglenest.speculative.fastpath.prepare_target` made where it did, else made here."""
    fused = getattr(parts[0], "_fused", None)
    if isinstance(fused, FusedMatmul) and len(parts) == len(fused.sizes) and fused.bias is None:
        return fused.weight, fused.packed
    if len(parts) == 1 and parts[0].weight.is_contiguous():
        return parts[0].weight.detach(), getattr(parts[0], "packed", None)
    w = torch.cat([getattr(p, "original", p).weight.detach() for p in parts]).contiguous()
    return w, prepack(w)


class LeanTarget:
    """Inference view of a Llama-style causal LM (shares its tensors; fused copies of q/k/v and gate/up)."""

    def __init__(self, model: nn.Module, aux_layer_ids: Sequence[int]) -> None:
        cfg, inner = model.config, model.model
        self.nh, self.nkv = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
        self.hd = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh)
        self.eps = float(cfg.rms_norm_eps)
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.embed = inner.embed_tokens.weight.detach()
        self.dtype, self.device = self.embed.dtype, self.embed.device
        self.layers: list[_Layer] = []
        for layer in inner.layers:
            at, mlp, lw = layer.self_attn, layer.mlp, _Layer()
            lw.qkv, lw.o = _weights(at.q_proj, at.k_proj, at.v_proj), _weights(at.o_proj)
            lw.gate_up, lw.down = _weights(mlp.gate_proj, mlp.up_proj), _weights(mlp.down_proj)
            lw.n_in, lw.n_post = layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()
            lw.n_in32, lw.n_post32 = lw.n_in.float(), lw.n_post.float()  # the norm kernel's operands (exact)
            self.layers.append(lw)
        self.norm = inner.norm.weight.detach()
        self.norm32 = self.norm.float()
        self.head = _weights(model.lm_head)
        rot = inner.rotary_emb
        self.inv_freq = rot.inv_freq.detach().float().cpu()
        self.rope_scale = float(getattr(rot, "attention_scaling", 1.0))
        self._cos = self._sin = torch.empty(0, self.hd, dtype=self.dtype)
        self._cos32 = self._sin32 = torch.empty(0, self.hd)
        kernel = decode_attention() if self.dtype == torch.bfloat16 and self.device.type == "cpu" else None
        self._kernel_attention = kernel if kernel is not None and self.hd % 16 == 0 and self.hd <= 128 else None
        self._small_ops = kernel is not None and self.hd % 32 == 0 and int(cfg.hidden_size) % 16 == 0
        """bf16 with the kernels: each RMSNorm and the RoPE of a layer's q and k are one kernel call, rounding as the
        torch ops they replace do (a 1-row step spent ~2.5 of its ~13 ms in those ops' dispatch, 2 cores)."""

    def _norm(self, x: torch.Tensor, w: torch.Tensor, w32: torch.Tensor) -> torch.Tensor:
        """Llama's RMSNorm of rows ``x`` [S, H] (weight ``w``; ``w32`` its fp32 copy for the kernel)."""
        if self._small_ops and x.stride(-1) == 1:
            out = torch.empty_like(x)
            rms_norm_out()(x, w32, self.eps, out, True)
            return out
        return _rms(x, w, self.eps)

    @staticmethod
    def supports(model: nn.Module) -> bool:
        """Llama's architecture exactly (others differ in norms, biases, RoPE or attention)."""
        cfg = getattr(model, "config", None)
        rope = getattr(cfg, "rope_parameters", None) or {}
        return (type(model).__name__ == "LlamaForCausalLM" and getattr(cfg, "hidden_act", "") == "silu"
                and not getattr(cfg, "attention_bias", True) and not getattr(cfg, "mlp_bias", True)
                and rope.get("rope_type", "default") == "default" and getattr(cfg, "pretraining_tp", 1) == 1)

    def new_cache(self, capacity: int) -> TargetCache:
        return TargetCache(len(self.layers), self.nkv, self.hd, capacity, self.dtype, self.device)

    def _rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [S, 1, hd] at positions ``pos`` [S] (LlamaRotaryEmbedding's table, grown on demand); for the
        kernels their fp32 copies [S, hd]."""
        need = int(pos.max()) + 1
        if need > self._cos.shape[0]:
            size = max(need, 2 * self._cos.shape[0], 1024)
            freqs = torch.arange(size, dtype=torch.float32)[:, None] * self.inv_freq[None]  # [size, hd/2]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos = (emb.cos() * self.rope_scale).to(self.dtype).to(self.device)
            self._sin = (emb.sin() * self.rope_scale).to(self.dtype).to(self.device)
            self._cos32, self._sin32 = self._cos.float(), self._sin.float()  # the same values, the kernel's operands
        if self._small_ops:
            return self._cos32[pos], self._sin32[pos]
        return self._cos[pos][:, None], self._sin[pos][:, None]

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, end: int,
                mask: torch.Tensor | None) -> torch.Tensor:
        """q [S, nh, hd] of the new rows over one layer's cache keys/values [nkv, capacity, hd] (rows
        ``[0, end)`` valid); ``mask`` [S, end] bool or None (causal) -> [S, nh * hd]."""
        s = q.shape[0]
        if self._kernel_attention is not None and s <= FEW_ROWS:
            return self._kernel_attention(q, keys, values, end, mask)
        q = q.transpose(0, 1)[None]  # [1, nh, S, hd]
        keys, values = keys[None, :, :end], values[None, :, :end]  # [1, nkv, end, hd]
        if s == 1:
            out = one_query_attention(q, keys, values)  # [1, nh, 1, hd]
        else:
            if mask is None and end > s:  # causal after a cached prefix
                mask = torch.ones(s, end, dtype=torch.bool, device=q.device).tril(diagonal=end - s)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None,
                                                 enable_gqa=True)
        return out[0].transpose(0, 1).reshape(s, self.nh * self.hd)

    def forward(self, cache: TargetCache, ids: torch.Tensor, *, pos: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, aux: bool = False,
                last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows ``ids`` [1, S] appended to ``cache``; ``pos`` [1, S] (None: after the cache) and ``mask``
        [1, 1, S, length + S] bool (None: causal) as :func:`~eaglenest.speculative.tree.verify_inputs`
        gives them. Returns logits [S, V] ([1, V]: the last row's, ``last_only``) and, with ``aux``,
        the aux layers' outputs [S, k*H]."""
        ids = ids.reshape(-1)
        s, start = ids.shape[0], cache.length
        end = start + s
        cache.reserve(end)
        cos, sin = self._rope(torch.arange(start, end, device=ids.device) if pos is None else pos.reshape(-1))
        attn_mask = None if mask is None else mask.reshape(s, end)
        nh, nkv, hd = self.nh, self.nkv, self.hd
        x = F.embedding(ids, self.embed)  # [S, H]
        outs: list[torch.Tensor] = []
        for i, lw in enumerate(self.layers):
            qkv = linear(self._norm(x, lw.n_in, lw.n_in32), *lw.qkv)  # [S, (nh + 2 nkv) hd]
            qk = qkv[:, : (nh + nkv) * hd].view(s, nh + nkv, hd)  # q and k rotate alike
            if self._small_ops:
                rope_()(qk, cos, sin, True)  # in place, rounded as the torch expression below
            else:
                qk = qk * cos + torch.cat((-qk[..., hd // 2:], qk[..., : hd // 2]), dim=-1) * sin
            cache.k[i, :, start:end] = qk[:, nh:].transpose(0, 1)
            cache.v[i, :, start:end] = qkv[:, (nh + nkv) * hd:].view(s, nkv, hd).transpose(0, 1)
            x = x + linear(self._attend(qk[:, :nh], cache.k[i], cache.v[i], end, attn_mask), *lw.o)
            gate, up = linear(self._norm(x, lw.n_post, lw.n_post32), *lw.gate_up).chunk(2, dim=-1)
            x = x + linear(F.silu(gate) * up, *lw.down)
            if aux and i in self.aux_layer_ids:
                outs.append(x)
        cache.length = end
        final = self._norm(x[-1:] if last_only else x, self.norm, self.norm32)
        if aux and len(self.layers) - 1 in self.aux_layer_ids:  # transformers returns the last layer normed
            outs[self.aux_layer_ids.index(len(self.layers) - 1)] = self._norm(x, self.norm, self.norm32)
        return linear(final, *self.head), (torch.cat(outs, dim=-1) if aux else None)

    @staticmethod
    def keep_rows(cache: TargetCache, past: int, rows: Sequence[int]) -> None:
        cache.keep_rows(past, rows)


class HFTarget:
    """transformers' forward with a ``DynamicCache`` (the prepared model of :mod:`~eaglenest.speculative.fastpath`)."""

    def __init__(self, model: nn.Module, aux_layer_ids: Sequence[int]) -> None:
        self.model, self.aux_layer_ids = model, tuple(aux_layer_ids)

    def new_cache(self, capacity: int):
        from transformers import DynamicCache

        return DynamicCache()

    def forward(self, cache, ids: torch.Tensor, *, pos: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                aux: bool = False, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As :meth:`LeanTarget.forward`."""
        out = self.model(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=cache, use_cache=True,
                         output_hidden_states=aux, logits_to_keep=1 if last_only else 0)
        hs = out.hidden_states
        return out.logits[0], (torch.cat([hs[i + 1][0] for i in self.aux_layer_ids], dim=-1) if aux else None)

    @staticmethod
    def keep_rows(cache, past: int, rows: Sequence[int]) -> None:
        """Keep the cached prefix and the verify ``rows`` (in order), drop the rest: a chain's accepted
        rows are a prefix (a crop); a tree path is gathered first."""
        total = cache.get_seq_length()
        rows = list(rows)
        if rows != list(range(len(rows))):
            src = torch.tensor([past + r for r in rows], device=cache.layers[0].keys.device)
            for layer in cache.layers:
                layer.keys[:, :, past: past + len(rows)] = layer.keys[:, :, src]
                layer.values[:, :, past: past + len(rows)] = layer.values[:, :, src]
        drop = total - past - len(rows)
        if drop > 0:
            cache.crop(-drop)  # a negative crop removes that many tokens on every transformers 5.x


def decode_target(model: nn.Module, aux_layer_ids: Sequence[int], *, lean: bool = True) -> LeanTarget | HFTarget:
    """The decode-time view of ``model`` (made once per model and aux layers): :class:`LeanTarget`
    where it supports the architecture (and ``lean``), else :class:`HFTarget`. Builds the skinny
    kernel now, so the first decode step does not pay for it."""
    prepare_target(model)
    if next(model.parameters()).dtype == torch.bfloat16:
        skinny_linear()
    key = (tuple(aux_layer_ids), lean and LeanTarget.supports(model))
    views = model.__dict__.setdefault("_eaglenest_targets", {})
    if key not in views:
        views[key] = LeanTarget(model, aux_layer_ids) if key[1] else HFTarget(model, aux_layer_ids)
    return views[key]
