"""The draft-vocabulary KL's Triton kernels give the PyTorch ops' loss, gradient and argmax (on this CPU in Triton's
interpreter; on a GPU compiled, as the recipe checks before training with them). The ops themselves are checked
against the naive TTT loss (test_drafter_ttt_reference)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from eaglenest.drafter.kl_loss import auto_triton, draft_kl, use_triton
from eaglenest.testing.kl_kernels import check_kernels

INTERPRETED = """
import json
from eaglenest.testing.kl_kernels import check_kernels
# 2,500 logits a row: the last block of each tile partial; k = 3 leaves a dead row in its tile of 4
print(json.dumps(check_kernels("cpu", v=2500, rows=5)))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_interpreted_kernels_equal_the_ops():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["ok"], report
    assert set(report) == {"ok", "k1", "k3", "k4"}


@pytest.mark.device
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                    reason="needs a CUDA device and triton")
def test_compiled_kernels_equal_the_ops_on_the_gpu():
    report = check_kernels("cuda")
    assert report["ok"], report


def test_no_rows_and_a_bad_shape():
    kl, top = draft_kl(torch.zeros(0, 8, requires_grad=True), torch.zeros(0, 8), torch.zeros(0))
    assert kl.shape == (0,) and top.shape == (0,)
    for rows in (3, 0):
        with pytest.raises(ValueError, match="not a multiple"):
            draft_kl(torch.zeros(7, 8), torch.zeros(rows, 8), torch.zeros(rows))


def test_a_misspelt_kernel_choice_is_refused(monkeypatch):
    monkeypatch.setenv("EAGLENEST_KL_KERNEL", "tritn")
    with pytest.raises(ValueError, match="EAGLENEST_KL_KERNEL='tritn'"):
        draft_kl(torch.zeros(2, 8), torch.zeros(1, 8), torch.zeros(1))


def test_auto_takes_the_kernels_only_on_checked_gpus(monkeypatch):
    assert auto_triton((9, 0), True)
    assert not auto_triton((9, 0), False)  # no Triton: the ops
    assert not auto_triton((8, 0), True) and not auto_triton((12, 0), True)  # not checked there
    for choice in ("auto", "triton", "torch"):  # a CPU tensor always takes the ops
        monkeypatch.setenv("EAGLENEST_KL_KERNEL", choice)
        assert not use_triton(torch.zeros(2, 8))
