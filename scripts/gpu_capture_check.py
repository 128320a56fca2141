"""GPU proofs for the SGLang capture plugin, for any local HF Llama-family model (run on the GPU machine).

    python scripts/gpu_capture_check.py --model MODEL [--aux 0,1,2] [--draft EAGLE3_DRAFT] --out DIR \
        [--chunk 2048] [--bench-prompts 512 --bench-len 512] [-- extra sglang args]

Phases (each adds to DIR/report.json when it ends; a failed phase is recorded and the rest still run):
- capture:   a capture server (eaglenest launcher + plugin). One batched request of mixed prompt lengths
             (one longer than the chunked-prefill size, so it is coalesced from chunks), one generating
             request and one ``nocapture:`` request. Checks: every captured shard exists WHEN its answer
             arrives (durable before the answer), ids and shapes match, no shard for ``nocapture:``.
             Then the P1 workload (prefill-only, concurrent batches) with captured rids.
- reference: transformers bf16 forward of the same model on the GPU; per layer (aux ids + final norm)
             relative Frobenius error ||shard - ref|| / ||ref||, max |diff|. A layer passes when that error is
             <= --tol (0.02) or when the shard is no further from the fp32 forward than --noise-factor (2) x
             transformers' own bf16-vs-fp32 error (the bf16 noise floor, reported per layer).
- baseline:  the same server settings without the plugin; P1 = prefill tok/s with capture / without.
- eagle3:    (with --draft) an EAGLE3 server with capture and the draft probe: the aux states SGLang's own
             EAGLE3 path feeds the draft, per request, vs the plugin's shard in that server and vs the plain
             capture server's shard.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
import traceback
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eaglenest import contract
from eaglenest.engines.pool import embedded_command, launched, local_server, log_tail, probe_ready
from eaglenest.engines.prefill_load import batched_prefill as prefill_bench
from eaglenest.engines.sglang_flags import sglang_flags
from eaglenest.engines.sglang_launcher import build_command, capture_ready, release_work_dir
from eaglenest.testing.sglang_probe import read_probe

REPORT: dict = {"phases": {}, "errors": []}


def save(out: Path) -> None:
    (out / "report.json").write_text(json.dumps(REPORT, indent=1, default=str))


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def prompts(n: int, length: int | list[int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = length if isinstance(length, list) else [length] * n
    return [[rng.randrange(3, vocab) for _ in range(t)] for t in lengths]


class Server:
    """One sglang server from the eaglenest launcher; logs kept, their tail copied to OUT."""

    def __init__(self, name, args, *, capture_dir, port, extra_env=None, ready_timeout=300):
        self.name, self.args, self.port = name, args, port
        if args.engine == "embedded":  # CPU dry run of this script's logic against the embedded server
            cmd, env = embedded_command(model=args.model, port=port, capture_dir=capture_dir and str(capture_dir),
                                        aux_layer_ids=args.aux, dtype="bfloat16"), {}
        else:
            cmd, env = build_command(model_dir=args.model, capture_dir=capture_dir, port=port,
                                     aux_layer_ids=args.aux, sglang_args=self.sglang_args(name))
        # a capture that never lands must fail the answer fast here (504), not after the 300 s default
        self.env = {**env, **({"EAGLENEST_RECEIPT_TIMEOUT_S": "60"} if capture_dir else {}), **(extra_env or {})}
        self.capture = capture_dir
        self.proc = local_server(cmd, port=port, env=self.env, log_path=Path("/tmp/gpu_check") / f"{name}.log")
        self.ready_timeout = ready_timeout
        REPORT["phases"].setdefault(name, {})["cmd"] = " ".join(cmd)

    def sglang_args(self, name):
        a = self.args
        from eaglenest.speculative.serve import SpecConfig

        base = sglang_flags(mem_fraction_static=0.2, chunked_prefill_size=a.chunk, cuda_graph=False, log_level="info")
        if name == "eagle3":
            base += SpecConfig(num_steps=3, topk=1).sglang_args(a.draft)
        return base + list(a.sglang_args)

    def __enter__(self):
        t0 = time.time()
        ready = (lambda url: capture_ready(url)) if self.capture else probe_ready
        self._launched = launched(self.proc, timeout_s=self.ready_timeout, ready=ready)
        try:
            self._launched.__enter__()
        except Exception:
            self._cleanup()
            raise
        REPORT["phases"][self.name]["startup_s"] = round(time.time() - t0, 1)
        say(f"{self.name}: ready after {time.time() - t0:.0f} s")
        return self

    def __exit__(self, *exc):
        self._launched.__exit__(None, None, None)
        self._cleanup()

    def _cleanup(self):
        release_work_dir(self.env)
        tail = log_tail(self.proc.log_path, 150)
        (OUT / f"{self.name}.log.tail").write_text(tail)

    def generate(self, ids, rids, max_new=0, timeout=150):
        body = {"input_ids": ids, "rid": rids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0}}
        r = httpx.post(f"{self.proc.url}/generate", json=body, timeout=timeout)
        return r.status_code, r.json()


def check_batch(server: Server, ids, rids, max_new=0) -> dict:
    """Send one batch; at answer time every shard must already exist and match its prompt."""
    t0 = time.time()
    status, body = server.generate(ids, rids, max_new)
    answered = time.time() - t0
    present = {rid: (server.capture / contract.shard_filename(rid)).exists() for rid in rids
               if contract.NO_CAPTURE_RID_PREFIX not in rid}
    res = {"status": status, "answer_s": round(answered, 3), "shards_present_at_answer": all(present.values())}
    if status != 200:
        res["body"] = str(body)[:800]
        return res
    answers = body if isinstance(body, list) else [body]
    problems = []
    for rid, prompt, ans in zip(rids, ids, answers, strict=True):
        cap = ans["meta_info"].get("capture")
        if rid.startswith(contract.NO_CAPTURE_RID_PREFIX):
            if cap is not None or (server.capture / contract.shard_filename(rid)).exists():
                problems.append(f"{rid}: captured although nocapture")
            continue
        shard = contract.read_shard(server.capture / cap["shard"])
        if shard.input_ids.tolist() != prompt or cap["num_tokens"] != len(prompt):
            problems.append(f"{rid}: shard ids/length differ from the prompt ({shard.num_tokens} vs {len(prompt)})")
        if shard.provenance.engine != server.args.engine:
            problems.append(f"{rid}: provenance engine {shard.provenance.engine}")
    res["problems"] = problems
    res["ok"] = status == 200 and res["shards_present_at_answer"] and not problems
    return res


def run_bench(server: Server, data, tags) -> list[dict]:
    prefill_bench(server.proc.url, data[: max(16, len(data) // 8)], "warm-" + tags[0], 16)  # warm kernels, writer
    out = []
    for tag in tags:
        out.append(prefill_bench(server.proc.url, data, tag, 16))
        if server.capture:
            for p in server.capture.glob(f"{tag}-*"):
                p.unlink()
    return out


def phase_capture(args, checks, bench_data):
    rep = REPORT["phases"].setdefault("capture", {})
    with Server("capture", args, capture_dir=OUT_CAP, port=args.port) as s:
        rep["model_info_capture"] = httpx.get(f"{s.proc.url}/get_model_info", timeout=30).json().get("capture")
        rids = [f"chk-{i}" for i in range(len(checks))] + ["nocapture:chk"]
        rep["mixed_batch"] = check_batch(s, [*checks, checks[2]], rids)
        say(f"capture: mixed batch {rep['mixed_batch']}")
        rep["generate"] = check_batch(s, [checks[3]], ["gen-0"], max_new=8)
        say(f"capture: generate {rep['generate']}")
        rep["bench"] = run_bench(s, bench_data, ["cap-a", "nocapture:cap-b", "cap-c"])
        say(f"capture: bench {rep['bench']}")
    rep["ok"] = rep["mixed_batch"].get("ok") and rep["generate"].get("ok")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def phase_reference(args, checks):
    from transformers import AutoModelForCausalLM

    rep = REPORT["phases"].setdefault("reference", {})
    device = "cuda" if torch.cuda.is_available() else "cpu"
    models = {dt: AutoModelForCausalLM.from_pretrained(args.model, dtype=dt).to(device).eval()
              for dt in (torch.bfloat16, torch.float32)}
    ids = args.aux
    rows, worst, floor, worst_fp32 = [], {}, {}, {}
    for i, prompt in enumerate(checks):
        shard = contract.read_shard(OUT_CAP / contract.shard_filename(f"chk-{i}"))
        with torch.no_grad():
            x = torch.tensor([prompt], device=device)
            hs = {dt: m(x, output_hidden_states=True).hidden_states for dt, m in models.items()}
        h = shard.final_hidden.shape[1]
        layers = [(f"aux{lid}", shard.aux_hidden[:, k * h:(k + 1) * h], lid + 1) for k, lid in enumerate(ids)]
        layers.append(("final", shard.final_hidden, len(hs[torch.bfloat16]) - 1))
        row = {"prompt_len": len(prompt)}
        for name, got, idx in layers:
            ref = hs[torch.bfloat16][idx][0].cpu()
            ref32 = hs[torch.float32][idx][0].cpu()
            row[name] = {"rel": round(rel(got, ref), 5), "max_abs": round(float((got.float() - ref.float()).abs()
                                                                                .max()), 5),
                         "rel_vs_fp32": round(rel(got, ref32), 5), "hf_bf16_vs_fp32": round(rel(ref, ref32), 5)}
            # within tolerance: as close to transformers' bf16 forward as --tol, or no further from the fp32
            # forward than --noise-factor x transformers' own bf16 error there (the bf16 noise floor)
            bound = args.noise_factor * row[name]["hf_bf16_vs_fp32"]
            row[name]["ok"] = row[name]["rel"] <= args.tol or row[name]["rel_vs_fp32"] <= bound
            worst[name] = max(worst.get(name, 0.0), row[name]["rel"])
            floor[name] = max(floor.get(name, 0.0), row[name]["hf_bf16_vs_fp32"])
            worst_fp32[name] = max(worst_fp32.get(name, 0.0), row[name]["rel_vs_fp32"])
        rows.append(row)
    rep.update(per_prompt=rows, worst_rel=worst, worst_rel_vs_fp32=worst_fp32, noise_floor=floor,
               tolerance=f"rel vs HF bf16 <= {args.tol} or rel vs HF fp32 <= {args.noise_factor} x HF bf16-vs-fp32",
               ok=all(r[n]["ok"] for r in rows for n in r if n != "prompt_len"))
    del models
    if device == "cuda":
        torch.cuda.empty_cache()


def phase_baseline(args, bench_data):
    rep = REPORT["phases"].setdefault("baseline", {})
    with Server("baseline", args, capture_dir=None, port=args.port + 1) as s:
        rep["bench"] = run_bench(s, bench_data, ["base-a", "base-b"])
    cap = [b for b in REPORT["phases"]["capture"].get("bench", []) if not b["tag"].startswith("nocapture")]
    nocap = [b for b in REPORT["phases"]["capture"].get("bench", []) if b["tag"].startswith("nocapture")]
    best = max(b["tok_per_s"] for b in rep["bench"])
    if cap:
        best_cap = max(b["tok_per_s"] for b in cap)
        REPORT["p1"] = {
            "capture_tok_per_s": best_cap, "baseline_tok_per_s": best, "ratio": round(best_cap / best, 4),
            "nocapture_rids_on_capture_server_tok_per_s": max((b["tok_per_s"] for b in nocap), default=None),
            "capture_bytes_per_s": max(b["capture_bytes_per_s"] for b in cap), "target": 0.97,
            "how": "best of 2 rounds each; same prompts, same sglang flags, prefill-only (max_new_tokens=0)"}


def phase_eagle3(args, checks):
    rep = REPORT["phases"].setdefault("eagle3", {})
    probe = Path("/tmp/gpu_check/probe")
    shutil.rmtree(probe, ignore_errors=True)
    cap = Path("/tmp/gpu_check/capture_eagle3")
    with Server("eagle3", args, capture_dir=cap, port=args.port + 2,
                extra_env={"EAGLENEST_PROBE_DRAFT_DIR": str(probe)}) as s:
        rids = [f"chk-{i}" for i in range(len(checks))]
        status, _body = s.generate(checks, rids, max_new=2)
        rep["status"] = status
    rows, fed_all = [], read_probe(probe)
    for i, rid in enumerate(rids):
        if rid not in fed_all:
            rows.append({"rid": rid, "error": "no probe rows"})
            continue
        chunks, fed = fed_all[rid]
        own = contract.read_shard(cap / contract.shard_filename(rid)).aux_hidden
        plain = contract.read_shard(OUT_CAP / contract.shard_filename(rid)).aux_hidden
        rows.append({"rid": rid, "prompt_len": len(checks[i]), "chunks": chunks,
                     "rows_fed": int(fed.shape[0]), "equal_same_server": bool(torch.equal(fed, own)),
                     "max_abs_same_server": float((fed.float() - own.float()).abs().max()),
                     "equal_plain_server": bool(torch.equal(fed, plain)),
                     "max_abs_plain_server": float((fed.float() - plain.float()).abs().max()),
                     "rel_plain_server": round(rel(fed, plain), 6)})
    rep["per_prompt"] = rows
    rep["ok"] = status == 200 and all(r.get("equal_same_server") and r["rows_fed"] == r["prompt_len"] for r in rows)


def main() -> int:
    global OUT, OUT_CAP
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--aux", default=None, help="aux layer ids, e.g. 0,1,2 (default: contract default)")
    p.add_argument("--draft", default=None, help="EAGLE3 draft folder (its aux ids must equal --aux)")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_check/out"))
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--bench-prompts", type=int, default=512)
    p.add_argument("--bench-len", type=int, default=512)
    p.add_argument("--tol", type=float, default=0.02)
    p.add_argument("--noise-factor", type=float, default=2.0)
    p.add_argument("--port", type=int, default=31000)
    p.add_argument("--phases", default="capture,reference,baseline,eagle3")
    p.add_argument("--deadline-s", type=float, default=0, help="skip phases that would not finish in time")
    p.add_argument("--keep-going", action="store_true", help="run later phases even if capture failed")
    p.add_argument("--engine", choices=("sglang", "embedded"), default="sglang",
                   help="embedded: dry-run this script on the CPU against the embedded server")
    args = p.parse_args(argv)
    args.sglang_args = extra
    args.model = str(Path(args.model).resolve())
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    layers, vocab = cfg["num_hidden_layers"], cfg["vocab_size"]
    args.aux = [int(x) for x in args.aux.split(",")] if args.aux else list(contract.default_aux_layer_ids(layers))
    OUT = Path(args.out)
    OUT.mkdir(parents=True, exist_ok=True)
    OUT_CAP = Path("/tmp/gpu_check/capture")
    shutil.rmtree(OUT_CAP, ignore_errors=True)
    c = args.chunk
    lengths = [1, 5, 31, 200, c - 1, c, c + 300, min(2 * c + 5, cfg.get("max_position_embeddings", 4096) - 8)]
    checks = prompts(0, lengths, vocab, seed=1)
    bench_data = prompts(args.bench_prompts, args.bench_len, vocab, seed=2)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    REPORT.update(model=args.model, aux=args.aux, chunk=c, lengths=lengths, gpu=gpu,
                  bench={"prompts": args.bench_prompts, "len": args.bench_len, "batch": 16, "threads": 8})
    phases = {"capture": lambda: phase_capture(args, checks, bench_data),
              "reference": lambda: phase_reference(args, checks),
              "baseline": lambda: phase_baseline(args, bench_data),
              "eagle3": lambda: phase_eagle3(args, checks) if args.draft else None}
    started, need = time.time(), {"capture": 200, "reference": 30, "baseline": 110, "eagle3": 140}
    for name in args.phases.split(","):
        t0 = time.time()
        if args.deadline_s and t0 - started + need.get(name, 60) > args.deadline_s:
            REPORT["phases"].setdefault(name, {})["skipped"] = "not enough time left before --deadline-s"
            print(f"== {name}: skipped (deadline)", flush=True)
            continue
        try:
            phases[name]()
        except Exception as e:
            REPORT["errors"].append({"phase": name, "error": repr(e), "trace": traceback.format_exc()[-3000:]})
        REPORT["phases"].setdefault(name, {})["phase_s"] = round(time.time() - t0, 1)
        save(OUT)
        print(f"== {name}: {time.time() - t0:.1f} s, ok={REPORT['phases'][name].get('ok')}", flush=True)
        if name == "capture" and REPORT["errors"] and not args.keep_going:
            print("capture phase failed: stopping (use --keep-going to run the rest)", flush=True)
            break
    REPORT["ok"] = not REPORT["errors"] and all(v.get("ok", True) for v in REPORT["phases"].values())
    save(OUT)
    print(json.dumps({k: REPORT.get(k) for k in ("ok", "p1")} | {"errors": [e["error"] for e in REPORT["errors"]]},
                     indent=1))
    return 0 if REPORT["ok"] else 1


OUT = OUT_CAP = Path(".")
if __name__ == "__main__":
    raise SystemExit(main())
