"""Offline accept length beside live, when the offline side was measured by training: the train step's eval
on the calibration capture (the same prompts the live grid decodes), read from its result JSON. No capture, no
GPU: this pairs numbers that already exist (scripts/gpu_calibrate.py captures and simulates when they do not).

    python scripts/offline_vs_live.py --train-result train-result-v32.json --live matrix-steps3.json \
        [--live matrix-steps5.json ...] [--out offline-vs-live.json]

Prints the table (offline / live per prompt set, depth and concurrency; depths beyond the training's TTT steps
have no offline number) and writes it as JSON with the command line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eaglenest.speculative.calibration import CalibrationReport, live_accepts, markdown, sets_from_eval, side_by_side


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train-result", required=True, help="a training run's result JSON (with eval_sets)")
    ap.add_argument("--live", action="append", required=True, help="live matrix.json / report.json (repeatable)")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="the calibration capture's answer cap (data step)")
    ap.add_argument("--out", default=None, help="write the table here as JSON")
    ap.add_argument("--draft", default=None,
                    help="the drafter's folder name, where a --live grid served several drafters side by side")
    a = ap.parse_args()
    result = json.loads(Path(a.train_result).read_text())
    if not result.get("eval_sets"):
        ap.error(f"{a.train_result} has no eval_sets: train with --eval-set NAME=CAPTURE on the calibration capture")
    sets = sets_from_eval(result["eval_sets"])
    try:
        live = [lv for path in a.live for lv in live_accepts(json.loads(Path(path).read_text()), path, a.draft)]
    except ValueError as e:
        ap.error(str(e))
    capture = {"engine": "training eval", "max_new_tokens": a.max_new_tokens}
    report = CalibrationReport(model="", draft=a.train_result, capture=capture, sets=sets,
                               rows=side_by_side(sets, live), notes=["command: " + " ".join(sys.argv)])
    print(markdown(report), end="")
    if a.out:
        Path(a.out).write_text(json.dumps(report.to_json(), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
