"""GPU machine: offline accept length on the prompts a live grid measured, side by side with it. No Prefect.

    python scripts/gpu_calibrate.py --model MODEL_DIR --draft DRAFTER_DIR --prompts CALIB.jsonl \
        [--live report.json ...] [--server-url http://127.0.0.1:30001 --server-capture-dir DIR] \
        [--max-new-tokens 256] [--depths 1,2,3,4,5,6,7,8] [--shape tree6x4n15 ...] [--work /tmp/calib]

CALIB.jsonl is written on a machine with the packages (the GPU machine has no network):
``eaglenest bench prompts --format messages --prompt-set mt-bench --prompt-set humaneval --prompt-set sharegpt
--limit 80 --out .bench/calib.jsonl``. The target answers every prompt greedily on SGLang with the capture
plugin (launched by the extraction library, or the running capture server given by --server-url), the answers
are captured (into --work, NOT $OUT: the shards are large), and the drafter is simulated on exactly those
samples for chain depths 1..8 (:mod:`eaglenest.speculative.calibration`). Writes $OUT/calibration.json and
calibration.md: per prompt set the offline accept length per verify cycle (what SGLang reports) at each depth,
and for every --live report (scripts/gpu_bench_grid.py's ``matrix.json``, or one ``report.json``) offline, live
and their ratio per prompt set, depth and concurrency. Re-running with the same --work reuses the capture
(only missing answers are generated).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project root travels with the command

from eaglenest.speculative.calibration import CaptureSettings, calibrate_on_prompts, markdown, write_calibration
from eaglenest.speculative.tree import SpecShape


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="target folder (the one the drafter was trained for)")
    ap.add_argument("--draft", required=True, help="exported EAGLE-3 drafter folder")
    ap.add_argument("--prompts", required=True, help="prompt source from `eaglenest bench prompts --format messages`")
    ap.add_argument("--live", action="append", default=[],
                    help="live matrix.json / report.json of the same prompts (repeatable)")
    ap.add_argument("--server-url", action="append", default=[], help="running SGLang capture server (repeatable)")
    ap.add_argument("--server-capture-dir", default=None, help="where that server writes shards, if it does not say")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="the live grid's --max-new-tokens")
    ap.add_argument("--depths", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--shape", action="append", default=[],
                    help="also replay this shape (a tree: tree6x4n15 = steps 6, topk 4, 16 draft tokens) on the CPU")
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--sglang-arg", action="append", default=[])
    ap.add_argument("--work", default="/tmp/calib", help="capture folder (large; not under $OUT)")
    a = ap.parse_args()
    out = Path(os.environ.get("OUT", "/tmp/out"))
    settings = CaptureSettings(model=a.model, engine="sglang", server_urls=a.server_url,
                               max_new_tokens=a.max_new_tokens, batch_size=a.batch_size, concurrency=a.concurrency,
                               sglang_args=a.sglang_arg, server_capture_dir=a.server_capture_dir)
    last = [0.0]

    def progress(p) -> None:  # one line every 15 s
        if p.elapsed_s - last[0] >= 15:
            last[0] = p.elapsed_s
            print(f"capture: {p.answered}/{p.total} answered, {p.failed} failed, {p.tokens} tokens, "
                  f"{p.elapsed_s:.0f} s", flush=True)

    report = calibrate_on_prompts(source=a.prompts, draft=a.draft, settings=settings, work_dir=a.work,
                                  live_reports=a.live, depths=[int(x) for x in a.depths.split(",") if x],
                                  shapes=[SpecShape.parse(x) for x in a.shape],
                                  on_progress=progress)
    report.notes.append("command: " + " ".join(sys.argv))
    path = write_calibration(report, out)
    print(markdown(report), flush=True)
    print(json.dumps({"written": str(path)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
