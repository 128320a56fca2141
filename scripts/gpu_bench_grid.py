"""GPU machine: the live baseline-vs-EAGLE3 grid with real SGLang, no Prefect. Writes JSON (+ PNGs) to $OUT.

    python scripts/gpu_bench_grid.py --model MODEL_DIR --draft DRAFTER_DIR --prompts A.jsonl[,B.jsonl,...] \
        [--concurrency 1,4,16,64] [--steps 3 | --steps 1,2,3,5,8] [--topk 1 --draft-tokens 4] [--max-new-tokens 256] \
        [--num-prompts 32] [--target-concurrency 1 --min-speedup 1.0] [--only baseline|eagle3] \
        [--baseline-json server_baseline.json] [--no-cuda-graph] [--mem-fraction-static F] [--sglang-arg X ...]

PROMPTS.jsonl comes from this machine's project checkout: ``eaglenest bench prompts --prompt-set mt-bench
--out prompts.jsonl`` (chat-templated token ids; the GPU machine has no network). Each server is
``python -m sglang.launch_server`` (CUDA graphs on unless --no-cuda-graph; triton attention + pytorch
sampling, the kit's verified flags) started in its own process group, proven ready by a real request,
driven at every concurrency on every prompt set with httpx, and stopped: one baseline server, then one EAGLE3
server per --steps value (a depth sweep). Each (prompt set, steps) gets its report under $OUT/<set>/steps<k>/,
and $OUT/matrix.json has one row per (set, steps, concurrency) with the speedup, accept length and the cycle
cost in baseline steps (the break-even accept length). --speculative-num-draft-tokens counts the root
token (chain: steps + 1). Writes $OUT/server_baseline.json and $OUT/server_eagle3.json as each finishes,
then $OUT/report.json, report.md (and PNGs when matplotlib is importable; otherwise run
``eaglenest bench plot report.json`` here). Prints the table and the gate; exits 1 on a launch failure,
0 otherwise (the gate verdict is in the output: the integrator reads numbers, not exit codes).

Recipe for SmolLM2-135M on the H200 (see ../shared/device/sglang-0.5.17/README.md; one command may carry
64 MiB, /tmp survives while the machine stays warm; run these back to back):
  here:  eaglenest bench prompts --prompt-set mt-bench --model default --out .bench/mt-bench.jsonl
         (and export the drafter: eaglenest export RUN .bench/draft --target default; ~23 MB at draft vocab 8K)
  1. carry .device (archive + bin):   source .device/bin/device_setup.sh
  2. carry .device/gguf1:             copy the first GGUF half to /tmp/smol/
  3. carry .device/gguf2 + project:   join the halves, check the sha256, convert with eaglenest.models.convert_gguf
                                      into /tmp/smol/model
  4. carry .bench/draft:              cp -r .bench/draft /tmp/draft
  5. project (+ .bench/mt-bench.jsonl): source .device/bin/device_setup.sh; export PYTHONPATH=/tmp/site:$PWD;
       python3 scripts/gpu_bench_grid.py --model /tmp/smol/model --draft /tmp/draft \
         --prompts .bench/mt-bench.jsonl --only baseline && cp $OUT/server_baseline.json /tmp/
  6. same, --only eagle3 --baseline-json /tmp/server_baseline.json   (writes report.json + report.md)
  here:  eaglenest bench plot <fetched>/report.json    (PNGs, when the GPU image lacks matplotlib)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project root travels with the command

from eaglenest.engines.pool import LaunchError, end_recorded_servers, local_server
from eaglenest.speculative.bench import BenchConfig, Prompts, assemble, prepare_prompts, server_commands
from eaglenest.speculative.live import ServerResult, bench_server_sets
from eaglenest.speculative.report import gate, markdown_table, write_report


def gpu_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompts", required=True,
                    help="token JSONL from `eaglenest bench prompts`; several comma-separated files share each server")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--steps", default="3", help="draft steps; a comma list (e.g. 1,2,3,5,8) is a depth sweep")
    ap.add_argument("--topk", type=int, default=1)
    ap.add_argument("--draft-tokens", type=int, default=None, help="root counted; default steps + 1")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--requests-per-level", type=int, default=None)
    ap.add_argument("--target-concurrency", type=int, default=1)
    ap.add_argument("--min-speedup", type=float, default=1.0)
    ap.add_argument("--only", choices=["baseline", "eagle3"], default=None)
    ap.add_argument("--baseline-json", default=None, help="reuse a measured baseline (server_baseline.json)")
    ap.add_argument("--no-cuda-graph", action="store_true")
    ap.add_argument("--mem-fraction-static", type=float, default=None)
    ap.add_argument("--sglang-arg", action="append", default=[])
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--ready-timeout", type=float, default=400.0)
    a = ap.parse_args()
    out = Path(os.environ.get("OUT", "/tmp/out"))
    steps = [int(x) for x in a.steps.split(",")]
    base = dict(engine="sglang", model=a.model, draft=a.draft, topk=a.topk, num_prompts=a.num_prompts,
                max_new_tokens=a.max_new_tokens, concurrencies=[int(x) for x in a.concurrency.split(",")],
                requests_per_level=a.requests_per_level, target_concurrency=a.target_concurrency,
                min_speedup=a.min_speedup, output_dir=str(out), port=a.port, cuda_graph=not a.no_cuda_graph,
                mem_fraction_static=a.mem_fraction_static, sglang_args=a.sglang_arg, ready_timeout_s=a.ready_timeout)
    files = a.prompts.split(",")
    sets: dict[str, Prompts] = {}
    for f in files:
        p = prepare_prompts(BenchConfig(**base, num_steps=steps[0], prompt_file=f))
        sets[p.name] = p
    print(f"GPU: {gpu_name()}; prompt sets: " + ", ".join(f"{n} x{len(p.token_ids)}" for n, p in sets.items()),
          flush=True)
    token_ids = {n: p.token_ids for n, p in sets.items()}

    def cfg_for(name: str, k: int) -> BenchConfig:
        return BenchConfig(**base, num_steps=k, num_draft_tokens=a.draft_tokens,
                           prompt_file=files[list(sets).index(name)])

    def run(label: str, cmd: list[str]) -> dict[str, ServerResult] | None:
        print(f"== {label}: {' '.join(cmd)}", flush=True)
        server = local_server(cmd, port=a.port, log_path=out / f"server_{label}.log")
        try:
            res = bench_server_sets(
                label.split("@")[0], server, token_ids, base["concurrencies"], max_new_tokens=a.max_new_tokens,
                requests_per_level=a.requests_per_level, ready_timeout_s=a.ready_timeout, timeout_s=600.0,
                pidfile=out / "servers.json",
                progress=lambda n, lv: print(f"{label:10s} c={lv.concurrency:<3d} {lv.output_tok_s:9.1f} tok/s  p50 "
                                             f"{lv.latency_p50_s:.3f}s p99 {lv.latency_p99_s:.3f}s accept "
                                             f"{lv.accept_length}  errors {lv.errors}", flush=True))
        except LaunchError as e:
            print(f"{label} failed to launch: {e}", flush=True)
            return None
        finally:
            end_recorded_servers(out / "servers.json")  # bench_server_sets stopped it; this clears the record
        (out / f"server_{label}.json").write_text(json.dumps({n: r.to_json() for n, r in res.items()}, indent=1))
        first = next(iter(res.values()))
        print(f"{label}: started in {first.startup_s:.0f} s", flush=True)
        return res

    if a.baseline_json:
        baseline = {n: ServerResult.from_json(d) for n, d in json.loads(Path(a.baseline_json).read_text()).items()}
    elif a.only != "eagle3":
        baseline = run("baseline", server_commands(cfg_for(next(iter(sets)), steps[0]), a.port)[0])
        if baseline is None:
            return 1
    else:
        baseline = None
    if a.only == "baseline" or baseline is None:
        return 0
    matrix = []
    for k in steps:
        eagle3 = run(f"eagle3@{k}", server_commands(cfg_for(next(iter(sets)), k), a.port)[1])
        if eagle3 is None:
            return 1
        for name, prompts in sets.items():
            cfg = cfg_for(name, k)
            report = assemble(cfg, prompts, baseline[name], eagle3[name])
            report.notes.append(f"GPU: {gpu_name()}")
            write_report(report, out / name / f"steps{k}")
            print(f"-- {name}, steps {k}\n" + markdown_table(report))
            for c in base["concurrencies"]:
                g = gate(report, target_concurrency=c, min_speedup=a.min_speedup)
                lv = report.level("eagle3", c)
                matrix.append({"prompt_set": name, "steps": k, "draft_tokens": cfg.spec.draft_tokens,
                               "concurrency": c, "speedup": g.speedup, "cycle_cost_steps": g.cycle_cost_steps,
                               "accept_length": lv.accept_length if lv else None,
                               "baseline_tok_s": report.level("baseline", c).output_tok_s,
                               "eagle3_tok_s": lv.output_tok_s if lv else None})
                if c == a.target_concurrency:
                    print(("GATE PASSED: " if g.passed else "GATE FAILED: ") + g.message, flush=True)
    (out / "matrix.json").write_text(json.dumps({"command": sys.argv, "gpu": gpu_name(), "rows": matrix}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
