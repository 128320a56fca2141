"""GPU machine: the live baseline-vs-EAGLE3 grid with real SGLang, no Prefect. Writes JSON (+ PNGs) to $OUT.

    python scripts/gpu_bench_grid.py --model MODEL_DIR --draft DRAFTER_DIR --prompts A.jsonl[,B.jsonl,...] \
        [--concurrency 1,4,16,64] [--steps 3 | --steps 1,2,3,5,8] [--topk 1 --draft-tokens 4] [--max-new-tokens 256] \
        [--num-prompts 32] [--target-concurrency 1 --min-speedup 1.0] [--only baseline|eagle3] \
        [--baseline-json server_baseline.json] [--no-cuda-graph] [--mem-fraction-static F] [--sglang-arg X ...] \
        [--baseline-sglang-arg X ...] [--rounds R] [--verify-kernel sglang|splitkv[,...]] [--shapes 6x8x49,7x8x48]

PROMPTS.jsonl comes from this machine's project checkout: ``eaglenest bench prompts --prompt-set mt-bench
--out prompts.jsonl`` (chat-templated token ids; the GPU machine has no network). Each server is
``python -m sglang.launch_server`` (CUDA graphs on unless --no-cuda-graph; triton attention + pytorch
sampling, the kit's verified flags) started in its own process group, proven ready by a real request,
driven at every concurrency on every prompt set with httpx, and stopped: one baseline server, then one EAGLE3
server per --steps value (a depth sweep); with --rounds R > 1, the baseline and each EAGLE3 server are up
together (the GPU's memory shared as the extraction shares it) and every level runs in R alternating rounds,
whose per-round speedups go into matrix.json (speedup_rounds, speedup_median). With --rounds, --draft A,B and
--verify-kernel sglang,splitkv put one EAGLE3 server per drafter and kernel up beside the one baseline, all in the
same rounds (so does --shapes SxKxN,...: one server per tree): each gets its report (<set>/steps<k>/<k>-<drafter>
[-<kernel>], or <set>/shapes/<SxKxN>[...]) and matrix rows (``variant``, ``draft``, ``verify_kernel``), and
matrix.json's side_by_side compares each with the first round by round (a machine's drift between two calls hides
a few percent).
Each (prompt set, steps) gets its report under $OUT/<set>/steps<k>/,
and $OUT/matrix.json has one row per (set, steps, concurrency) with the speedup, accept length and the cycle
cost in baseline steps (the break-even accept length). --speculative-num-draft-tokens counts the root
token (chain: steps + 1). Every measured level is appended to $OUT/levels.jsonl as it finishes (a call cut
by its time limit keeps them); $OUT/server_baseline.json and $OUT/server_eagle3.json are written as each server
finishes, matrix.json after each depth, then $OUT/report.json, report.md (and PNGs when matplotlib is
importable; otherwise run ``eaglenest bench plot report.json`` here). Prints the table and the gate; exits 1 on a
launch failure, 0 otherwise (the gate verdict is in the output: the integrator reads numbers, not exit codes).

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
import statistics
import subprocess
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project root travels with the command

from eaglenest.engines import VERIFY_KERNEL_CALLED, VERIFY_KERNELS, verify_kernel_seen
from eaglenest.engines.pool import LaunchError, end_recorded_servers, local_server
from eaglenest.speculative.baseline import baseline_provenance, reusable_baseline
from eaglenest.speculative.bench import (
    BenchConfig,
    Prompts,
    assemble,
    eagle3_env,
    prepare_prompts,
    server_commands,
)
from eaglenest.speculative.live import ServerResult, bench_server_sets, bench_servers_together
from eaglenest.speculative.loadgen import BenchError
from eaglenest.speculative.report import gate, markdown_table, write_report


def gpu_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def per_round(name: str, ratios: list[float]) -> dict:
    """matrix.json's ``NAME_rounds`` (each alternating round's ratio, in the order they ran) and ``NAME_median``."""
    return {f"{name}_rounds": [round(r, 3) for r in ratios], f"{name}_median": round(statistics.median(ratios), 3)}


def round_columns(report, c: int) -> dict:
    """matrix.json's columns for each alternating round's speedup at concurrency c, when there were rounds
    (BenchReport.round_speedups)."""
    ratios = report.round_speedups().get(c)
    return per_round("speedup", ratios) if ratios else {}


def side_by_side(eagles: dict[str, ServerResult], *, prompt_set: str, steps: dict[str, int]) -> list[dict]:
    """matrix.json's side_by_side rows: each EAGLE3 server after the first against the first, by concurrency, as
    the ratio of their tok/s in each alternating round they shared (the same prompts, back to back: the machine's
    drift cancels, as it does not between two calls) and its median, with both accept lengths and both depths
    (``steps``: each server's, by label; the trees of one --shapes group differ in it)."""
    (first, ref), *rest = eagles.items()
    rows = []
    for label, res in rest:
        for c, ratios in sorted(res.round_ratios(ref).items()):
            accept = [round(lv.accept_length, 3) if lv and lv.accept_length else None
                      for lv in (res.level(c), ref.level(c))]
            rows.append({"prompt_set": prompt_set, "steps": steps[label], "versus_steps": steps[first],
                         "concurrency": c, "variant": label, "versus": first, **per_round("ratio", ratios),
                         "accept_length": accept[0], "versus_accept_length": accept[1]})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True,
                    help="exported drafter; a comma list (with --rounds > 1) runs one EAGLE3 server per drafter, all "
                         "up together in the same alternating rounds (a side-by-side comparison)")
    ap.add_argument("--prompts", required=True,
                    help="token JSONL from `eaglenest bench prompts`; several comma-separated files share each server")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--steps", default="3", help="draft steps; a comma list (e.g. 1,2,3,5,8) is a depth sweep")
    ap.add_argument("--topk", type=int, default=1)
    ap.add_argument("--draft-tokens", type=int, default=None, help="root counted; default steps + 1")
    ap.add_argument("--shapes", default=None,
                    help="STEPSxTOPKxDRAFT_TOKENS,... (e.g. 6x8x49,7x8x48; draft tokens root counted) in place of "
                         "--steps/--topk/--draft-tokens: one EAGLE3 server per shape, side by side (with --rounds)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--requests-per-level", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=1,
                    help="> 1: the baseline and each EAGLE3 server up together (sharing the GPU's memory), every "
                         "level in this many alternating rounds over slices of the prompts (the machine's drift then "
                         "weighs on both sides alike)")
    ap.add_argument("--target-concurrency", type=int, default=1)
    ap.add_argument("--min-speedup", type=float, default=1.0)
    ap.add_argument("--only", choices=["baseline", "eagle3"], default=None)
    ap.add_argument("--baseline-json", default=None,
                    help="reuse a measured baseline (server_baseline.json) when it covers this run's prompt sets and "
                         "concurrencies and ran alone; otherwise one is measured (with --only eagle3: an error)")
    ap.add_argument("--no-cuda-graph", action="store_true")
    ap.add_argument("--mem-fraction-static", type=float, default=None)
    ap.add_argument("--sglang-arg", action="append", default=[])
    ap.add_argument("--baseline-sglang-arg", action="append", default=[],
                    help="the baseline server's own, after the shared ones (e.g. its fastest --attention-backend)")
    ap.add_argument("--verify-kernel", default="sglang",
                    help=f"the EAGLE3 server's tree-verify attention ({', '.join(VERIFY_KERNELS)}): SGLang's own or "
                         "eaglenest's split-KV kernel; a comma list (with --rounds > 1) as for --draft")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--ready-timeout", type=float, default=400.0)
    a = ap.parse_args()
    drafts, kernels = a.draft.split(","), a.verify_kernel.split(",")
    if bad := [x for x in kernels if x not in VERIFY_KERNELS]:
        ap.error(f"--verify-kernel {','.join(bad)}: not one of {', '.join(VERIFY_KERNELS)}")
    if len(set(kernels)) < len(kernels):
        ap.error(f"--verify-kernel {a.verify_kernel}: a kernel named twice")
    # (before any server starts: a launch costs a minute or more)
    if missing := [d for d in drafts if not d or not Path(d).is_dir()]:
        ap.error(f"--draft {a.draft}: no drafter folder at {', '.join(repr(d) for d in missing)}")
    if len({Path(d).name for d in drafts}) < len(drafts):
        ap.error(f"--draft {a.draft}: two drafters share a folder name (the label of their server)")
    try:
        shapes = [tuple(int(x) for x in sh.split("x")) for sh in a.shapes.split(",")] if a.shapes else []
    except ValueError:
        shapes = [()]
    if any(len(sh) != 3 for sh in shapes):
        ap.error(f"--shapes {a.shapes}: each shape is STEPSxTOPKxDRAFT_TOKENS, e.g. 7x8x48")
    if shapes and (a.steps != "3" or a.topk != 1 or a.draft_tokens is not None):
        ap.error("--shapes names each server's steps, topk and draft tokens: no --steps, --topk or --draft-tokens")
    if (len(drafts) > 1 or len(kernels) > 1 or len(shapes) > 1) and a.rounds < 2:
        ap.error("several drafters, verify kernels or shapes are compared side by side: --rounds 2 or more (their "
                 "servers up together, in the same alternating rounds)")
    if a.rounds > 1 and (a.only or a.baseline_json or a.requests_per_level):
        ap.error("--rounds measures both servers together: no --only, --baseline-json or --requests-per-level")
    if a.only == "eagle3" and not a.baseline_json:
        ap.error("--only eagle3 needs --baseline-json (the baseline it is compared with)")
    out = Path(os.environ.get("OUT", "/tmp/out"))
    # the servers up together: one group per --steps value (a depth sweep), or all --shapes in one
    groups = [shapes] if shapes else [[(int(k), a.topk, a.draft_tokens)] for k in a.steps.split(",")]
    base = dict(engine="sglang", model=a.model, draft=drafts[0], topk=a.topk, num_prompts=a.num_prompts,
                max_new_tokens=a.max_new_tokens, concurrencies=[int(x) for x in a.concurrency.split(",")],
                requests_per_level=a.requests_per_level, target_concurrency=a.target_concurrency,
                min_speedup=a.min_speedup, output_dir=str(out), port=a.port, cuda_graph=not a.no_cuda_graph,
                mem_fraction_static=a.mem_fraction_static, sglang_args=a.sglang_arg,
                baseline_sglang_args=a.baseline_sglang_arg, ready_timeout_s=a.ready_timeout,
                verify_kernel=kernels[0])
    files = a.prompts.split(",")
    sets: dict[str, Prompts] = {}
    for f in files:
        p = prepare_prompts(BenchConfig(**base, num_steps=groups[0][0][0], prompt_file=f))
        sets[p.name] = p
    print(f"GPU: {gpu_name()}; prompt sets: " + ", ".join(f"{n} x{len(p.token_ids)}" for n, p in sets.items()),
          flush=True)
    token_ids = {n: p.token_ids for n, p in sets.items()}
    fewest = min(len(t) for t in token_ids.values())
    if a.rounds > fewest:
        ap.error(f"--rounds {a.rounds}: a prompt set has only {fewest} prompts (each round needs one)")

    def cfg_for(name: str, shape: tuple, draft: str | None = None, kernel: str | None = None) -> BenchConfig:
        k, topk, draft_tokens = shape
        return BenchConfig(**{**base, "draft": drafts[0] if draft is None else draft, "topk": topk,
                              "verify_kernel": kernels[0] if kernel is None else kernel},
                           num_steps=k, num_draft_tokens=draft_tokens, prompt_file=files[list(sets).index(name)],
                           rounds=a.rounds)

    def variants(group: list[tuple]) -> dict[str, BenchConfig]:
        """A group's EAGLE3 servers by label: one per shape, drafter and verify kernel (named by what differs)."""
        out = {}
        for shape in group:
            at = f"{shape[0]}" if len(group) == 1 else "x".join(str(x) for x in shape)
            for d in drafts:
                for kern in kernels:
                    name = "".join([f"-{Path(d).name}" if len(drafts) > 1 else "",
                                    f"-{kern}" if len(kernels) > 1 else ""])
                    out[f"eagle3@{at}{name}"] = cfg_for(next(iter(sets)), shape, d, kern)
        return out

    def confirm_verify_kernel(log_path: Path, kernel: str) -> None:
        """Say whether the EAGLE3 server's log shows eaglenest's verify kernel running (asked for: --verify-kernel)."""
        if kernel == "sglang":
            return
        seen = verify_kernel_seen(log_path) or (f"NOT CONFIRMED (no '{VERIFY_KERNEL_CALLED}' in {log_path.name}): "
                                                "these EAGLE3 numbers may be SGLang's kernel's")
        print(f"verify kernel {kernel} ({log_path.name}): {seen}", flush=True)

    def show(label: str, name: str, lv) -> None:
        print(f"{label:10s} {name} c={lv.concurrency:<3d} {lv.output_tok_s:9.1f} tok/s  p50 {lv.latency_p50_s:.3f}s "
              f"p99 {lv.latency_p99_s:.3f}s accept {lv.accept_length}  errors {lv.errors}", flush=True)
        # every level as it finishes: a call cut by its time limit keeps what it measured (the reports and
        # matrix.json are written only once a server has run every set and level)
        with (out / "levels.jsonl").open("a") as f:
            f.write(json.dumps({"server": label, "prompt_set": name, **lv.to_json()}) + "\n")

    def together(eagles: dict[str, BenchConfig]
                 ) -> tuple[dict[str, ServerResult], dict[str, dict[str, ServerResult]]] | None:
        """Baseline and every EAGLE3 variant of a group (label -> config) up at once on the GPU (each its share of
        the memory), in alternating rounds. Returns the baseline's results and each variant's (label -> prompt set ->
        result)."""
        first = next(iter(eagles.values()))
        ports = [a.port + i for i in range(1 + len(eagles))]
        cmds = server_commands(first, *ports, variants=list(eagles.values()))  # each its share of the GPU's memory
        labels = ["baseline", *eagles]
        for label, cmd in zip(labels, cmds, strict=True):
            print(f"== {label} (together, {a.rounds} rounds): {' '.join(cmd)}", flush=True)
        envs = [{}, *(eagle3_env(v) for v in eagles.values())]
        servers = {lab: local_server(cmd, port=port, log_path=out / f"server_{lab}.log", env=env)
                   for lab, cmd, port, env in zip(labels, cmds, ports, envs, strict=True)}
        try:
            res = bench_servers_together(
                servers, token_ids, base["concurrencies"], rounds=a.rounds, max_new_tokens=a.max_new_tokens,
                ready_timeout_s=a.ready_timeout, timeout_s=600.0, pidfile=out / "servers.json",
                progress=show)
        except (LaunchError, BenchError, httpx.HTTPError) as e:  # (levels.jsonl keeps each level measured before)
            print(f"together ({', '.join(eagles)}) failed: {type(e).__name__}: {e}", flush=True)
            return None
        finally:
            end_recorded_servers(out / "servers.json")
        for lab, v in eagles.items():
            confirm_verify_kernel(out / f"server_{lab}.log", v.verify_kernel)
        for lab in labels:
            (out / f"server_{lab}.json").write_text(json.dumps({n: r.to_json() for n, r in res[lab].items()},
                                                               indent=1))
        return res["baseline"], {lab: res[lab] for lab in eagles}

    def run(label: str, cmd: list[str], env: dict[str, str] | None = None) -> dict[str, ServerResult] | None:
        print(f"== {label}: {' '.join(cmd)}", flush=True)
        server = local_server(cmd, port=a.port, log_path=out / f"server_{label}.log", env=env)
        try:
            res = bench_server_sets(
                label.split("@")[0], server, token_ids, base["concurrencies"], max_new_tokens=a.max_new_tokens,
                requests_per_level=a.requests_per_level, ready_timeout_s=a.ready_timeout, timeout_s=600.0,
                pidfile=out / "servers.json", progress=lambda name, lv: show(label, name, lv))
        except LaunchError as e:
            print(f"{label} failed to launch: {e}", flush=True)
            return None
        finally:
            end_recorded_servers(out / "servers.json")  # bench_server_sets stopped it; this clears the record
        if env:
            confirm_verify_kernel(out / f"server_{label}.log", kernels[0])
        (out / f"server_{label}.json").write_text(json.dumps({n: r.to_json() for n, r in res.items()}, indent=1))
        first = next(iter(res.values()))
        print(f"{label}: started in {first.startup_s:.0f} s", flush=True)
        return res

    baseline = None
    baseline_cmd = server_commands(cfg_for(next(iter(sets)), groups[0][0]), a.port)[0]  # (rounds: `together`'s own)
    if a.baseline_json and a.rounds == 1:
        baseline, why = reusable_baseline(a.baseline_json, {n: len(p.token_ids) for n, p in sets.items()},
                                          base["concurrencies"], a.requests_per_level, cmd=baseline_cmd)
        if baseline is None:
            if a.only == "eagle3":
                ap.error(why)
            print(f"{why}; measuring one instead", flush=True)  # a reused baseline only saves a launch
    how = baseline_provenance(a.rounds, a.baseline_json if baseline is not None else None,
                              own_flags=a.baseline_sglang_arg)
    if a.rounds == 1 and baseline is None:  # (--only eagle3 always has one here)
        baseline = run("baseline", baseline_cmd)
        if baseline is None:
            return 1
    if a.only == "baseline":
        return 0
    matrix = []
    comparisons = []
    for group in groups:
        kinds = variants(group)
        if a.rounds > 1:
            got = together(kinds)
            if got is None:
                return 1
            baseline, eagles = got
        else:
            (label, cfg), = kinds.items()
            eagle3 = run(label, server_commands(cfg, a.port)[1], eagle3_env(cfg))
            if eagle3 is None:
                return 1
            eagles = {label: eagle3}
        k = group[0][0] if len(group) == 1 else None  # (a group of shapes has no one depth)
        for name, prompts in sets.items():
            for label, eagle3 in eagles.items():
                v = kinds[label]
                cfg = cfg_for(name, (v.num_steps, v.topk, v.num_draft_tokens), v.draft, v.verify_kernel)
                report = assemble(cfg, prompts, baseline[name], eagle3[name])
                report.notes.append(f"GPU: {gpu_name()}; baseline {how}")
                where = out / name / (f"steps{k}" if k is not None else "shapes")
                write_report(report, where if len(eagles) == 1 else where / label.split("@", 1)[1])
                print(f"-- {name}, {label}\n" + markdown_table(report))
                for c in base["concurrencies"]:
                    g = gate(report, target_concurrency=c, min_speedup=a.min_speedup)
                    lv = report.level("eagle3", c)
                    matrix.append({"prompt_set": name, "steps": v.num_steps, "topk": cfg.spec.topk,
                                   "draft_tokens": cfg.spec.draft_tokens, "concurrency": c, "variant": label,
                                   "draft": v.draft, "verify_kernel": v.verify_kernel, "speedup": g.speedup,
                                   "cycle_cost_steps": g.cycle_cost_steps,
                                   "accept_length": lv.accept_length if lv else None,
                                   "baseline_tok_s": report.level("baseline", c).output_tok_s,
                                   "eagle3_tok_s": lv.output_tok_s if lv else None, "baseline_measured": how,
                                   **round_columns(report, c)})
                    if c == a.target_concurrency:
                        print(f"{label}: " + ("GATE PASSED: " if g.passed else "GATE FAILED: ") + g.message,
                              flush=True)
            now = side_by_side({lab: r[name] for lab, r in eagles.items()}, prompt_set=name,
                               steps={lab: kinds[lab].num_steps for lab in eagles})
            comparisons += now
            for row in now:
                print(f"side by side, {row['prompt_set']} c={row['concurrency']}: {row['variant']} / "
                      f"{row['versus']} tok/s per round {row['ratio_rounds']}, median {row['ratio_median']}; accept "
                      f"length {row['accept_length']} vs {row['versus_accept_length']}", flush=True)
        # after each group (depth), so a call cut during the next one keeps the rows of this one
        (out / "matrix.json").write_text(json.dumps({"command": sys.argv, "gpu": gpu_name(), "rows": matrix,
                                                     **({"side_by_side": comparisons} if comparisons else {})},
                                                    indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
