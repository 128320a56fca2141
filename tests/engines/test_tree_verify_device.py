"""The split-KV tree-verify kernel against SGLang's own on a GPU (device machine only): scripts/gpu_verify_kernel.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sglang_capture_helpers import NEEDS_GPU_AND_SGLANG

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.device
@pytest.mark.sglang
@NEEDS_GPU_AND_SGLANG
def test_tree_verify_kernel_agrees_with_sglangs_on_the_gpu(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "scripts/gpu_verify_kernel.py"), "--prefixes", "5,300",
                           "--batch", "1,3"], env={**os.environ, "OUT": str(tmp_path)}, timeout=600,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads((tmp_path / "verify-kernel.json").read_text())["rows"]
    assert len(rows) == 4 and all(r["max_diff_vs_sglang"] < 0.05 for r in rows), rows
