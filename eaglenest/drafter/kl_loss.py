"""The TTT loss's draft-vocabulary KL: PyTorch ops, or Triton kernels that never materialise the log-softmax.

For draft logits ``z`` [N, V] (the k TTT steps' rows stacked, N = k * M) and the target's distribution ``p``
[M, V] over the same vocabulary (row ``r`` of ``z`` is scored against ``p[r % M]``):

    kl[r] = sum_v p log p - sum_v p log softmax(z[r])  =  negent[r % M] - (sum_v p z  -  lse(z[r]) * sum_v p)

and d kl[r] / d z[r, v] = softmax(z[r])_v * sum p - p_v. So the forward needs per row only the log-sum-exp, the
dot product with ``p`` and the argmax (the accuracy), and the backward recomputes softmax from ``z`` and the saved
log-sum-exp: neither the fp32 log-softmax [N, V] nor the product with ``p`` is ever materialised or kept for the
backward. On the GPU that was the training step's largest cost (2026-12-04b's profile: elementwise products,
copies and log-softmaxes over these values were ~54% of its GPU time, the matmuls 26%).

On the CPU (or ``EAGLENEST_KL_KERNEL=torch``) the same formula runs as PyTorch ops, the fp32 log-softmax kept for
the backward. The Triton kernels (one program per target row and its k TTT rows, one pass over ``z`` and ``p``
forward for log-sum-exp, dot and argmax, one backward with softmax recomputed from ``z``: ~10 bytes read or
written per logit against ~70 for the ops) run for ``EAGLENEST_KL_KERNEL=triton`` on CUDA, and by default
(``auto``) on compute capability 9.0 (checked on the H100; the H200 is the same architecture) with Triton
importable. There (results/2026-12-05d-h100) they matched the ops (KL within 6e-5, gradients within 3e-11) and
trained at 155.6K tok/s against 122.2K with the ops, same config and card.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

ENV_KERNEL = "EAGLENEST_KL_KERNEL"
"""``auto`` (unset): the Triton kernels on CUDA devices of :data:`CHECKED_CAPABILITIES` when Triton is importable,
else PyTorch ops; ``triton``: the kernels on any CUDA device (Triton must be importable); ``torch``: the ops."""
CHECKED_CAPABILITIES = frozenset({(9, 0)})
"""CUDA compute capabilities the kernels were checked and timed on (``eaglenest.testing.kl_kernels``; the H100)."""


def draft_kl(z: torch.Tensor, p: torch.Tensor, neg_entropy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(kl [N] fp32, differentiable in ``z``; argmax [N] int64 of each row of ``z``) for ``z`` [N, V] (any float
    dtype), ``p`` [M, V] fp32 and ``neg_entropy`` [M] fp32 = sum p log p, where N is a multiple of M."""
    m = p.shape[0]
    if z.shape[0] % max(m, 1) or (m == 0 and z.shape[0]):
        raise ValueError(f"draft_kl: {z.shape[0]} logit rows are not a multiple of {m} target rows")
    return triton_kl(z, p, neg_entropy) if use_triton(z) else ops_kl(z, p, neg_entropy)


def use_triton(z: torch.Tensor) -> bool:
    """Whether :func:`draft_kl` runs the Triton kernels for ``z`` (:data:`ENV_KERNEL`; any other value than
    ``torch`` or ``triton`` is refused, so a misspelt choice never trains with the other one unnoticed)."""
    choice = os.environ.get(ENV_KERNEL, "auto")
    if choice not in ("auto", "torch", "triton"):
        raise ValueError(f"{ENV_KERNEL}={choice!r}: choose 'auto', 'torch' or 'triton'")
    if not z.is_cuda or choice == "torch":
        return False
    return choice == "triton" or auto_triton(torch.cuda.get_device_capability(z.device), _has_triton())


def auto_triton(capability: tuple[int, int], has_triton: bool) -> bool:
    """``auto``'s choice for a CUDA device of this compute capability."""
    return has_triton and tuple(capability) in CHECKED_CAPABILITIES


