"""GPU proofs of the SGLang capture plugin (H200 machine only): runs scripts/gpu_capture_check.py.

Needs CUDA, sglang (a supported version) and a model: EAGLENEST_DEVICE_MODEL (default
.device/models/tiny-llama) and optionally EAGLENEST_DEVICE_DRAFT (an EAGLE3 draft with the same aux ids).
"""

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
def test_gpu_capture_check(tmp_path):
    model = Path(os.environ.get("EAGLENEST_DEVICE_MODEL", ROOT / ".device/models/tiny-llama"))
    if not (model / "config.json").is_file():
        pytest.skip(f"no model at {model}")
    cmd = [sys.executable, str(ROOT / "scripts/gpu_capture_check.py"), "--model", str(model), "--out", str(tmp_path),
           "--aux", os.environ.get("EAGLENEST_DEVICE_AUX", "0,1,2"), "--bench-prompts", "128"]
    if os.environ.get("EAGLENEST_DEVICE_DRAFT"):
        cmd += ["--draft", os.environ["EAGLENEST_DEVICE_DRAFT"]]
    subprocess.run(cmd, timeout=1500, check=False)
    report = json.loads((tmp_path / "report.json").read_text())
    assert not report["errors"], report["errors"]
    phases = report["phases"]
    assert phases["capture"]["ok"] and phases["reference"]["ok"], phases
    assert report["p1"]["ratio"] > 0  # the target (>= 0.97) is judged from the printed number, not asserted
    if "eagle3" in phases and "per_prompt" in phases["eagle3"]:
        assert phases["eagle3"]["ok"], phases["eagle3"]
