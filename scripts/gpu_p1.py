"""P1 on the GPU machine, order-balanced: prefill tok/s of a capture server / the same server without capture.

    python scripts/gpu_p1.py --model MODEL --order B,C,B,C [--chunk 8192] [--prompts 512 --len 512 --batch 16]
        [--profile] --out DIR [-- extra sglang args]

Servers start one after another in ``--order`` (B = baseline: no plugin; C = capture server), with the
same flags and the same prompts (random token ids, prefill only: max_new_tokens=0), sent as batched
/generate requests from 8 client threads. A baseline runs two rounds; a capture server runs
captured / ``nocapture:`` / captured rounds (the middle one measures the plugin's cost without capture).
Every server first runs a warm-up round. P1 = mean captured tok/s / mean baseline tok/s over all rounds.
``--profile`` samples the main thread of the scheduler and of the HTTP process
(``eaglenest.testing.sglang_profiler``) per round.
Writes DIR/p1.json and the tail of each server's log.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eaglenest.engines import ENV_PROFILE_DIR
from eaglenest.engines.pool import launched, local_server, log_tail, probe_ready
from eaglenest.engines.prefill_load import batched_prefill as bench
from eaglenest.engines.sglang_flags import sglang_flags
from eaglenest.engines.sglang_launcher import (
    build_command,
    capture_ready,
    release_work_dir,
    write_plugin_dist_info,
)
from eaglenest.testing import sglang_profiler

ROLES = ("sched", "http")  # sampled processes: sglang's scheduler, its HTTP process (tokenizer manager)


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_server(kind: str, n: int, a, data, out: Path, report: dict) -> None:
    name = f"{kind}{n}"
    cap = Path(tempfile.mkdtemp(prefix="p1cap-")) if kind == "C" else None
    sglang_args = [*sglang_flags(mem_fraction_static=0.3, chunked_prefill_size=a.chunk, cuda_graph=False,
                                 log_level="info"), *a.sglang_args]
    cmd, env = build_command(model_dir=a.model, capture_dir=cap, port=a.port + n, aux_layer_ids=a.aux,
                             sglang_args=sglang_args)
    profile = out / "profile" / name if a.profile else None
    work = None
    if profile:
        env = {**env, ENV_PROFILE_DIR: str(profile)}
        if cap is None:  # make the (inert) plugin discoverable so the baseline's scheduler is sampled too
            work = Path(tempfile.mkdtemp(prefix="p1site-"))
            write_plugin_dist_info(work)
            env["PYTHONPATH"] = os.pathsep.join([str(work), str(Path(__file__).resolve().parents[1]),
                                                 os.environ.get("PYTHONPATH", "")])
    proc = local_server(cmd, port=a.port + n, env=env, log_path=Path("/tmp/gpu_p1") / f"{name}.log")
    rep = report["servers"].setdefault(name, {"cmd": " ".join(cmd)})
    t0 = time.time()
    try:
        with launched(proc, timeout_s=600, ready=capture_ready if cap else probe_ready):
            _rounds(proc, name, cap, profile, a, data, rep, t0)
    finally:
        release_work_dir(env)
        for d in (cap, work):
            if d:
                shutil.rmtree(d, ignore_errors=True)
        (out / f"{name}.log.tail").write_text(log_tail(proc.log_path, 60))


def _rounds(proc, name: str, cap: Path | None, profile: Path | None, a, data, rep: dict, t0: float) -> None:
    """Warm up, then the measured rounds (capture, nocapture, capture; or two baseline rounds)."""
    rep["startup_s"] = round(time.time() - t0, 1)
    say(f"{name}: ready after {rep['startup_s']} s")
    bench(proc.url, data[: max(a.batch * 8, len(data) // 4)], f"warm-{name}", a.batch)
    tags = ["cap", "nocapture:nocap", "cap"] if cap else ["base", "base"]
    rep["rounds"] = []
    for i, tag in enumerate(tags):
        before = {role: sglang_profiler.snapshot(profile, role) for role in ROLES} if profile else None
        r = bench(proc.url, data, f"{tag}-{name}-{i}", a.batch)
        if profile:
            time.sleep(1.5)  # let the samplers flush
            r["profile"] = {role: sglang_profiler.summarize(before[role], sglang_profiler.snapshot(profile, role),
                                                           top=30) for role in ROLES}
        rep["rounds"].append(r)
        say(f"{name} {tag}: {r['tok_per_s']} tok/s, capture {r['capture_bytes_per_s'] / 1e6:.1f} MB/s")
        if cap:
            for p in cap.glob("*.safetensors"):
                p.unlink()


def main() -> int:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--aux", default=None)
    p.add_argument("--order", default="B,C,B,C")
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--prompts", type=int, default=512)
    p.add_argument("--len", type=int, default=512)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--port", type=int, default=32000)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_p1/out"))
    a = p.parse_args(argv)
    a.sglang_args = extra
    a.model = str(Path(a.model).resolve())
    a.aux = [int(x) for x in a.aux.split(",")] if a.aux else None
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((Path(a.model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(7)
    data = [[rng.randrange(3, vocab) for _ in range(a.len)] for _ in range(a.prompts)]
    report: dict = {"model": a.model, "chunk": a.chunk, "prompts": a.prompts, "len": a.len, "batch": a.batch,
                    "order": a.order, "servers": {}}
    counts: dict[str, int] = {}
    for kind in a.order.split(","):
        counts[kind] = counts.get(kind, 0) + 1
        try:
            run_server(kind, counts[kind], a, data, out, report)
        except Exception as e:
            report.setdefault("errors", []).append(f"{kind}{counts[kind]}: {e!r}")
            say(f"{kind}{counts[kind]} FAILED: {e!r}")
        (out / "p1.json").write_text(json.dumps(report, indent=1))

    def rounds(prefix: str) -> list[float]:
        return [r["tok_per_s"] for s in report["servers"].values() for r in s.get("rounds", [])
                if r["tag"].startswith(prefix)]

    base, cap, nocap = rounds("base"), rounds("cap"), rounds("nocapture:")
    if base and cap:
        report["p1"] = {"baseline_tok_per_s": rounds("base"), "capture_tok_per_s": cap,
                        "nocapture_on_capture_server_tok_per_s": nocap,
                        "ratio_mean": round(statistics.mean(cap) / statistics.mean(base), 4),
                        "nocapture_ratio_mean": round(statistics.mean(nocap) / statistics.mean(base), 4) if nocap
                        else None, "target": 0.97}
    (out / "p1.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report.get("p1"), indent=1))
    return 0 if "p1" in report else 1


if __name__ == "__main__":
    raise SystemExit(main())
