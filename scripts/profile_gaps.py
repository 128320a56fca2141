"""What ran while the GPU sat idle: ``nvidia-smi dmon -o DT`` seconds lined up with the stack timelines.

    python scripts/profile_gaps.py --dmon dmon.txt --prof prof/ [--min-gap 1] > gaps.json

``dmon.txt`` is ``nvidia-smi dmon -s um -d 1 -o DT`` (each row: date, time, GPU index, SM %, ...);
``prof/`` holds the ``<role>-<pid>.timeline.jsonl`` files of :mod:`eaglenest.testing.sglang_profiler`
(``EAGLENEST_SAMPLE_PROFILE``: SGLang's scheduler and HTTP processes, the extraction's request loop and
validation). For every run of at least ``--min-gap`` seconds with 0% SM after the GPU's first work, prints
the top innermost functions of each role over those seconds, and the same over the busy seconds to compare.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path


def read_dmon(path: Path) -> list[tuple[float, int]]:
    """(epoch second, SM %) of GPU 0, in the machine's local time as dmon prints it."""
    out = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) < 4 or line.startswith("#") or not (parts[0].isdigit() and len(parts[0]) == 8):
            continue
        if parts[2] != "0" or not parts[3].isdigit():
            continue
        out.append((time.mktime(time.strptime(f"{parts[0]} {parts[1]}", "%Y%m%d %H:%M:%S")), int(parts[3])))
    return out


def idle_gaps(rows: list[tuple[float, int]], min_gap: int) -> list[tuple[float, float]]:
    """[start, end) of the runs of 0% SM seconds after the first busy second, at least ``min_gap`` long."""
    first = next((i for i, (_, sm) in enumerate(rows) if sm > 0), len(rows))
    gaps, start = [], None
    for t, sm in rows[first:]:
        if sm == 0 and start is None:
            start = t
        elif sm > 0 and start is not None:
            if t - start >= min_gap:
                gaps.append((start, t))
            start = None
    return gaps


def read_timelines(prof: Path) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for path in sorted(prof.glob("*.timeline.jsonl")):
        role = path.name.split("-", 1)[0]
        out.setdefault(role, []).extend(json.loads(x) for x in path.read_text().splitlines() if x.strip())
    return out


def top_in(lines: list[dict], spans: list[tuple[float, float]], window: tuple[float, float], *, inside: bool,
           top: int = 8) -> dict:
    """Shares of the innermost functions over the timeline lines of ``window`` whose second lies in (or
    outside) ``spans`` (a line covers the second before its time)."""
    counts, samples = Counter(), 0
    for x in lines:
        t = x["t"] - 0.5
        if not window[0] <= t < window[1]:
            continue
        if any(a <= t < b for a, b in spans) == inside:
            samples += x["samples"]
            counts.update(dict(x["self"]))
    return {"samples": samples, "self": [(k, round(v / max(samples, 1), 3)) for k, v in counts.most_common(top)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dmon", required=True, type=Path)
    ap.add_argument("--prof", required=True, type=Path)
    ap.add_argument("--min-gap", type=int, default=1)
    a = ap.parse_args()
    rows = read_dmon(a.dmon)
    gaps = idle_gaps(rows, a.min_gap)
    timelines = read_timelines(a.prof)
    busy = [t for t, sm in rows if sm > 0]
    window = (busy[0], rows[-1][0] + 1) if busy else (0.0, 0.0)  # from the GPU's first work on
    print(json.dumps({
        "seconds": len(rows), "busy_seconds": len(busy), "idle_seconds_in_gaps": sum(b - a for a, b in gaps),
        "gaps": [[time.strftime("%H:%M:%S", time.localtime(a)), b - a] for a, b in gaps],
        "while_idle": {r: top_in(lines, gaps, window, inside=True) for r, lines in timelines.items()},
        "while_busy": {r: top_in(lines, gaps, window, inside=False) for r, lines in timelines.items()},
    }, indent=1))


if __name__ == "__main__":
    main()
