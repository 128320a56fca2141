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
from collections import Counter, defaultdict
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


STEP_PHASES = ("step[TARGET_VERIFY", "step[DECODE")
"""The ranges that count a trace's steps: EAGLE3's verify cycles, else the baseline's decode steps (prefill aside)."""


def summarize(events: list[dict[str, Any]], *, steps: int | None = None, top: int = 15) -> dict[str, Any]:
    """The GPU's busy share of the span its kernels cover, the gaps, the costliest kernels and host calls, and the
    split by SGLang's phases. "Kernels" counts every GPU operation (memcpy and memset too).

    ``steps``: the decode steps (baseline) or verify cycles (EAGLE3) to divide by; by default the trace's own count
    of verify ranges, else of decode ranges (:data:`STEP_PHASES`). The per-step figures include the prefills'."""
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

    split, split_kernels = phases(events, gpu)
    out: dict[str, Any] = {
        "span_ms": round(span / ms, 3),
        "gpu_busy_ms": round(busy / ms, 3),
        "gpu_busy_share": round(busy / span, 4) if span else None,
        "kernels": len(gpu),
        "gaps_by_length (count, ms)": buckets,
        "top_kernels (count, ms)": ranked(kernels),
        "host_cuda_calls (count, ms)": ranked(runtime),
        "host_ops (count, ms inclusive)": ranked(host),
        "phases (count, ms each: span, gpu busy; kernels each)": split,
        "phase_top_kernels (us each)": split_kernels,
    }
    steps = _trace_steps(split) if steps is None else steps
    if steps:
        out["steps"] = steps
        out["per_step_ms"] = {"span": round(span / ms / steps, 4), "gpu_busy": round(busy / ms / steps, 4),
                              "kernels": round(len(gpu) / steps, 1)}
    return out


def _trace_steps(split: dict[str, list[float]]) -> int | None:
    """How many steps a trace holds by its own ranges: the first of :data:`STEP_PHASES` that it has."""
    for prefix in STEP_PHASES:
        counts = [int(v[0]) for name, v in split.items() if name.startswith(prefix)]
        if counts:
            return sum(counts)
    return None


def phases(events: list[dict[str, Any]], gpu: list[dict[str, Any]] | None = None,
           top: int = 8) -> tuple[dict[str, list[float]], dict[str, dict[str, float]]]:
    """Per named GPU range: how often it ran, its mean span and the kernels' busy time inside it (ms, overlapping
    kernels once, each clipped to the range), and the kernels it held, largest span first (nested ranges, e.g.
    scheduler.run_batch around a step, each count); and per range its ``top`` kernels' mean time in it (us)."""
    gpu = gpu if gpu is not None else [e for e in events if e.get("cat") in GPU_CATEGORIES]
    kernels = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), str(e.get("name", "?"))) for e in gpu)
    starts = [k[0] for k in kernels]
    longest = max((k[1] - k[0] for k in kernels), default=0.0)
    acc: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0])
    names: dict[str, Counter[str]] = defaultdict(Counter)
    for e in events:
        if e.get("cat") != PHASE_CATEGORY:
            continue
        label, lo, hi = str(e.get("name", "?")), float(e["ts"]), float(e["ts"]) + float(e["dur"])
        i, inside = bisect.bisect_left(starts, lo - longest), []  # (a kernel may start before the range)
        while i < len(kernels) and kernels[i][0] < hi:
            s, t, name = kernels[i]
            if t > lo:
                inside.append((max(s, lo), min(t, hi)))
                names[label][name] += min(t, hi) - max(s, lo)
            i += 1
        a = acc[label]
        a[0] += 1
        a[1] += hi - lo
        a[2] += _union(inside)[0]
        a[3] += len(inside)
    order = sorted(acc.items(), key=lambda kv: -kv[1][1])
    split = {name: [int(c), round(span / c / 1e3, 4), round(busy / c / 1e3, 4), round(n / c, 1)]
             for name, (c, span, busy, n) in order}
    top_kernels = {name: {k: round(t / acc[name][0], 1) for k, t in names[name].most_common(top)} for name, _ in order}
    return split, top_kernels
