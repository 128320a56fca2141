"""The target model at decode time on the CPU: fused projections and attention without K/V copies.

Owns what :func:`prepare_target` changes in a transformers decoder (Llama-style attention and MLP)
so that plain decode steps and speculative verify forwards run lean, and measured why (bf16, 2
cores, SmolLM2-135M, 100-300 cached tokens):

- fused projections: inside a :func:`~eaglenest.speculative.onednn.phase`, ``q/k/v`` are one matmul
  and ``gate/up`` another (:class:`FusedPart`). A oneDNN call has a fixed cost of ~10-20 us, so a
  4-row verify's linears drop from ~375 to ~300 us per layer (1-row GEMV steps: ~260 to ~235 us);
- :func:`decode_attention`: transformers' SDPA repeats every K/V head ``heads / kv_heads`` times
  (a copy of the whole cache per layer) whenever a mask is given, i.e. for every multi-row verify;
  here a masked forward attends with ``enable_gqa`` (no copy, ~30% cheaper), and a 1-row step folds
  each K/V head's query group into rows (``[1, kv_heads, group, hd]``), ~4x cheaper than the
  ``enable_gqa`` kernel transformers picks for it (174 vs 38 us per layer at 300 cached tokens).

Invariant: outside a phase (capture, :meth:`~eaglenest.engines.runtime.TargetRunner.generate`) every
module computes exactly what it did before; inside, results differ from the unfused forward only by
matmul blocking (fp32: ~1e-7), so greedy decoding stays greedy decoding.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from eaglenest.speculative.onednn import decoding, linear, pack_linears, prepack

ATTENTION = "eaglenest_decode"
"""The attention implementation :func:`prepare_target` sets (transformers' SDPA outside a phase)."""
MAX_ROWS = 64
"""Query rows beyond which attention is transformers' own (prefills)."""
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Sibling projections that read the same input: each group becomes one matmul."""


class FusedMatmul:
    """One matmul over the concatenated weights of sibling linears; the parts read its split output."""

    def __init__(self, linears: Sequence[nn.Module]) -> None:
        biases = [lin.bias for lin in linears]
        self.weight = torch.cat([lin.weight.detach() for lin in linears]).contiguous()  # [sum(out), in]
        self.bias = torch.cat([b.detach() for b in biases]) if biases[0] is not None else None
        self.packed = prepack(self.weight)
        self.sizes = [int(lin.weight.shape[0]) for lin in linears]
        self._last = threading.local()  # .input, .parts: this thread's latest fused output

    def part(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Part ``i`` of the fused output for ``x``; the matmul runs once per input (the parts are
        called in turn on the same tensor, as the attention and MLP modules do)."""
        last = self._last
        if getattr(last, "input", None) is not x:
            last.parts = linear(x, self.weight, self.packed, self.bias).split(self.sizes, dim=-1)
            last.input = x  # held until the last part is read, so no other tensor can reuse its id
        out = last.parts[i]
        if i == len(self.sizes) - 1:
            last.input, last.parts = None, ()
        return out


class FusedPart(nn.Module):
    """Replaces one linear of a fused group: inside a phase it reads the group's fused matmul, outside
    it is the original linear."""

    def __init__(self, original: nn.Module, fused: FusedMatmul, index: int) -> None:
        super().__init__()
        self.original, self.index = original, index
        self._fused = fused  # not a submodule: holds no parameters of its own

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if decoding():
            return self._fused.part(self.index, x)
        return self.original(x)


def fuse_projections(model: nn.Module) -> int:
    """Fuse every :data:`FUSED_GROUPS` group found in ``model`` (idempotent); returns the groups fused."""
    fused = 0
    for module in list(model.modules()):
        for names in FUSED_GROUPS:
            parts = [getattr(module, n, None) for n in names]
            if not all(isinstance(p, nn.Module) and isinstance(getattr(p, "weight", None), torch.Tensor)
                       for p in parts):
                continue  # not this architecture's module, or already fused (FusedPart has no weight)
            if len({p.weight.shape[1] for p in parts}) != 1 or len({p.bias is None for p in parts}) != 1:
                continue
            group = FusedMatmul(parts)
            for i, (n, p) in enumerate(zip(names, parts, strict=True)):
                if hasattr(p, "packed"):
                    p.packed = None  # a phase reads the group's packed weight; outside one the plain weight
                setattr(module, n, FusedPart(p, group, i))
            fused += 1
    return fused


def one_query_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                        scale: float | None = None) -> torch.Tensor:
    """One query row per head, grouped-query: query [1, H, 1, hd], key/value [1, Hkv, T, hd] -> [1, H, 1, hd].
    Each K/V head's query group is folded into rows ([1, Hkv, H/Hkv, hd]; head h reads K/V head h // group):
    several times cheaper than the ``enable_gqa`` kernel for a single query, same math."""
    heads, hd, kv_heads = query.shape[1], query.shape[3], key.shape[1]
    out = F.scaled_dot_product_attention(query.reshape(1, kv_heads, heads // kv_heads, hd), key, value, scale=scale)
    return out.reshape(1, heads, 1, hd)


def decode_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query [1, H, S, hd], key/value [1, Hkv, T, hd] (the cache
    included), a boolean mask [1, 1, S, T] or None; returns [1, S, H, hd]. Grouped-query attention
    without repeating K/V inside a phase; transformers' SDPA everywhere else."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, heads, rows = query.shape[:3]
    kv_heads = key.shape[1]
    plain = (not decoding() or b != 1 or rows > MAX_ROWS or heads == kv_heads or kwargs.get("dropout", 0.0)
             or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None)
    scale = kwargs.get("scaling")
    if not plain and rows == 1 and attention_mask is None:
        return one_query_attention(query, key, value, scale=scale).transpose(1, 2), None
    if not plain and attention_mask is not None and attention_mask.dtype == torch.bool:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scale,
                                             enable_gqa=True)  # [1, H, S, hd]
        return out.transpose(1, 2), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, decode_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # the masks SDPA gets (boolean, None when causal)


def prepare_target(model: nn.Module) -> None:
    """Make ``model`` decode fast inside a phase (idempotent): oneDNN-prepacked linears, fused
    projections, :func:`decode_attention` when the model runs transformers' SDPA."""
    if getattr(model, "_eaglenest_decode_ready", False):
        return
    pack_linears(model)
    fuse_projections(model)
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == "sdpa" and hasattr(model, "set_attn_implementation"):
        _register_attention()
        model.set_attn_implementation(ATTENTION)
    model._eaglenest_decode_ready = True
