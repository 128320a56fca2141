"""oneDNN per decoding phase on the CPU: the policy, the phase switch, and prepacked linear weights.

Owns how the embedded decoders run their matmuls. Measured on these CPUs (bf16, FACTS.md): with
oneDNN off a 1-row linear is a fast GEMV but every further row costs about one more weight read
(a 4-token verify ~3x a 1-token step); with oneDNN on, each call reorders the weight (a 1-token
step ~2x slower) but rows come almost free. Prepacking the weights once into oneDNN's layout keeps
the flat cost in rows without the per-call reorder: 4-6 rows cost about what 1 row does there. It
does not reach the GEMV, though: streaming SmolLM2's layer weights from memory, a prepacked 4-row
matmul reads ~22-25 GB/s against the GEMV's ~29-37 GB/s, plus ~10 us per call (2 cores, AMD EPYC),
so a 4-token verify's linears cost ~1.4x a 1-token step's.

- :class:`OneDNN`: whether oneDNN runs in each phase (prefill, 1-row decode steps, multi-row verify
  and draft forwards); :func:`phase` switches it for a block.
- :func:`decoding`: whether this thread is inside a :func:`phase` (where the decoders' fast paths of
  :mod:`~eaglenest.speculative.fastpath` apply).
- :func:`pack_linears`: replaces a model's ``nn.Linear`` modules with :class:`PackedLinear`, which
  uses the prepacked weight inside a :func:`phase` with oneDNN on and the plain weight everywhere
  else (so other users of the same model, e.g. capture, compute exactly what they did before).
- :func:`linear`: inside a phase, bf16 inputs of at most 16 rows go to the skinny kernel of
  :mod:`~eaglenest.speculative.kernels` whatever the oneDNN setting: it streams the weights like the
  GEMV for 1 row (~10% faster than torch's) and a 3-4-row verify's linears cost ~1.2x that, not ~1.45x
  (2 cores, SmolLM2-135M; on AMX ~1.0x, Xeon Sapphire Rapids), and a row's result does not depend on the
  other rows of the call.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eaglenest.speculative.kernels import skinny_fits, skinny_linear

_state = threading.local()  # on this thread: .packed inside a phase() with oneDNN on, .depth phases entered


@dataclass(frozen=True, kw_only=True, slots=True)
class OneDNN:
    """Whether oneDNN (mkldnn, with prepacked weights) runs in each phase of decoding."""

    prefill: bool = True
    decode: bool = True
    """1-row forwards: plain decode steps, the chain's draft steps."""
    verify: bool = True
    """Multi-row forwards: the target's verify, the draft's extend and tree steps."""

    @property
    def name(self) -> str:
        return "-".join(f"{p}:{'on' if getattr(self, p) else 'off'}" for p in ("prefill", "decode", "verify"))

    def rows(self, n: int) -> bool:
        """The setting for a forward over ``n`` new rows after the prompt."""
        return self.verify if n > 1 else self.decode

    @staticmethod
    def candidates() -> dict[str, OneDNN]:
        return {"onednn": OneDNN(), "no-onednn": OneDNN(prefill=False, decode=False, verify=False),
                "prefill-only": OneDNN(decode=False, verify=False),
                "prefill+verify": OneDNN(decode=False)}


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@contextlib.contextmanager
def phase(enabled: bool):
    """oneDNN (and prepacked weights) on or off for one phase of decoding (torch's flags() warns about
    TF32 on Intel GPUs: silenced)."""
    available = torch.backends.mkldnn.is_available()
    before = getattr(_state, "packed", False)
    _state.packed = enabled and available
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="TF32 acceleration on top of oneDNN")
            with torch.backends.mkldnn.flags(enabled=enabled) if available else contextlib.nullcontext():
                yield
    finally:
        _state.packed = before
        _state.depth -= 1


def decoding() -> bool:
    """Inside a :func:`phase` (oneDNN on or off) on this thread: the decoders' fast paths apply."""
    return getattr(_state, "depth", 0) > 0


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` [out, in] in oneDNN's blocked layout (None where oneDNN cannot run it)."""
    if not packing_available() or weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` inside a :func:`phase`: a few bf16 rows through the skinny kernel (whatever the
    phase's oneDNN setting), else through the prepacked weight when the phase has oneDNN on."""
    if getattr(_state, "depth", 0) > 0 and bias is None and skinny_fits(x, weight):
        return skinny_linear()(x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[0])
    if packed is not None and getattr(_state, "packed", False):
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


class PackedLinear(nn.Module):
    """An ``nn.Linear`` that also holds its weight prepacked for oneDNN (shares the original tensors)."""

    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = lin.weight, lin.bias
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.packed = prepack(lin.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.packed, self.bias)


def pack_linears(model: nn.Module) -> int:
    """Swap every ``nn.Linear`` of ``model`` for a :class:`PackedLinear` (idempotent); returns how many
    were swapped. Costs one more copy of the linear weights in memory."""
    if not packing_available():
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.device.type == "cpu":
                setattr(parent, name, PackedLinear(child))
                swapped += 1
    return swapped
