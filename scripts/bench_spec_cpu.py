"""Benchmark: EAGLE-3 speculative decoding vs plain KV-cached greedy decoding on the CPU, side by side.

    python scripts/bench_spec_cpu.py --draft DRAFTER_DIR [--num-prompts 80] [--max-new-tokens 128]
        [--rounds 1] [--shapes chain3,tree4x4n12] [--save-shape] [--threads 2] [--json-out PATH]

``--draft random`` runs an UNTRAINED drafter (a smoke test: accept length ~1, so a slowdown).
Every prompt (MT-Bench first turns by default) is decoded by plain greedy under each plain oneDNN
policy and by EAGLE-3 under each (policy, shape), in turn. Prints per variant tok/s, accept length
(bonus counted), the cycle cost in plain decode steps (draft / verify / other) and the share of
outputs differing from plain greedy, then the speedup of the best EAGLE-3 variant over the best
plain policy. Writes the JSON (command line, commit, machine, date, result) to ``--json-out``
(default results/cpu_spec_<UTC time>.json). ``--save-shape`` makes the fastest measured shape the
embedded decoder's default on this kind of CPU (eaglenest/speculative/cpu_shape.json: one per kind, AMX or not).
Load from other processes slows every variant alike but adds noise: measure on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from eaglenest.speculative.cpu_bench import (
    PLAIN_POLICIES,
    SPEC_POLICIES,
    default_json_path,
    run_cpu_bench,
    run_record,
    save_measured_shape,
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", required=True, help="exported EAGLE-3 drafter folder, or 'random'")
    ap.add_argument("--model", default="default")
    ap.add_argument("--prompt-set", default="mt-bench", choices=["mt-bench", "humaneval", "sharegpt"])
    ap.add_argument("--num-prompts", type=int, default=80)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1, help="passes over the prompts")
    ap.add_argument("--shapes", default="", help="speculation shapes, e.g. chain3,tree4x4n12 (default: the "
                    "measured best for this kind of CPU in eaglenest/speculative/cpu_shape.json)")
    ap.add_argument("--save-shape", action="store_true",
                    help="make the fastest shape measured the default on this kind of CPU (AMX or not)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--plain-policies", default="", help=f"oneDNN policies (default {','.join(PLAIN_POLICIES)})")
    ap.add_argument("--spec-policies", default="", help=f"oneDNN policies (default {','.join(SPEC_POLICIES)})")
    ap.add_argument("--json-out", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    load = os.getloadavg()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {load}", file=sys.stderr)
    res = run_cpu_bench(model=a.model, draft=a.draft, prompt_set=a.prompt_set, num_prompts=a.num_prompts,
                        max_new_tokens=a.max_new_tokens, shapes=[s for s in a.shapes.split(",") if s] or None,
                        dtype=a.dtype, plain_policies=[p for p in a.plain_policies.split(",") if p] or None,
                        spec_policies=[p for p in a.spec_policies.split(",") if p] or None, rounds=a.rounds,
                        progress=lambda m: print(m, file=sys.stderr, flush=True))
    record = run_record(res, argv=[sys.executable, *sys.argv], load_before=load)
    print("\n".join(res.lines()))
    out = a.json_out or default_json_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")
    if a.save_shape:
        print(f"default shape {res.best('eagle3').shape} saved to {save_measured_shape(res, out, record)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
