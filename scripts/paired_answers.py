"""Two live bench reports of the same prompts (report.json, e.g. two drafters on one prompt set), paired by answer.

Greedy answers diverge between servers where a near-tie flips under other kernels or batch shapes, so each drafter's
live accept length is measured on partly different answers. This prints, per concurrency, how many prompts both
answered token for token alike and each side's accept length over those prompts alone: the paired comparison.

    python scripts/paired_answers.py RUN_A/mt-bench/steps3/report.json RUN_B/mt-bench/steps3/report.json
"""

from __future__ import annotations

import argparse
import json

from eaglenest.speculative.loadgen import compare_answers
from eaglenest.speculative.report import read_report


def main(argv: list[str] | None = None) -> dict[int, dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", help="the first report.json")
    ap.add_argument("b", help="the second report.json (same prompts)")
    ap.add_argument("--server", choices=("eagle3", "baseline"), default="eagle3", help="which server's answers")
    args = ap.parse_args(argv)
    ra, rb = read_report(args.a), read_report(args.b)
    differ = [f"{k} {getattr(ra, k)!r} / {getattr(rb, k)!r}" for k in ("prompt_set", "prompt_source", "num_prompts",
              "max_new_tokens") if getattr(ra, k) != getattr(rb, k)]
    if differ:  # a prompt's index would name another prompt, or an answer of another length
        raise SystemExit(f"{args.a} and {args.b} did not decode the same prompts alike: {'; '.join(differ)}")
    out = {}
    for lv in getattr(ra, args.server).levels:
        other = rb.level(args.server, lv.concurrency)
        if other is not None and (same := compare_answers(lv, other)) is not None:
            out[lv.concurrency] = same
    if not out:
        raise SystemExit(f"no level of {args.a} and {args.b} records its answers (reports written before 2026-12-06h)")
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
