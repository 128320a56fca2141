"""How a store holds hidden states: ``bf16`` (the captured bits, default) or ``fp8`` (half the bytes), and the
sample record readers hand out (:class:`StoreSample`: bf16 views, or fp8 codes decoded where they are used).

fp8 = OCP e4m3 (``torch.float8_e4m3fn``: 3 mantissa bits, largest finite 448) with one float32 scale per token
and block. The blocks of a token are each aux layer's H values and the final state's H values, each scaled
on its own (aux layers differ in magnitude by orders, and one shared scale would flush the quiet ones).
Encoding a row ``x`` of one block: ``s = max|x| / 448`` (as ``max|x| * fl32(1/448)``), ``q = e4m3(x * (1/s))``
(float32, round to nearest even, |x/s| <= 448 so nothing saturates); decoding: ``x' = bf16(q * s)`` (float32
product, one bf16 rounding).

Error bound, per row of one block (``n`` values, n <= 65,536, max|x| >= 2**-100; smaller rows are stored
as zeros, which hidden states never are)::

    ||x' - x||_2 <= FP8_REL_ERROR * ||x||_2,      FP8_REL_ERROR = 2**-4 + 2**-8  (0.0664)

Why: an e4m3 normal (|x/s| >= 2**-6) is off by at most half a unit in the last place, 2**-4 of its value;
a subnormal by at most 2**-10 (in units of s), i.e. ``2**-10 * s * sqrt(n) <= sqrt(n) * ||x||_2 / 458752``
over the row since ``s = max|x| / 448 <= ||x||_2 / 448`` (at most 5.6e-4 relative for n <= 65,536); the
float32 reciprocal and products add about 2**-23, the bf16 rounding at most 2**-9 relative. In all,
2**-4 (1 + 2**-9) + 2**-9 + 5.6e-4 + 2**-22 < 2**-4 + 2**-8. Typical rows (Gaussian-like, or with a few huge
channels) land near 2.6%.

Bytes per token: bf16 stores 2 (k + 1) H; fp8 stores (k + 1) H + 4 (k + 1), i.e. 0.50x plus 4 bytes per block
(0.504x for SmolLM2: k = 3, H = 576; ids and loss mask are the same 5 bytes in both).

Invariants: non-finite inputs are refused (never encoded); scales are finite and >= 0; readers check the
decoded states for NaN/inf like bf16 ones (the trainer's batch check), so damaged bytes cannot reach a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from eaglenest.contract import ContractError

Encoding = Literal["bf16", "fp8"]
ENCODINGS: tuple[str, ...] = ("bf16", "fp8")
DEFAULT_ENCODING: Encoding = "bf16"
FP8_MAX = 448.0
FP8_REL_ERROR = 2.0**-4 + 2.0**-8
"""Bound on ||decode(encode(x)) - x||_2 / ||x||_2 per row of one block (see the module docstring)."""
_FLUSH_BELOW = 2.0**-100
_INV_FP8_MAX = float(torch.tensor(1.0 / FP8_MAX, dtype=torch.float32))


def check_encoding(encoding: str) -> str:
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown store encoding {encoding!r}; choose one of {', '.join(ENCODINGS)}")
    return encoding


def bytes_per_token(encoding: str, hidden_size: int, num_aux: int) -> int:
    """Bytes one token takes in the store's data columns (ids 4 + loss mask 1 + states + scales)."""
    check_encoding(encoding)
    blocks = num_aux + 1
    if encoding == "bf16":
        return 5 + 2 * blocks * hidden_size
    return 5 + blocks * hidden_size + 4 * blocks


_BITS = {torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80), torch.float32: (torch.int32, 0x7FFFFFFF, 0x7F800000)}
"""dtype -> (same-width int, mask clearing the sign, bit pattern of +inf). Cleared of its sign, a float's bit
pattern orders like its magnitude, and every NaN/inf pattern is >= +inf's: one integer max per row gives both
max|x| and the finite check, several times faster on a CPU than abs() + amax() in floating point."""


