"""Accept length and decode throughput read back from an SGLang server log, for a live run whose report
was lost (the call ran out of time before the bench wrote its JSON).

    python scripts/sglang_log_stats.py server_eagle3@3.log [--out stats.json]

SGLang logs a ``Decode batch`` line every few dozen decode steps with the running requests, the accept
length and the generation throughput of that window. Consecutive lines are grouped into segments of one
request in flight (concurrency 1) and of more (a concurrency-N level), in log order; each segment reports
its first and last time, its number of lines, the mean accept length over its lines and the median
throughput. These are means of windows, not of cycles: an estimate (within a few percent of the bench's
own number when both exist), never a replacement for the bench report.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

LINE = re.compile(r"(\d\d:\d\d:\d\d)\] Decode batch, #running-req: (\d+).*?accept len: ([\d.]+)"
                  r".*?gen throughput \(token/s\): ([\d.]+)")


def segments(lines: list[str], min_lines: int = 3) -> list[dict]:
    rows = [(m[1], int(m[2]), float(m[3]), float(m[4])) for m in map(LINE.search, lines) if m]
    out: list[dict] = []
    cur: list[tuple] = []
    for r in rows:
        if cur and (cur[-1][1] == 1) != (r[1] == 1):
            out.append(cur)
            cur = []
        cur.append(r)
    if cur:
        out.append(cur)
    return [{"in_flight": "1" if seg[0][1] == 1 else f"2..{max(r[1] for r in seg)}", "first": seg[0][0],
             "last": seg[-1][0], "lines": len(seg), "accept_length": round(statistics.fmean(r[2] for r in seg), 3),
             "gen_tok_s_median": statistics.median(r[3] for r in seg)}
            for seg in out if len(seg) >= min_lines]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    segs = segments(a.log.read_text(errors="replace").splitlines())
    for s in segs:
        print(f"{s['in_flight']:>6} {s['first']}-{s['last']} {s['lines']:4d} lines  accept {s['accept_length']:.3f}"
              f"  {s['gen_tok_s_median']:.0f} tok/s")
    if a.out:
        a.out.write_text(json.dumps({"command": sys.argv, "segments": segs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
