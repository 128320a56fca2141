"""The profiler-trace summary: the GPU's busy share counts overlapping kernels once, gaps land in their bucket, each
SGLang phase holds the kernels inside it (clipped at its edges), and the trace counts its own steps."""

from __future__ import annotations

import gzip
import json

import pytest

from eaglenest.speculative.trace import load_trace, phases, summarize


def _kernel(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7}


def _range(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "gpu_user_annotation", "name": name, "ts": ts, "dur": dur}


def test_busy_share_gaps_top_kernels_and_phases(tmp_path):
    events = [
        _kernel("gemm", 0.0, 100.0),
        _kernel("norm", 50.0, 100.0),  # overlaps gemm (another stream): 0-150 busy once, not 200
        _kernel("gemm", 155.0, 45.0),  # a 5-us launch gap
        _kernel("topk", 500.0, 100.0),  # a 300-us host gap
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0.0, "dur": 20.0},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 210.0, "dur": 280.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 5.0},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 1.0},  # not a complete event: ignored
        _range("step[TARGET_VERIFY bs=1]", 0.0, 210.0),
        _range("draft", 450.0, 200.0),
    ]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = summarize(load_trace(path))
    assert s["span_ms"] == pytest.approx(0.6)
    assert s["gpu_busy_ms"] == pytest.approx(0.295)  # 0-150, 155-200, 500-600
    assert s["gpu_busy_share"] == pytest.approx(0.295 / 0.6, abs=1e-4)
    gaps = s["gaps_by_length (count, ms)"]
    assert gaps["0-10us"] == [1, 0.005] and gaps["200-1000us"] == [1, 0.3]
    assert next(iter(s["top_kernels (count, ms)"])) == "gemm" and s["top_kernels (count, ms)"]["gemm"][0] == 2
    assert s["host_cuda_calls (count, ms)"]["cudaStreamSynchronize"] == [1, 0.28]
    assert s["host_ops (count, ms inclusive)"] == {"aten::mm": [1, 0.005]}
    # one verify range: the trace's own step count (not given), so the per-step figures are the whole trace's
    assert s["steps"] == 1 and s["per_step_ms"] == {"span": 0.6, "gpu_busy": 0.295, "kernels": 4.0}
    # the kernels inside each named range: verify holds gemm, norm, gemm (busy 0-150, 155-200), draft the topk
    assert s["phases (count, ms each: span, gpu busy; kernels each)"] == {
        "step[TARGET_VERIFY bs=1]": [1, 0.21, 0.195, 3.0], "draft": [1, 0.2, 0.1, 1.0]}
    assert s["phase_top_kernels (us each)"]["step[TARGET_VERIFY bs=1]"] == {"gemm": 145.0, "norm": 100.0}


def test_a_phase_counts_the_parts_of_kernels_crossing_its_edges():
    events = [_kernel("long", 0.0, 100.0), _kernel("late", 150.0, 100.0), _range("draft", 50.0, 150.0),
              _range("step[DECODE bs=1]", 300.0, 10.0), _range("step[DECODE bs=1]", 320.0, 10.0)]
    split, top = phases(events)
    assert split["draft"] == [1, 0.15, 0.1, 2.0]  # 50-100 of "long" and 150-200 of "late"
    assert top["draft"] == {"long": 50.0, "late": 50.0}
    assert split["step[DECODE bs=1]"] == [2, 0.01, 0.0, 0.0]
    s = summarize(events)
    assert s["steps"] == 2  # no verify ranges: the decode steps count
    assert summarize(events, steps=5)["steps"] == 5


def test_a_trace_without_kernels_is_refused(tmp_path):
    path = tmp_path / "cpu-only.json"
    path.write_text(json.dumps([{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 3}]))
    with pytest.raises(ValueError, match="no GPU kernels"):
        summarize(load_trace(path))
