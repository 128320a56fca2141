"""eaglenest's split-KV tree-verify kernel against SGLang's own (extend_attention_fwd) on one GPU.

For each shape (the served target's heads by default: SmolLM2-135M, 9 query and 3 KV heads of 64; a 7x8x48 tree's
48 draft tokens) and prefix length: the largest difference from SGLang's output and from float64 attention, and the
time per call of each kernel in alternating rounds (CUDA graphs, as the server runs them). Prints a table and the
ratio; writes $OUT/verify-kernel.json. Exits 1 when the kernel disagrees with float64 attention more than SGLang's
own kernel does (by more than bf16's rounding).

    python scripts/gpu_verify_kernel.py [--prefixes 100,300,1000] [--batch 1,16] [--draft-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project root travels with the command

from eaglenest.engines.sglang_tree_verify import DEFAULT_SPLITS, tree_verify_fwd
from eaglenest.testing.verify_cases import reference, verify_case


def graph_time_us(fn, *, iters: int = 50, rounds: int = 5) -> list[float]:
    """Microseconds per call of ``fn`` replayed from one CUDA graph of ``iters`` calls, one value per round."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # compile and warm outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    out = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end) * 1000 / iters)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefixes", default="100,300,1000")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--draft-tokens", type=int, default=48, help="verified per sequence, root counted")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--splits", type=int, default=DEFAULT_SPLITS)
    a = ap.parse_args()
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    scale = a.head_dim ** -0.5
    rows, worst = [], 0.0
    for bs in (int(x) for x in a.batch.split(",")):
        for prefix in (int(x) for x in a.prefixes.split(",")):
            case = verify_case([prefix] * bs, a.draft_tokens, heads=a.heads, kv_heads=a.kv_heads, d=a.head_dim,
                               dtype=torch.bfloat16, device="cuda", seed=prefix + bs)
            # as SGLang's CUDA-graph buffers hold them (the path a served c=1 verify takes)
            case.qo_indptr, case.mask_indptr = case.qo_indptr.long(), case.mask_indptr.long()
            case.custom_mask = case.custom_mask.to(torch.uint8)
            ours, theirs = torch.zeros_like(case.q), torch.zeros_like(case.q)

            def run_ours(o=ours, c=case):
                tree_verify_fwd(*c.args(o), 1.0, 1.0, scale, splits=a.splits)

            def run_theirs(o=theirs, c=case):
                extend_attention_fwd(*c.args(o), 1.0, 1.0, scale)

            run_ours()
            run_theirs()
            torch.cuda.synchronize()
            want = reference(case, scale)
            err_ours = (ours.double().cpu() - want).abs().max().item()
            err_theirs = (theirs.double().cpu() - want).abs().max().item()
            t_ours, t_theirs = [], []
            for _ in range(3):  # alternating: the GPU's clocks drift alike for both
                t_theirs += graph_time_us(run_theirs)
                t_ours += graph_time_us(run_ours)
            row = {"batch": bs, "prefix": prefix, "draft_tokens": a.draft_tokens, "max_err_vs_float64": err_ours,
                   "sglang_max_err_vs_float64": err_theirs,
                   "max_diff_vs_sglang": (ours.double() - theirs.double()).abs().max().item(),
                   "us_per_call": statistics.median(t_ours), "sglang_us_per_call": statistics.median(t_theirs)}
            row["speedup"] = row["sglang_us_per_call"] / row["us_per_call"]
            rows.append(row)
            worst = max(worst, err_ours - err_theirs)
            print(f"bs {bs:3d} prefix {prefix:5d}: ours {row['us_per_call']:7.1f} us, sglang "
                  f"{row['sglang_us_per_call']:7.1f} us ({row['speedup']:.2f}x); max error vs float64 "
                  f"{err_ours:.4f} (sglang {err_theirs:.4f}), vs sglang {row['max_diff_vs_sglang']:.4f}", flush=True)
    gpu = torch.cuda.get_device_name()
    result = {"gpu": gpu, "command": sys.argv, "splits": a.splits, "heads": a.heads, "kv_heads": a.kv_heads,
              "head_dim": a.head_dim, "rows": rows}
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "verify-kernel.json").write_text(json.dumps(result, indent=1))
    ok = worst <= 2 ** -7  # bf16 keeps 8 significant bits
    print(("OK" if ok else "FAILED") + f": worst excess error over SGLang's kernel {worst:.4f} (bound {2 ** -7:.4f})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
