"""The profiler-trace summary: the GPU's busy share counts overlapping kernels once, and gaps land in their bucket."""

from __future__ import annotations

import gzip
import json

import pytest

from eaglenest.speculative.trace import load_trace, summarize


def _kernel(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7}


def test_busy_share_gaps_and_top_kernels(tmp_path):
    events = [
        _kernel("gemm", 0.0, 100.0),
        _kernel("norm", 50.0, 100.0),  # overlaps gemm (another stream): 0-150 busy once, not 200
        _kernel("gemm", 155.0, 45.0),  # a 5-us launch gap
        _kernel("topk", 500.0, 100.0),  # a 300-us host gap
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0.0, "dur": 20.0},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 210.0, "dur": 280.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 5.0},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 1.0},  # not a complete event: ignored
        {"ph": "X", "cat": "gpu_user_annotation", "name": "verify", "ts": 0.0, "dur": 210.0},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "draft", "ts": 450.0, "dur": 200.0},
    ]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = summarize(load_trace(path), steps=2)
    assert s["span_ms"] == pytest.approx(0.6)
    assert s["gpu_busy_ms"] == pytest.approx(0.295)  # 0-150, 155-200, 500-600
    assert s["gpu_busy_share"] == pytest.approx(0.295 / 0.6, abs=1e-4)
    gaps = s["gaps_by_length (count, ms)"]
    assert gaps["0-10us"] == [1, 0.005] and gaps["200-1000us"] == [1, 0.3]
    assert next(iter(s["top_kernels (count, ms)"])) == "gemm" and s["top_kernels (count, ms)"]["gemm"][0] == 2
    assert s["host_cuda_calls (count, ms)"]["cudaStreamSynchronize"] == [1, 0.28]
    assert s["host_ops (count, ms inclusive)"] == {"aten::mm": [1, 0.005]}
    assert s["per_step_ms"]["kernels"] == 2.0
    # the kernels inside each named range: verify holds gemm, norm, gemm (busy 0-150, 155-200), draft the topk
    assert s["phases (count, ms each: span, gpu busy; kernels each)"] == {
        "verify": [1, 0.21, 0.195, 3.0], "draft": [1, 0.2, 0.1, 1.0]}


def test_a_trace_without_kernels_is_refused(tmp_path):
    path = tmp_path / "cpu-only.json"
    path.write_text(json.dumps([{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 3}]))
    with pytest.raises(ValueError, match="no GPU kernels"):
        summarize(load_trace(path))
