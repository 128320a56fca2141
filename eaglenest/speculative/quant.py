"""The drafter's linear weights in fewer bits, for the embedded decoder: quantize, dequantize, multiply.

Owns the two storages a speculation shape can ask for by its name suffix (:data:`QUANTS`):

- ``q8``: int8 [N, K] with one fp32 scale per output row (symmetric: ``w ~ q * scale[n]``, q in [-127, 127]);
  half the bytes of bf16.
- ``q4``: int4 in groups of :data:`GROUP` values along the input dimension with one bf16 scale per group
  (symmetric: q in [-7, 7]), two values per byte: byte ``32 b + j`` of a row holds value ``64 b + j`` in its low
  nibble and value ``64 b + 32 + j`` in its high one, each as ``q + 8``. That layout lets the kernel turn 32 bytes
  into two 32-value chunks by a mask, a shift and two table lookups. A quarter of the bytes of bf16 (plus 1/32 for
  the scales).

:class:`QuantWeight` holds one weight in either storage and multiplies a few bf16 rows by it on the skinny kernel
of :mod:`~eaglenest.speculative.kernels` (:meth:`QuantWeight.fits` says where it can); elsewhere the caller uses
:meth:`QuantWeight.dequantize`'s weight. Invariant: the kernel's product is ``x @ dequantize().T`` up to fp32
summation order and one rounding to bf16.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from eaglenest.speculative.kernels import Q4_BLOCK, skinny_fits, skinny_linear_i8, skinny_linear_q4

QUANTS = ("q8", "q4")
"""Weight storages of the embedded drafter, as shape names end (``chain3q8``, ``chain3q4``)."""
GROUP = 64
"""q4 values sharing one scale, along the input dimension (one of :data:`GROUPS`)."""
GROUPS = (32, 64, 128)
"""q4 group sizes the kernel takes."""
BLOCK = Q4_BLOCK
"""q4 values per 32 packed bytes: a row's input features must be a multiple of it."""


def q4_shape_problem(k: int, group: int = GROUP) -> str | None:
    """Why a weight of ``k`` input features cannot be stored as q4 in groups of ``group`` (None: it can): the one
    statement of the rule :func:`quantize_q4` enforces and :meth:`QuantWeight.holds` asks."""
    if group not in GROUPS:
        return f"q4 group size {group}: expected one of {', '.join(map(str, GROUPS))}"
    if k % BLOCK or k % group:
        return f"input features must be a multiple of {BLOCK} and of the group size {group}"
    return None


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [N, K] -> (int8 [N, K], fp32 scale [N]): symmetric, one scale per output row (w ~ q * scale)."""
    wf = w.detach().float()
    scale = (wf.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    return torch.round(wf / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous(), scale.contiguous()


def quantize_q4(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [N, K] -> (uint8 [N, K / 2] packed int4, bf16 scale [N, K / group]): symmetric per group, each value
    within half its group's scale of ``w`` (the scale is rounded to bf16 before the values are)."""
    n, k = w.shape
    problem = q4_shape_problem(k, group)
    if problem:
        raise ValueError(f"q4 weight [{n}, {k}]: {problem}")
    wg = w.detach().float().view(n, k // group, group)  # [N, K/G, G]
    scale = (wg.abs().amax(dim=-1) / 7.0).clamp(min=1e-12).to(torch.bfloat16)  # [N, K/G]
    q = torch.round(wg / scale.float()[..., None]).clamp(-7, 7).view(n, k // BLOCK, 2, BLOCK // 2)
    u = (q + 8).to(torch.uint8)  # [N, K/64, 2, 32]: the block's first and second 32 values
    return (u[:, :, 0] | (u[:, :, 1] << 4)).reshape(n, k // 2).contiguous(), scale.contiguous()


def dequantize_q4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(uint8 [N, K / 2], bf16 scale [N, K / G]) -> fp32 [N, K]: the weight :func:`quantize_q4` stored."""
    n, k = packed.shape[0], 2 * packed.shape[1]
    b = packed.view(n, k // BLOCK, 1, BLOCK // 2)
    q = torch.cat((b & 15, b >> 4), dim=2).view(n, k).float() - 8.0  # [N, K]
    return (q.view(n, scale.shape[1], -1) * scale.float()[..., None]).view(n, k)


@dataclass(frozen=True, slots=True)
class QuantWeight:
    """One linear's weight [N, K] in a :data:`QUANTS` storage."""

    kind: str
    """``q8`` or ``q4``."""
    data: torch.Tensor
    """int8 [N, K] (q8) or uint8 [N, K / 2] (q4)."""
    scale: torch.Tensor
    """fp32 [N] (q8) or bf16 [N, K / group] (q4)."""

    @staticmethod
    def holds(kind: str, shape: Sequence[int]) -> bool:
        """Whether a weight of ``shape`` [N, K] can be stored as ``kind`` (q4: :func:`q4_shape_problem`)."""
        return kind == "q8" or (kind == "q4" and q4_shape_problem(shape[-1]) is None)

    @classmethod
    def of(cls, w: torch.Tensor, kind: str, name: str = "weight") -> QuantWeight:
        """``w`` [N, K] in storage ``kind``; ``name`` (the linear's) goes into the errors."""
        if kind not in QUANTS:
            raise ValueError(f"weight storage {kind!r}: expected one of {', '.join(QUANTS)}")
        if not bool(torch.isfinite(w).all()):
            raise ValueError(f"{name} [{', '.join(map(str, w.shape))}] holds NaN or inf values: not quantized")
        try:
            return cls(kind, *(quantize_rows(w) if kind == "q8" else quantize_q4(w)))
        except ValueError as e:
            raise ValueError(f"{name}: {e}; keep this drafter in q8 or its own dtype (a shape name without q4)") from e

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [N, K] these values stand for, in ``dtype``."""
        if self.kind == "q8":
            return (self.data.float() * self.scale[:, None]).to(dtype)
        return dequantize_q4(self.data, self.scale).to(dtype)

    def fits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` [..., K] times this weight runs on the skinny kernel here (bf16 rows, few of them; for q4
        a group size of :data:`GROUPS`)."""
        if self.kind == "q4" and (self.scale.dim() != 2 or x.shape[-1] % self.scale.shape[1]
                                  or x.shape[-1] // self.scale.shape[1] not in GROUPS):
            return False
        return skinny_fits(x, self.data)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [..., K] bf16 @ the dequantized weight's transpose -> [..., N] bf16, on the kernel (:meth:`fits`)."""
        kernel = skinny_linear_i8() if self.kind == "q8" else skinny_linear_q4()
        return kernel(x.reshape(-1, x.shape[-1]), self.data, self.scale).view(*x.shape[:-1], -1)
