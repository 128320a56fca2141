"""A/B of two builds of the decode kernels (``skinny.cpp``) on the target's own weights, on the CPU.

    python scripts/bench_kernels_cpu.py [--base REV_OR_FILE] [--rows 1,2,4,8] [--reps 30] [--amx --rounding-may-differ]
    python scripts/bench_kernels_cpu.py --quant [--rows 1,4] [--reps 30]

Builds ``eaglenest/speculative/skinny.cpp`` as it is in the working tree (B) and as it is at ``--base``
(A: a git revision, default HEAD, or a file), then times, alternating A and B, what a forward streams:

- ``target``: every linear of the target (SmolLM2's 30 layers and its LM head) for rows of x, one weight
  after another as a forward reads them (so they come from memory, not the cache);
- ``draft``: a 4x-wide EAGLE-3 drafter's linears in int8 (MLP 6144, draft vocabulary 16000) for one row,
  right after a 1-row target pass (cold, as in a speculation cycle).

Prints medians in ms, GB/s of weights streamed and B/A, and checks that both builds give the same outputs.

``--quant`` times the working tree's build only: each linear of that drafter (q|k|v, o, gate|up, down, fc,
head) in int8 (q8) and in int4 (q4), for rows of x, right after a target pass, q8 and q4 alternating; prints
per linear the medians in ms, GB/s of weights (and scales) streamed and q4/q8.
Load from other processes adds noise: wrap it in ``flock /tmp/bench.lock``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SOURCE = Path("eaglenest/speculative/skinny.cpp")


def _base_source(base: str, tmp: Path) -> Path:
    if Path(base).is_file():
        return Path(base)
    text = subprocess.run(["git", "show", f"{base}:{SOURCE}"], check=True, capture_output=True, text=True).stdout
    out = tmp / "skinny_base.cpp"
    out.write_text(text)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="git revision or file of the A build (default HEAD)")
    ap.add_argument("--model", default="default")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quant", action="store_true", help="q4 against q8 drafter linears (working tree build)")
    ap.add_argument("--amx", action="store_true", help="the working tree's build on AMX (as speculation runs it)")
    ap.add_argument("--rounding-may-differ", action="store_true",
                    help="the builds sum in other orders (e.g. AMX against AVX512): report how many outputs round "
                         "differently instead of stopping")
    a = ap.parse_args()
    if a.quant and a.base != "HEAD":
        ap.error("--quant times the working tree's build only: --base does not apply")
    torch.set_num_threads(a.threads)
    from torch.utils.cpp_extension import load

    from eaglenest.engines.runtime import TargetRunner
    from eaglenest.models import resolve_model
    from eaglenest.speculative.kernels import FLAGS
    from eaglenest.speculative.quant import quantize_rows
    from eaglenest.speculative.target import decode_target

    tmp = Path(tempfile.mkdtemp(prefix="kernels-ab-"))
    builds = {"B": load(name="eaglenest_skinny_b", sources=[str(SOURCE)], extra_cflags=FLAGS)}
    if not a.quant:
        builds["A"] = load(name="eaglenest_skinny_a", sources=[str(_base_source(a.base, tmp))], extra_cflags=FLAGS)
    if a.amx:
        if not builds["B"].amx_available():
            ap.error("--amx: this CPU has no AMX-BF16 (or the kernel refused the tile registers)")
        builds["B"].set_amx(True)
    runner = TargetRunner(resolve_model(a.model), dtype="bfloat16")
    tg = decode_target(runner.model, runner.aux_layer_ids)
    weights = [w for lw in tg.layers for w, _ in (lw.qkv, lw.o, lw.gate_up, lw.down)] + [tg.head[0]]
    h = weights[0].shape[1]
    g = torch.Generator().manual_seed(0)
    shapes = {"qkv": (h + 2 * h // 3, 2 * h), "o": (h, h), "gate_up": (2 * 6144, h), "down": (h, 6144),
              "fc": (h, 3 * h), "head": (16000, h)}  # a 4x-wide drafter's linears, [N, K]
    rows = [int(r) for r in a.rows.split(",")]
    if a.quant:
        dense = {name: torch.randn(n, k, generator=g).to(torch.bfloat16) for name, (n, k) in shapes.items()}
        return _quant_ab(builds["B"], weights, dense, rows, a.reps, runner.model_dir.name)
    draft = [quantize_rows(torch.randn(n, k, generator=g).to(torch.bfloat16)) for n, k in shapes.values()]
    widths = {w.shape[1] for w in weights} | {q.shape[1] for q, _ in draft}
    xs = {(r, k): torch.randn(r, k, generator=g).to(torch.bfloat16) for r in rows for k in widths}
    times: dict[tuple[str, str], list[float]] = {}
    with torch.inference_mode():
        for rep in range(a.reps + 4):
            for name in ("AB" if rep % 2 else "BA"):
                mod = builds[name]
                for r in rows:
                    t = time.perf_counter()
                    for w in weights:
                        mod.skinny_linear(xs[(r, w.shape[1])], w)
                    t1 = time.perf_counter()
                    if r == 1:
                        for q, sc in draft:
                            mod.skinny_linear_i8(xs[(1, q.shape[1])], q, sc)
                    t2 = time.perf_counter()
                    if rep >= 4:
                        times.setdefault((name, f"target x{r}"), []).append(t1 - t)
                        if r == 1:
                            times.setdefault((name, "draft"), []).append(t2 - t1)
        for r in rows:
            for w in (*weights[:4], weights[-1]):
                x = xs[(r, w.shape[1])]
                ya, yb = builds["A"].skinny_linear(x, w), builds["B"].skinny_linear(x, w)
                if torch.equal(ya, yb):
                    continue
                if not a.rounding_may_differ:
                    print(f"outputs differ: rows {r}, weight {tuple(w.shape)}", file=sys.stderr)
                    return 1
                worst = float(((ya.float() - yb.float()).abs() / yb.float().abs().clamp_min(1e-3)).max())
                print(f"rows {r}, weight {tuple(w.shape)}: {float((ya != yb).float().mean()):.4%} of outputs round "
                      f"differently (largest relative difference {worst:.2e})")
    gb = {f"target x{r}": sum(w.numel() * w.element_size() for w in weights) / 1e9 for r in rows}
    gb["draft"] = sum(q.numel() for q, _ in draft) / 1e9
    print(f"{runner.model_dir.name}, {torch.get_num_threads()} threads, A = {a.base}, B = working tree")
    for part in [*(f"target x{r}" for r in rows), "draft"]:
        ta, tb = statistics.median(times[("A", part)]), statistics.median(times[("B", part)])
        print(f"{part:10s} A {1e3 * ta:7.3f} ms ({gb[part] / ta:5.1f} GB/s)  B {1e3 * tb:7.3f} ms "
              f"({gb[part] / tb:5.1f} GB/s)  B/A {tb / ta:.3f}")
    return 0


def _quant_ab(mod, target: list[torch.Tensor], dense: dict[str, torch.Tensor], rows: list[int], reps: int,
              model: str) -> int:
    """Each drafter linear in q8 and q4 after a 1-row target pass (its weights cold), q8 and q4 alternating."""
    from eaglenest.speculative.quant import QuantWeight

    stored = {kind: {name: QuantWeight.of(w, kind) for name, w in dense.items()} for kind in ("q8", "q4")}
    call = {"q8": mod.skinny_linear_i8, "q4": mod.skinny_linear_q4}
    g = torch.Generator().manual_seed(1)
    xs = {(r, w.shape[1]): torch.randn(r, w.shape[1], generator=g).to(torch.bfloat16)
          for r in rows for w in [*dense.values(), *target]}
    times: dict[tuple[str, int, str], list[float]] = {}
    with torch.inference_mode():
        for rep in range(reps + 4):
            for kind in (("q8", "q4") if rep % 2 else ("q4", "q8")):
                for r in rows:
                    for w in target:  # evict the drafter's weights from the caches, as a verify does
                        mod.skinny_linear(xs[(1, w.shape[1])], w)
                    for name, q in stored[kind].items():
                        x = xs[(r, dense[name].shape[1])]
                        t = time.perf_counter()
                        call[kind](x, q.data, q.scale)
                        if rep >= 4:
                            times.setdefault((kind, r, name), []).append(time.perf_counter() - t)
        for name, w in dense.items():  # both agree with their dequantized weights
            for kind, q in ((k, stored[k][name]) for k in stored):
                x = xs[(rows[-1], w.shape[1])]
                ref = x.float() @ q.dequantize(torch.float32).T
                err = float((call[kind](x, q.data, q.scale).float() - ref).abs().max() / ref.abs().max())
                if err > 1e-2:
                    print(f"{kind} {name}: relative error {err:.3g} against its dequantized weight", file=sys.stderr)
                    return 1
    print(f"drafter linears after a {model} pass, {torch.get_num_threads()} threads, medians")
    for r in rows:
        total = {"q8": 0.0, "q4": 0.0}
        for name, (n, k) in ((name, w.shape) for name, w in dense.items()):
            line, t = f"x{r} {name:8s} [{n:5d}, {k:4d}]", {}
            for kind in ("q8", "q4"):
                q = stored[kind][name]
                gb = (q.data.numel() + q.scale.numel() * q.scale.element_size()) / 1e9
                t[kind] = statistics.median(times[(kind, r, name)])
                total[kind] += t[kind]
                line += f"  {kind} {1e3 * t[kind]:6.3f} ms ({gb / t[kind]:5.1f} GB/s)"
            print(f"{line}  q4/q8 {t['q4'] / t['q8']:.3f}")
        print(f"x{r} all linears  q8 {1e3 * total['q8']:6.3f} ms  q4 {1e3 * total['q4']:6.3f} ms  "
              f"q4/q8 {total['q4'] / total['q8']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
