"""The draft-vocabulary KL's Triton kernels: the same loss, gradient and argmax as the PyTorch ops (run in Triton's
interpreter on this CPU). The ops themselves are checked against the naive TTT loss (test_drafter_ttt_reference)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from eaglenest.drafter.kl_loss import draft_kl


def unfused(z: torch.Tensor, p: torch.Tensor, neg_entropy: torch.Tensor) -> torch.Tensor:
    """The formula as ttt_forward computed it before: the log-softmax [N, V] in fp32, times p, summed."""
    k = z.shape[0] // p.shape[0]
    logq = F.log_softmax(z.float(), dim=-1).view(k, p.shape[0], -1)
    return (neg_entropy - (p * logq).sum(-1)).view(-1)


def case(k: int, m: int, v: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(k * m, v, generator=g) * 3).to(dtype)
    p = torch.softmax(torch.randn(m, v, generator=g) * 2, -1)
    return z, p, (p * p.log()).sum(-1), torch.randn(k * m, generator=g)


def compare(z, p, negent, upstream, *, grad_atol: float):
    ref_z = z.clone().requires_grad_(True)
    ref = unfused(ref_z, p, negent)
    (ref * upstream).sum().backward()
    new_z = z.clone().requires_grad_(True)
    kl, top = draft_kl(new_z, p, negent)
    (kl * upstream).sum().backward()
    torch.testing.assert_close(kl, ref.detach(), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(new_z.grad.float(), ref_z.grad.float(), atol=grad_atol, rtol=1e-2)
    assert new_z.grad.dtype == z.dtype
    assert torch.equal(top, z.float().max(-1).indices)


def test_no_rows_and_a_bad_shape():
    kl, top = draft_kl(torch.zeros(0, 8, requires_grad=True), torch.zeros(0, 8), torch.zeros(0))
    assert kl.shape == (0,) and top.shape == (0,)
    with pytest.raises(ValueError, match="not a multiple"):
        draft_kl(torch.zeros(7, 8), torch.zeros(3, 8), torch.zeros(3))


TRITON_CHECK = """
import torch
from eaglenest.drafter import kl_loss
from tests.drafter.test_kl_loss import case, compare
kl_loss.use_triton = lambda z: True  # the interpreter runs the kernels on CPU tensors
for dtype, atol in ((torch.float32, 1e-6), (torch.bfloat16, 8e-3)):
    # k TTT steps in a tile of the next power of two (3: one dead row); 2,500 values a row: the last block partial
    for k, m in ((3, 5), (4, 2), (1, 3)):
        z, p, negent, up = case(k, m, 2500, dtype, seed=k)
        compare(z, p, negent, up, grad_atol=atol)
print("kernels equal")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_equal_the_unfused_formula():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", TRITON_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "kernels equal" in out.stdout, out.stderr[-3000:]
