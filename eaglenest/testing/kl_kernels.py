"""A check of the draft-vocabulary KL's Triton kernels against its PyTorch ops (:mod:`eaglenest.drafter.kl_loss`), for
the tests (interpreted on a CPU, compiled on a GPU) and for the GPU recipe before it trains with the kernels."""

from __future__ import annotations

import torch

from eaglenest.drafter.kl_loss import ops_kl, triton_kl


def check_kernels(device: str = "cuda", *, v: int = 32000, rows: int = 300) -> dict:
    """The Triton kernels against the PyTorch ops on random bf16 logits of ``device`` (CPU tensors need
    ``TRITON_INTERPRET=1``), for k = 1, 3 and 4 TTT steps: the largest loss and gradient differences, whether each
    argmax is its row's maximum (bf16 logits tie), and ``ok`` (loss within 2e-5 + 1e-5 relative, gradient within
    one bf16 rounding). The recipe (KL_AB=1) runs it on the GPU before training with them."""
    out: dict = {"ok": True}
    for k in (1, 3, 4):
        g = torch.Generator().manual_seed(k)
        z = (torch.randn(k * rows, v, generator=g) * 3).to(torch.bfloat16).to(device)
        p = torch.softmax(torch.randn(rows, v, generator=g) * 2, -1).to(device)
        negent, up = (p * p.log()).sum(-1), torch.randn(k * rows, generator=g).to(device)
        got = {}
        for name, fn in (("ops", ops_kl), ("triton", triton_kl)):
            x = z.clone().requires_grad_(True)
            kl, top = fn(x, p, negent)
            (kl * up).sum().backward()
            got[name] = kl.detach(), x.grad.float(), top
        (kl_a, grad_a, _), (kl_b, grad_b, top_b) = got["ops"], got["triton"]
        zf = z.float()
        kl_err = float(((kl_b - kl_a).abs() - 1e-5 * kl_a.abs()).max())
        grad_err = float(((grad_b - grad_a).abs() - 2 ** -7 * grad_a.abs()).max())
        argmax_ok = bool(torch.equal(zf.gather(1, top_b[:, None]).squeeze(1), zf.max(-1).values))
        out[f"k{k}"] = {"kl_excess": kl_err, "grad_excess": grad_err, "argmax_is_max": argmax_ok}
        out["ok"] &= kl_err <= 2e-5 and grad_err <= 1e-6 and argmax_ok
    return out


__all__ = ["check_kernels"]