@functools.cache
def _has_triton() -> bool:
    """Whether Triton imports (a broken install takes the ops rather than failing the first training step)."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def ops_kl(z: torch.Tensor, p: torch.Tensor, neg_entropy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`draft_kl` as PyTorch ops."""
    m = p.shape[0]
    logq = F.log_softmax(z.float(), dim=-1).view(z.shape[0] // max(m, 1), m, z.shape[-1])  # (faster than logsumexp)
    kl = (neg_entropy - (p * logq).sum(-1)).view(-1)
    return kl, z.detach().max(-1).indices  # (max() is faster than argmax)


def triton_kl(z: torch.Tensor, p: torch.Tensor, neg_entropy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`draft_kl` in the Triton kernels (CUDA tensors, or CPU ones under ``TRITON_INTERPRET=1``). ``p`` and
    ``neg_entropy`` are the target's, computed without a graph: they get no gradient."""
    return _TritonKL.apply(z, p, neg_entropy)


class _TritonKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: torch.Tensor, p: torch.Tensor, neg_entropy: torch.Tensor):
        z, p = z.contiguous(), p.contiguous()
        lse, dot, psum, argmax = _triton_stats(z, p)
        kl = neg_entropy.repeat(z.shape[0] // max(p.shape[0], 1)) - (dot - lse * psum)
        ctx.save_for_backward(z, p, lse, psum)
        ctx.mark_non_differentiable(argmax)
        return kl, argmax

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_kl: torch.Tensor, _grad_argmax: torch.Tensor | None):
        z, p, lse, psum = ctx.saved_tensors
        return _triton_grad(z, p, lse, psum, grad_kl.float().contiguous()), None, None


# ------------------------------------------------------------------------------ Triton
_BLOCK = 1024


@functools.cache
def _kernels():
    """One program per target row ``m``: the k rows of ``z`` scored against it (``z[i * M + m]``, one per TTT step)
    form a [K, BLOCK] tile, so each block of ``p`` is read once for all k steps."""
    import triton
    import triton.language as tl

    @triton.jit
    def stats(z_ptr, p_ptr, lse_ptr, dot_ptr, psum_ptr, arg_ptr, m_rows, k, v, K: tl.constexpr,
              BLOCK: tl.constexpr):
        m = tl.program_id(0)
        steps = tl.arange(0, K)
        rows = (steps * m_rows + m).to(tl.int64)  # [K] rows of z
        live = steps < k
        p_row = p_ptr + m.to(tl.int64) * v
        mx = tl.full((K,), float("-inf"), tl.float32)
        se = tl.zeros((K,), tl.float32)
        dot = tl.zeros((K,), tl.float32)
        psum = tl.zeros((), tl.float32)
        best = tl.full((K,), float("-inf"), tl.float32)
        best_i = tl.zeros((K,), tl.int32)
        for start in range(0, v, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < v
            tile = live[:, None] & inside[None, :]
            zb = tl.load(z_ptr + rows[:, None] * v + cols[None, :], mask=tile, other=float("-inf")).to(tl.float32)
            pb = tl.load(p_row + cols, mask=inside, other=0.0)
            bm = tl.max(zb, 1)
            bi = tl.argmax(zb, 1).to(tl.int32) + start
            best_i = tl.where(bm > best, bi, best_i)
            best = tl.maximum(best, bm)
            new = tl.maximum(mx, bm)
            new_safe = tl.where(new == float("-inf"), 0.0, new)  # (rows past k: all -inf)
            se = se * tl.exp(mx - new_safe) + tl.sum(tl.exp(zb - new_safe[:, None]), 1)
            mx = new
            dot += tl.sum(pb[None, :] * tl.where(tile, zb, 0.0), 1)
            psum += tl.sum(pb, 0)
        tl.store(lse_ptr + rows, mx + tl.log(se), mask=live)
        tl.store(dot_ptr + rows, dot, mask=live)
        tl.store(psum_ptr + rows, tl.zeros((K,), tl.float32) + psum, mask=live)
        tl.store(arg_ptr + rows, best_i.to(tl.int64), mask=live)

    @triton.jit
    def grad(z_ptr, p_ptr, lse_ptr, psum_ptr, g_ptr, out_ptr, m_rows, k, v, K: tl.constexpr, BLOCK: tl.constexpr):
        m = tl.program_id(0)
        steps = tl.arange(0, K)
        rows = (steps * m_rows + m).to(tl.int64)
        live = steps < k
        p_row = p_ptr + m.to(tl.int64) * v
        lse = tl.load(lse_ptr + rows, mask=live, other=0.0)
        scale = tl.load(psum_ptr + rows, mask=live, other=0.0)
        g = tl.load(g_ptr + rows, mask=live, other=0.0)
        for start in range(0, v, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < v
            tile = live[:, None] & inside[None, :]
            offs = rows[:, None] * v + cols[None, :]
            zb = tl.load(z_ptr + offs, mask=tile, other=0.0).to(tl.float32)
            pb = tl.load(p_row + cols, mask=inside, other=0.0)
            gz = (tl.exp(zb - lse[:, None]) * scale[:, None] - pb[None, :]) * g[:, None]
            tl.store(out_ptr + offs, gz.to(out_ptr.dtype.element_ty), mask=tile)

    return stats, grad


def _launch(z: torch.Tensor, p: torch.Tensor) -> tuple[int, int, dict]:
    """(target rows M, TTT steps k, the kernels' launch arguments): a [K, BLOCK] tile of 1,024 to 8,192 values (k up
    to 128), over 8 warps from 4,096 values (16 to 32 fp32 values a thread for each of the tile's temporaries)."""
    m = p.shape[0]
    k = z.shape[0] // m
    big = 1 << max(0, (k - 1).bit_length())  # the next power of two >= k
    block = max(64, min(_BLOCK, 8192 // big))
    return m, k, {"K": big, "BLOCK": block, "num_warps": 8 if big * block >= 4096 else 4}


def _triton_stats(z: torch.Tensor, p: torch.Tensor):
    stats, _ = _kernels()
    n, v = z.shape
    lse = torch.empty(n, dtype=torch.float32, device=z.device)
    dot, psum = torch.empty_like(lse), torch.empty_like(lse)
    argmax = torch.empty(n, dtype=torch.int64, device=z.device)
    if n:
        m, k, shape = _launch(z, p)
        stats[(m,)](z, p, lse, dot, psum, argmax, m, k, v, **shape)
    return lse, dot, psum, argmax


def _triton_grad(z, p, lse, psum, g):
    _, grad = _kernels()
    out = torch.empty_like(z)
    if z.shape[0]:
        m, k, shape = _launch(z, p)
        grad[(m,)](z, p, lse, psum, g, out, m, k, z.shape[1], **shape)
    return out


__all__ = ["ENV_KERNEL", "draft_kl", "ops_kl", "triton_kl", "use_triton"]
