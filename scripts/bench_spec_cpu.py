"""Benchmark: EAGLE-3 speculative decoding vs plain KV-cached greedy decoding on the CPU, side by side.

    python scripts/bench_spec_cpu.py --draft DRAFTER_DIR [--model default] [--prompt-set mt-bench]
        [--num-prompts 8] [--max-new-tokens 64] [--steps 3] [--dtype auto] [--threads 2]
        [--policies onednn,no-onednn,prefill-only,prefill+verify] [--json-out result.json]

``--draft random`` runs an UNTRAINED drafter (a smoke test: accept length ~1, so a slowdown).
Prints, per method and oneDNN policy, tok/s (prefill + decode wall time) and decode tok/s; the accept
length (bonus token counted) with per-position acceptance; the speedup of the best speculative policy
over the best plain policy; and how many outputs differed from plain greedy (0 expected in float32; a
few in bfloat16, where a batched verify may round differently). Both methods decode every prompt in
turn, so load from other processes hits both alike; still, on a shared machine re-measure when quiet.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from eaglenest.speculative.cpu_bench import run_cpu_bench


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", required=True, help="exported EAGLE-3 drafter folder, or 'random'")
    ap.add_argument("--model", default="default")
    ap.add_argument("--prompt-set", default="mt-bench", choices=["mt-bench", "humaneval", "sharegpt"])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3, help="draft steps per cycle k (SGLang num_draft_tokens = k+1)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--policies", default="onednn,no-onednn,prefill-only,prefill+verify")
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()}",
          file=sys.stderr)
    res = run_cpu_bench(model=a.model, draft=a.draft, prompt_set=a.prompt_set, num_prompts=a.num_prompts,
                        max_new_tokens=a.max_new_tokens, num_steps=a.steps, dtype=a.dtype,
                        policies=[p for p in a.policies.split(",") if p],
                        progress=lambda m: print(m, file=sys.stderr, flush=True))
    res.notes.append(f"load average at the end: {os.getloadavg()}")
    print("\n".join(res.lines()))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(res.to_json(), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
