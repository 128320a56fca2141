"""The TTT loss's draft-vocabulary KL: PyTorch ops, or Triton kernels that never materialise the log-softmax.

For draft logits ``z`` [N, V] (the k TTT steps' rows stacked, N = k * M) and the target's distribution ``p``
[M, V] over the same vocabulary (row ``r`` of ``z`` is scored against ``p[r % M]``):

    kl[r] = sum_v p log p - sum_v p log softmax(z[r])  =  negent[r % M] - (sum_v p z  -  lse(z[r]) * sum_v p)

and d kl[r] / d z[r, v] = softmax(z[r])_v * sum p - p_v. So the forward needs per row only the log-sum-exp, the
dot product with ``p`` and the argmax (the accuracy), and the backward recomputes softmax from ``z`` and the saved
log-sum-exp: neither the fp32 log-softmax [N, V] nor the product with ``p`` is ever materialised or kept for the
backward. On the GPU that was the training step's largest cost (2026-12-04b's profile: elementwise products,
copies and log-softmaxes over these values were ~54% of its GPU time, the matmuls 26%).

Without Triton (the CPU, or ``EAGLENEST_KL_KERNEL`` unset) the same formula runs as PyTorch ops, the fp32
log-softmax kept for the backward as before. With ``EAGLENEST_KL_KERNEL=triton`` on CUDA: Triton kernels, one
program per row, one pass over ``z`` and ``p`` forward (log-sum-exp, dot, argmax) and one backward (softmax
recomputed from ``z``): ~14 bytes read or written per value against ~70 for the ops; opt-in until measured on the
device (the recipe's KL_AB=1).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

ENV_KERNEL = "EAGLENEST_KL_KERNEL"
"""``triton``: the Triton kernels on CUDA tensors (Triton must be importable); unset or ``torch``: PyTorch ops."""


def draft_kl(z: torch.Tensor, p: torch.Tensor, neg_entropy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(kl [N] fp32, differentiable in ``z``; argmax [N] int64 of each row of ``z``) for ``z`` [N, V] (any float
    dtype), ``p`` [M, V] fp32 and ``neg_entropy`` [M] fp32 = sum p log p, where N is a multiple of M."""
    m = p.shape[0]
    if z.shape[0] % max(m, 1):
        raise ValueError(f"draft_kl: {z.shape[0]} logit rows are not a multiple of {m} target rows")
    if use_triton(z):
        return _TritonKL.apply(z, p, neg_entropy)
    logq = F.log_softmax(z.float(), dim=-1).view(z.shape[0] // max(m, 1), m, z.shape[-1])  # (faster than logsumexp)
    kl = (neg_entropy - (p * logq).sum(-1)).view(-1)
    return kl, z.detach().max(-1).indices  # (max() is faster than argmax)


def use_triton(z: torch.Tensor) -> bool:
    return z.is_cuda and os.environ.get(ENV_KERNEL, "torch") == "triton"


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
    def backward(ctx, grad_kl: torch.Tensor, _grad_argmax: torch.Tensor | None):
        z, p, lse, psum = ctx.saved_tensors
        return _triton_grad(z, p, lse, psum, grad_kl.float().contiguous()), None, None


# ------------------------------------------------------------------------------ Triton
_BLOCK = 1024


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def stats(z_ptr, p_ptr, lse_ptr, dot_ptr, psum_ptr, arg_ptr, m_rows, v, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        z_row = z_ptr + row.to(tl.int64) * v
        p_row = p_ptr + (row % m_rows).to(tl.int64) * v
        mx = tl.full((), float("-inf"), tl.float32)
        se = tl.zeros((), tl.float32)
        dot = tl.zeros((), tl.float32)
        psum = tl.zeros((), tl.float32)
        best = tl.full((), float("-inf"), tl.float32)
        best_i = tl.zeros((), tl.int32)
        for start in range(0, v, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < v
            zb = tl.load(z_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
            pb = tl.load(p_row + cols, mask=inside, other=0.0)
            bm = tl.max(zb, 0)
            bi = tl.argmax(zb, 0).to(tl.int32) + start
            best_i = tl.where(bm > best, bi, best_i)
            best = tl.maximum(best, bm)
            new = tl.maximum(mx, bm)
            se = se * tl.exp(mx - new) + tl.sum(tl.exp(zb - new), 0)
            mx = new
            dot += tl.sum(pb * tl.where(inside, zb, 0.0), 0)
            psum += tl.sum(pb, 0)
        tl.store(lse_ptr + row, mx + tl.log(se))
        tl.store(dot_ptr + row, dot)
        tl.store(psum_ptr + row, psum)
        tl.store(arg_ptr + row, best_i.to(tl.int64))

    @triton.jit
    def grad(z_ptr, p_ptr, lse_ptr, psum_ptr, g_ptr, out_ptr, m_rows, v, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        z_row = z_ptr + row.to(tl.int64) * v
        p_row = p_ptr + (row % m_rows).to(tl.int64) * v
        out_row = out_ptr + row.to(tl.int64) * v
        lse = tl.load(lse_ptr + row)
        psum = tl.load(psum_ptr + row)
        g = tl.load(g_ptr + row)
        for start in range(0, v, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < v
            zb = tl.load(z_row + cols, mask=inside, other=0.0).to(tl.float32)
            pb = tl.load(p_row + cols, mask=inside, other=0.0)
            gz = (tl.exp(zb - lse) * psum - pb) * g
            tl.store(out_row + cols, gz.to(out_ptr.dtype.element_ty), mask=inside)

    return stats, grad


def _triton_stats(z: torch.Tensor, p: torch.Tensor):
    stats, _ = _kernels()
    n, v = z.shape
    lse = torch.empty(n, dtype=torch.float32, device=z.device)
    dot, psum = torch.empty_like(lse), torch.empty_like(lse)
    argmax = torch.empty(n, dtype=torch.int64, device=z.device)
    if n:
        stats[(n,)](z, p, lse, dot, psum, argmax, p.shape[0], v, BLOCK=_BLOCK)
    return lse, dot, psum, argmax


def _triton_grad(z, p, lse, psum, g):
    _, grad = _kernels()
    out = torch.empty_like(z)
    if z.shape[0]:
        grad[(z.shape[0],)](z, p, lse, psum, g, out, p.shape[0], z.shape[1], BLOCK=_BLOCK)
    return out


__all__ = ["ENV_KERNEL", "draft_kl", "use_triton"]
