"""The drafter's building blocks, each numerically the same as its SGLang counterpart.

Owns the pieces :class:`~eaglenest.drafter.model.Eagle3Drafter` is made of (the math of one draft forward is
in :mod:`eaglenest.drafter.model`) and the primitives the decode-time drafters reuse:

- :class:`RMSNorm`: SGLang's ``forward_native``: statistics in fp32, times the weight, cast back.
- :func:`rope_cos_sin`, :func:`apply_rope`: neox-style RoPE with the default rope type, rotated in fp32.
- :class:`DraftAttention` (q/k/v/o projections over the [.., 2H] input, also as one fused qkv matmul),
  :class:`DraftMLP` (SiLU-gated, also as one fused gate|up matmul), :func:`repeat_kv` (grouped-query heads).
- :class:`DraftLayer`: the one decoder layer (``midlayer`` in checkpoints): normed embeddings FIRST, then the
  normed hidden, residual adds around attention and MLP.

Parameter names are SGLang's checkpoint names, so the drafter's state dict needs no renaming.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from eaglenest.drafter.model import DrafterConfig


class RMSNorm(nn.Module):
    """SGLang's RMSNorm.forward_native: fp32 statistics, times the weight, cast back."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(self.normalize(x), x.dtype)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """x [.., H] -> x / rms(x) in fp32, before the weight (no parameter: computed once, scaled per use)."""
        h = x.float()
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)

    def scale(self, h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A normalised fp32 ``h`` times the weight, cast to ``dtype``."""
        return (h * self.weight.float()).to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., head_dim] for integer positions (neox layout: both halves repeat the frequencies)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.to(torch.float32)[..., None] * inv_freq  # [..., head_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [..., head_dim]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, S, D]; cos/sin [B, S, D] (fp32). Also x [S, heads, D] with cos/sin [S, D] (one position per row)."""
    half = x.shape[-1] // 2
    xf = x.float()  # rotated in fp32: the same values as rotating then casting, one cast fewer
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class DraftAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(2 * h, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, S, 2H] -> q [B, nh, S, hd], k/v [B, nkv, S, hd] with RoPE applied to q and k."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def fused_qkv_weight(self) -> torch.Tensor:
        """[(nh + 2 nkv) * hd, 2H]: the q, k and v weights stacked (for :meth:`qkv_fused`), in the autocast dtype
        when autocast is on (cast once here rather than at every use)."""
        return autocast_cast(torch.cat((self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)))

    def qkv_fused(self, x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """:meth:`qkv` as one matmul over ``weight`` = :meth:`fused_qkv_weight` and one RoPE over the q and k
        heads together (training reuses one stacked weight for every TTT step of a batch)."""
        b, s, _ = x.shape
        nh, nkv = self.num_heads, self.num_kv_heads
        y = F.linear(x, weight).view(b, s, nh + 2 * nkv, self.head_dim).transpose(1, 2)  # [B, nh+2nkv, S, hd]
        q, k = apply_rope(y[:, : nh + nkv], cos, sin).split([nh, nkv], dim=1)
        return q, k, y[:, nh + nkv :]

    def out(self, attn: torch.Tensor) -> torch.Tensor:
        """attn [B, nh, S, hd] -> [B, S, H]."""
        b, _, s, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


class DraftMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def fused_gate_up_weight(self) -> torch.Tensor:
        """[2I, H]: the gate and up weights stacked (for :meth:`fused`), in the autocast dtype when it is on."""
        return autocast_cast(torch.cat((self.gate_proj.weight, self.up_proj.weight)))

    def fused(self, x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` with gate and up as one matmul over ``gate_up`` = :meth:`fused_gate_up_weight`."""
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def autocast_cast(w: torch.Tensor) -> torch.Tensor:
    """A weight made of parameters, in the autocast dtype when autocast is on (autocast caches its casts of
    parameters only, so a weight built from them is cast once by its maker rather than at every use)."""
    dev = w.device.type
    return w.to(torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else w


class DraftLayer(nn.Module):
    """SGLang's EAGLE-3 input decoder layer (``midlayer`` in checkpoints, ``layers.0`` inside SGLang)."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg)

    def attn_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[B, S, H] x2 -> [B, S, 2H]: normed embeddings first, then the normed hidden."""
        return self.join(self.input_layernorm(embeds), hidden)

    def join(self, normed_embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """:meth:`attn_input` of embeddings already through ``input_layernorm``."""
        return torch.cat((normed_embeds, self.hidden_norm(hidden)), dim=-1)

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor, gate_up: torch.Tensor | None = None
               ) -> torch.Tensor:
        """Residual adds around the attention output and the MLP; returns the pre-norm output [B, S, H].
        ``gate_up``: the MLP's stacked gate|up weight (:meth:`DraftMLP.fused`), when the caller made one."""
        residual = attn_out + residual
        h = self.post_attention_layernorm(residual)
        return (self.mlp(h) if gate_up is None else self.mlp.fused(h, gate_up)) + residual


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, nkv, L, hd] -> [B, nkv * n_rep, L, hd] (head h reads kv head h // n_rep)."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)