def encode_fp8(x: torch.Tensor, blocks: int, *, what: str = "hidden states") -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, blocks*H] bf16 or float32 -> (codes uint8 [T, blocks*H] e4m3 bits, scales float32 [T, blocks]).

    Raises ContractError on NaN/inf (nothing non-finite is stored)."""
    codes, scale, bad = _encode_rows(x, blocks, what=what)
    if bool(bad.any()):
        raise _non_finite(what)
    return codes, scale


def _non_finite(what: str) -> ContractError:
    return ContractError(f"{what}: non-finite values cannot be encoded as fp8 (nothing was written)")


def _encode_rows(x: torch.Tensor, blocks: int, *, what: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`encode_fp8` without its check (no wait for the device): (codes, scales, bad [T] bool: the rows
    holding NaN/inf, whose codes and scales are meaningless)."""
    t, width = x.shape
    if width % blocks:
        raise ValueError(f"{what}: width {width} is not a multiple of {blocks} blocks")
    if x.dtype not in _BITS:
        raise ValueError(f"{what}: fp8 encodes bf16 or float32 states, got {x.dtype}")
    int_type, magnitude, inf_bits = _BITS[x.dtype]
    xb = x.reshape(t, blocks, width // blocks)  # [T, B, H]
    amax_bits = (xb.view(int_type) & magnitude).amax(dim=-1)  # [T, B]
    bad = (amax_bits >= inf_bits).any(dim=-1)  # [T]
    amax = amax_bits.view(x.dtype).float()
    # Only correctly rounded float32 operations, so every device produces the same bits (CUDA divides by a
    # Python scalar as a multiplication by its reciprocal: multiply by the one float32 constant here too).
    scale = torch.where(amax >= _FLUSH_BELOW, amax * _INV_FP8_MAX, torch.zeros_like(amax))  # [T, B]
    # x * (1/s) instead of x / s: the reciprocal's extra rounding (2**-24) is far inside the bound's slack.
    # A flushed row gets 1/s = 0: exact zeros.
    inv = torch.where(scale > 0, torch.reciprocal(scale), torch.zeros_like(scale)).unsqueeze(-1)  # [T, B, 1]
    # A float32 copy, then an in-place product: the bits of bf16 * float32 (which widens bf16 exactly), 3x faster
    # on a CPU, where a product of mixed dtypes takes a slow path. No clamp: |y| <= 448 (1 + 2**-22)
    # from the float32 roundings, and e4m3 rounds all of (448, 464) to 448, the code a clamp would give.
    y = xb.to(torch.float32, copy=True).mul_(inv)  # [T, B, H]
    codes = y.to(torch.float8_e4m3fn).view(torch.uint8).reshape(t, width)
    return codes, scale, bad


def decode_fp8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """codes uint8 [..., B*H] and scales float32 [..., B] -> states [..., B*H] in ``dtype`` (any device)."""
    blocks = scale.shape[-1]
    lead, width = codes.shape[:-1], codes.shape[-1]
    q = codes.view(torch.float8_e4m3fn).float().reshape(*lead, blocks, width // blocks)  # [..., B, H]
    return (q * scale.float().unsqueeze(-1)).reshape(*lead, width).to(dtype)


@dataclass(frozen=True, slots=True)
class Fp8States:
    """One sample's states as an fp8 store holds them (views of the stored bytes where the store is local)."""

    aux_codes: torch.Tensor  # [T, k*H] uint8 (e4m3 bits)
    aux_scale: torch.Tensor  # [T, k] float32
    final_codes: torch.Tensor  # [T, H] uint8
    final_scale: torch.Tensor  # [T, 1] float32

    def decode(self, dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux_hidden [T, k*H], final_hidden [T, H]) in ``dtype``, decoded on ``device`` (moved there first)."""
        return (decode_fp8(self.aux_codes.to(device), self.aux_scale.to(device), dtype),
                decode_fp8(self.final_codes.to(device), self.final_scale.to(device), dtype))


def encode_states(aux_hidden: torch.Tensor, final_hidden: torch.Tensor, num_aux: int, *, what: str) -> Fp8States:
    """A shard's bf16 states -> fp8 codes and scales (aux layers and the final state each scaled on their own)."""
    aux_codes, aux_scale = encode_fp8(aux_hidden, num_aux, what=f"{what} aux_hidden")
    final_codes, final_scale = encode_fp8(final_hidden, 1, what=f"{what} final_hidden")
    return Fp8States(aux_codes, aux_scale, final_codes, final_scale)


def encode_samples(states: Sequence[tuple[torch.Tensor, torch.Tensor]], num_aux: int, *, names: Sequence[str],
                   device: torch.device) -> list[Fp8States]:
    """Several samples' bf16 (aux_hidden [T, k*H], final_hidden [T, H]) on the CPU -> their Fp8States on the CPU,
    encoded on ``device``; ``names`` say which sample an error is about.

    Each sample gets :func:`encode_states`' bits: the encoding is per token and block, so samples packed one
    after another encode as they would alone. On a CPU each sample is encoded where it lies (packing would be
    one more pass over its bytes); to any other device they travel packed: one copy each way (from and to
    pinned memory on a GPU, on a stream of their own) and one wait for all of them."""
    if len(states) != len(names):
        raise ValueError(f"{len(states)} samples but {len(names)} names")
    if device.type == "cpu":
        return [encode_states(aux, final, num_aux, what=name) for (aux, final), name in zip(states, names, strict=True)]
    return _encode_packed(states, num_aux, names=names, device=device)


def _encode_packed(states: Sequence[tuple[torch.Tensor, torch.Tensor]], num_aux: int, *, names: Sequence[str],
                   device: torch.device) -> list[Fp8States]:
    """:func:`encode_samples` through one packed buffer per state (any device, the CPU included)."""
    pin = device.type == "cuda"
    lengths = [aux.shape[0] for aux, _ in states]
    aux, final = (_pack([s[i] for s in states], pin=pin) for i in (0, 1))  # [N, k*H], [N, H] bf16
    stream = torch.cuda.Stream(device) if pin else None
    with torch.cuda.stream(stream):  # a no-op for None
        encoded = (*_encode_rows(aux.to(device, non_blocking=pin), num_aux, what="packed aux_hidden"),
                   *_encode_rows(final.to(device, non_blocking=pin), 1, what="packed final_hidden"))
        aux_codes, aux_scale, aux_bad, final_codes, final_scale, final_bad = (_to_host(t, pin=pin) for t in encoded)
        if stream is not None:
            stream.synchronize()  # the copies to the host are done: their buffers may be read
    if bool(aux_bad.any() | final_bad.any()):
        for name, a_bad, f_bad in zip(names, aux_bad.split(lengths), final_bad.split(lengths), strict=True):
            for what, bad in (("aux_hidden", a_bad), ("final_hidden", f_bad)):
                if bool(bad.any()):
                    raise _non_finite(f"{name} {what}")
    return [Fp8States(*parts) for parts in zip(aux_codes.split(lengths), aux_scale.split(lengths),
                                                final_codes.split(lengths), final_scale.split(lengths), strict=True)]


def _pack(parts: list[torch.Tensor], *, pin: bool) -> torch.Tensor:
    """Rows of ``parts`` one after another in one new host tensor (pinned: a GPU copies it without waiting)."""
    out = torch.empty(sum(p.shape[0] for p in parts), *parts[0].shape[1:], dtype=parts[0].dtype, pin_memory=pin)
    return torch.cat(parts, out=out)


def _to_host(t: torch.Tensor, *, pin: bool) -> torch.Tensor:
    """A copy of ``t`` on the host; with ``pin``, queued on the current stream into pinned memory (valid once
    that stream is synchronized)."""
    if not pin:
        return t.cpu()
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)


class StoreSample:
    """One sample: ``input_ids`` [T] int32, ``loss_mask`` [T] bool, ``aux_hidden`` [T, k*H] and ``final_hidden``
    [T, H] bf16.

    From a local bf16 store the tensors are views of the stored bytes. From an fp8 store, ``fp8`` holds the
    stored codes and scales (views likewise) and the bf16 states are decoded on the CPU the first time they
    are asked for; a trainer that wants them on a GPU moves ``fp8`` there (half the bytes) and decodes there
    (:meth:`eaglenest.store.encoding.Fp8States.decode`, as the drafter's collate does).
    """

    __slots__ = ("_aux", "_final", "fp8", "input_ids", "loss_mask", "sample_id")

    def __init__(self, sample_id: str, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                 aux_hidden: torch.Tensor | None = None, final_hidden: torch.Tensor | None = None, *,
                 fp8: Fp8States | None = None) -> None:
        if (aux_hidden is None) != (final_hidden is None) or (aux_hidden is None) == (fp8 is None):
            raise ValueError("a StoreSample takes aux_hidden and final_hidden, or fp8 (the encoded states)")
        self.sample_id, self.input_ids, self.loss_mask = sample_id, input_ids, loss_mask
        self._aux, self._final, self.fp8 = aux_hidden, final_hidden, fp8

    def _decode(self) -> None:
        self._aux, self._final = self.fp8.decode(torch.bfloat16)

    @property
    def aux_hidden(self) -> torch.Tensor:  # [T, k*H] bf16
        if self._aux is None:
            self._decode()
        return self._aux

    @property
    def final_hidden(self) -> torch.Tensor:  # [T, H] bf16
        if self._final is None:
            self._decode()
        return self._final

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def with_loss_mask(self, loss_mask: torch.Tensor) -> StoreSample:
        """The same sample (its states shared, nothing decoded) with another loss mask [T] bool."""
        if loss_mask.shape != self.loss_mask.shape:
            raise ValueError(f"loss mask of shape {tuple(loss_mask.shape)} for a sample of {self.num_tokens} tokens")
        if self.fp8 is not None:
            return StoreSample(self.sample_id, self.input_ids, loss_mask, fp8=self.fp8)
        return StoreSample(self.sample_id, self.input_ids, loss_mask, self._aux, self._final)

    def __repr__(self) -> str:
        kind = "fp8" if self.fp8 is not None else str(self._aux.dtype).removeprefix("torch.")
        return f"StoreSample({self.sample_id!r}, {self.num_tokens} tokens, {kind})"
