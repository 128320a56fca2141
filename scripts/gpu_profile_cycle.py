"""GPU machine: where a decode step of the baseline and a speculation cycle of EAGLE3 spend their time.

    python scripts/gpu_profile_cycle.py --model MODEL_DIR --draft DRAFTER_DIR --prompts mt-bench.jsonl \
        [--steps 7 --topk 8 --draft-tokens 48] [--requests 2] [--max-new-tokens 256] [--sglang-arg X ...] \
        [--baseline-sglang-arg X ...] [--verify-kernel splitkv]

Each server (the baseline, then EAGLE3; launched as gpu_bench_grid.py launches them) is warmed up, then SGLang's
torch profiler (``/start_profile``, CPU and GPU activities) records ``--requests`` greedy requests at concurrency 1,
one after another, and ``/stop_profile`` writes the trace. eaglenest.speculative.trace sums it: the GPU's busy
share of the span, the idle gaps between kernels, the costliest kernels and host CUDA calls, per decode step
(baseline) or verify cycle (EAGLE3) as the trace's own step ranges count them, and by SGLang's phases. Writes
$OUT/profile.json and each trace (gzip) when it is under 14 MB. A speculation cycle that costs 2-3 baseline steps
while the GPU is busy for a fraction of it is paid on the host, not in kernels (on 2026-12-06g it was not).
--verify-kernel splitkv profiles the EAGLE3 server with eaglenest's tree-verify kernel (as gpu_bench_grid.py serves it):
its kernels' microseconds in the verify phase beside SGLang's _fwd_kernel of another run (2026-12-07e: 1.4-5.3x faster
a call alone, no change served).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import httpx

from eaglenest.engines import VERIFY_KERNELS, verify_kernel_seen
from eaglenest.engines.pool import LaunchError, launched, local_server
from eaglenest.speculative.bench import BenchConfig, eagle3_env, prepare_prompts, server_commands
from eaglenest.speculative.live import warm
from eaglenest.speculative.loadgen import run_levels
from eaglenest.speculative.trace import load_trace, summarize

MAX_TRACE_BYTES = 14 * 2**20


def profile_server(label: str, cmd: list[str], port: int, prompts: list[list[int]], *, requests: int,
                   max_new_tokens: int, out: Path, ready_timeout_s: float, env: dict[str, str] | None = None) -> dict:
    print(f"== {label}: {' '.join(cmd)}", flush=True)
    traces = Path(f"/tmp/profile-{label}-{int(time.time())}")
    traces.mkdir(parents=True)
    server = local_server(cmd, port=port, log_path=out / f"server_{label}.log", env=env)
    with launched(server, timeout_s=ready_timeout_s):
        warm(server, prompts, 3, [1], max_new_tokens=max_new_tokens, ignore_eos=False, timeout_s=600.0)
        plain = run_levels(server.url, prompts, [1], max_new_tokens=max_new_tokens, requests_per_level=requests,
                           tag="unprofiled")[0]
        r = httpx.post(f"{server.url}/start_profile", timeout=60,
                       json={"output_dir": str(traces), "activities": ["CPU", "GPU"], "with_stack": False,
                             "record_shapes": False, "profile_id": label})
        r.raise_for_status()
        lv = run_levels(server.url, prompts, [1], max_new_tokens=max_new_tokens, requests_per_level=requests,
                        tag="profiled")[0]
        httpx.post(f"{server.url}/stop_profile", timeout=300).raise_for_status()
        deadline, sizes = time.monotonic() + 240, None
        found: list[Path] = []
        while True:  # the scheduler writes the trace after stop_profile returns
            time.sleep(3)
            found = sorted(p for p in traces.rglob("*.trace.json*") if p.suffix in (".json", ".gz"))
            now = [p.stat().st_size for p in found]
            if found and all(now) and now == sizes:  # (written, and no longer growing)
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{label}: no finished trace under {traces} 240 s after /stop_profile ({found})")
            sizes = now
    main_trace = next((p for p in found if "TP-0" in p.name), found[0])
    res = {"command": cmd, "requests": requests, "profiled": lv.to_json(), "unprofiled": plain.to_json(),
           "traces": [p.name for p in found]}
    # per verify cycle (EAGLE3) or decode step (baseline), as the trace counts them (SGLang's step ranges)
    res["trace"] = summarize(load_trace(main_trace))
    for p in found:
        if p.stat().st_size <= MAX_TRACE_BYTES:
            shutil.copy(p, out / p.name)
    print(json.dumps({label: res.get("trace", {}).get("per_step_ms"), "ms_per_token_unprofiled":
                      round(1e3 * plain.duration_s / max(plain.output_tokens, 1), 4)}), flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompts", required=True, help="token JSONL from `eaglenest bench prompts`")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--topk", type=int, default=1)
    ap.add_argument("--draft-tokens", type=int, default=None, help="root counted; default steps + 1")
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--sglang-arg", action="append", default=[])
    ap.add_argument("--baseline-sglang-arg", action="append", default=[])
    ap.add_argument("--only", choices=["baseline", "eagle3"], default=None)
    ap.add_argument("--verify-kernel", choices=VERIFY_KERNELS, default="sglang",
                    help="the EAGLE3 server's tree-verify attention: SGLang's own or eaglenest's split-KV kernel")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--ready-timeout", type=float, default=400.0)
    a = ap.parse_args()
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    cfg = BenchConfig(engine="sglang", model=a.model, draft=a.draft, num_steps=a.steps, topk=a.topk,
                      num_draft_tokens=a.draft_tokens, prompt_file=a.prompts, num_prompts=max(a.requests, 3) + 3,
                      max_new_tokens=a.max_new_tokens, concurrencies=[1], sglang_args=a.sglang_arg,
                      baseline_sglang_args=a.baseline_sglang_arg, output_dir=str(out), port=a.port,
                      verify_kernel=a.verify_kernel)
    prompts = prepare_prompts(cfg).token_ids
    report: dict = {"prompts": a.prompts, "spec": {"steps": a.steps, "topk": a.topk, "draft_tokens": a.draft_tokens},
                    "verify_kernel": a.verify_kernel}
    for label, cmd in zip(("baseline", "eagle3"), server_commands(cfg, a.port), strict=True):
        if a.only and label != a.only:
            continue
        try:
            report[label] = profile_server(label, cmd, a.port, prompts, requests=a.requests,
                                           max_new_tokens=a.max_new_tokens, out=out, ready_timeout_s=a.ready_timeout,
                                           env=eagle3_env(cfg) if label == "eagle3" else None)
            if label == "eagle3" and a.verify_kernel != "sglang":  # (what ran, not only what was asked for)
                report[label]["verify_kernel_seen"] = verify_kernel_seen(out / "server_eagle3.log")
                print(f"verify kernel {a.verify_kernel}: {report[label]['verify_kernel_seen'] or 'NOT CONFIRMED'}",
                      flush=True)
        except (LaunchError, RuntimeError, httpx.HTTPError, OSError, EOFError, ValueError) as e:
            print(f"{label}: {e}", flush=True)
            report[label] = {"error": str(e)}
        (out / "profile.json").write_text(json.dumps(report, indent=1))
    b, e = (report.get(k, {}).get("trace", {}).get("per_step_ms") for k in ("baseline", "eagle3"))
    if b and e:  # (a trace without SGLang's step ranges has no per-step figures)
        report["cycle_in_baseline_steps"] = {
            "span": round(e["span"] / b["span"], 3), "gpu_busy": round(e["gpu_busy"] / b["gpu_busy"], 3)}
        print(json.dumps(report["cycle_in_baseline_steps"]), flush=True)
    (out / "profile.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
