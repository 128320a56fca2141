"""Where a decode step's wall time goes, from a PyTorch profiler trace (the JSON SGLang's ``/start_profile`` writes).

A speculation cycle for a small target costs about 2.2 baseline decode steps whatever it drafts (issue 14): is
that the GPU's work, or the host's (Python, kernel launches, waits) with the GPU idle between? The trace answers
it: the kernels' busy time (the union of their intervals, so overlapping streams count once) against the span
they cover, the idle gaps between them, and the host's CUDA runtime calls (graph launches, synchronizing waits).
"""

from __future__ import annotations

import bisect
import gzip
import itertools
import json
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
PHASE_CATEGORY = "gpu_user_annotation"
"""SGLang's named ranges (``draft``, ``draft_extend``, ``step[TARGET_VERIFY bs=1]``, ``step[DECODE bs=1]``, ...) as the
profiler lays them on the GPU's timeline: the kernels inside one are that phase's work."""
GAP_BUCKETS_US = (10.0, 50.0, 200.0, 1000.0)
"""Idle gaps between kernels are counted in these bounds (us): below 10 us is launch spacing, above 200 us the
GPU waits on the host."""


def load_trace(path: str | Path) -> list[dict[str, Any]]:
    """The complete ('X') events of a Chrome trace (``.json`` or ``.json.gz``)."""
    p = Path(path)
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt", encoding="utf-8") as f:
        data = json.load(f)
    events = data.get("traceEvents", data) if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ValueError(f"{p}: not a Chrome trace (no traceEvents list)")
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "dur" in e and "ts" in e]


def _union(intervals: Iterable[tuple[float, float]]) -> tuple[float, list[float]]:
    """Total covered length of ``(start, end)`` intervals, and the gaps between the merged ones."""
    busy, gaps = 0.0, []
    cur_s = cur_e = None
    for s, e in sorted(intervals):
        if cur_e is None:
            cur_s, cur_e = s, e
        elif s <= cur_e:
            cur_e = max(cur_e, e)
        else:
            busy += cur_e - cur_s
            gaps.append(s - cur_e)
            cur_s, cur_e = s, e
    if cur_e is not None:
        busy += cur_e - cur_s
    return busy, gaps


def summarize(events: list[dict[str, Any]], *, steps: int | None = None, top: int = 15) -> dict[str, Any]:
    """The GPU's busy share of the span its kernels cover, the gaps, the costliest kernels and host calls.

    ``steps``: decode steps (baseline) or verify cycles (EAGLE3) the trace holds, for per-step figures."""
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    if not gpu:
        raise ValueError("the trace holds no GPU kernels (was the profile started with activities GPU?)")
    start = min(float(e["ts"]) for e in gpu)
    end = max(float(e["ts"]) + float(e["dur"]) for e in gpu)
    busy, gaps = _union((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu)
    span = end - start
    buckets: dict[str, list[float]] = {}
    bounds = (0.0, *GAP_BUCKETS_US, float("inf"))
    for lo, hi in itertools.pairwise(bounds):
        inside = [g for g in gaps if lo <= g < hi]
        buckets[f"{lo:g}-{hi:g}us"] = [len(inside), round(sum(inside) / 1e3, 3)]
    kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in gpu:
        k = kernels[str(e.get("name", "?"))]
        k[0] += 1
        k[1] += float(e["dur"])
    runtime: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    host: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])  # ATen ops and annotated ranges (inclusive)
    for e in events:
        table = {"cuda_runtime": runtime, "cuda_driver": runtime, "cpu_op": host, "user_annotation": host}.get(
            str(e.get("cat")))
        if table is not None:
            r = table[str(e.get("name", "?"))]
            r[0] += 1
            r[1] += float(e["dur"])
    ms = 1e3

    def ranked(table: dict[str, list[float]]) -> dict[str, list[float]]:
        return {n: [int(c), round(t / ms, 3)] for n, (c, t) in sorted(table.items(), key=lambda kv: -kv[1][1])[:top]}

    out: dict[str, Any] = {
        "span_ms": round(span / ms, 3),
        "gpu_busy_ms": round(busy / ms, 3),
        "gpu_busy_share": round(busy / span, 4) if span else None,
        "kernels": len(gpu),
        "gaps_by_length (count, ms)": buckets,
        "top_kernels (count, ms)": ranked(kernels),
        "host_cuda_calls (count, ms)": ranked(runtime),
        "host_ops (count, ms inclusive)": ranked(host),
    }
    out["phases (count, ms each: span, gpu busy; kernels each)"] = phases(events, gpu)
    if steps:
        out["steps"] = steps
        out["per_step_ms"] = {"span": round(span / ms / steps, 4), "gpu_busy": round(busy / ms / steps, 4),
                              "kernels": round(len(gpu) / steps, 1)}
    return out



def phases(events: list[dict[str, Any]], gpu: list[dict[str, Any]] | None = None) -> dict[str, list[float]]:
    """Per named GPU range: how often it ran, its mean span and the kernels' busy time inside it (ms, overlapping
    kernels once), and the kernels it held, largest span first (nested ranges, e.g. scheduler.run_batch around a
    step, each count)."""
    gpu = gpu if gpu is not None else [e for e in events if e.get("cat") in GPU_CATEGORIES]
    kernels = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu)
    starts = [k[0] for k in kernels]
    acc: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0])
    for e in events:
        if e.get("cat") != PHASE_CATEGORY:
            continue
        lo, hi = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        i, inside = bisect.bisect_left(starts, lo), []
        while i < len(kernels) and kernels[i][0] < hi:
            inside.append((kernels[i][0], min(kernels[i][1], hi)))
            i += 1
        busy, n = _union(inside)[0], len(inside)
        a = acc[str(e.get("name", "?"))]
        a[0] += 1
        a[1] += hi - lo
        a[2] += busy
        a[3] += n
    return {name: [int(c), round(span / c / 1e3, 4), round(busy / c / 1e3, 4), round(n / c, 1)]
            for name, (c, span, busy, n) in sorted(acc.items(), key=lambda kv: -kv[1][1])}
