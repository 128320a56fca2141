"""The real run: prompts -> SGLang capture -> validated shards -> store -> GPU training -> export.

Runs on the GPU machine with only what the device recipe brings plus this project (no Prefect: the library
never imports it). Phases run in the order given and add to WORK/report.json, so the run can span several
device commands while the machine stays warm (WORK under /tmp survives between them):

    python3 scripts/gpu_run.py --phases model,capture,reference --gguf-parts A B --prompts P.jsonl.xz
    python3 scripts/gpu_run.py --phases store,train,export
    python3 scripts/gpu_bench_grid.py --model /tmp/run/model --draft /tmp/run/export ...   (the live grid)

- model:     join the GGUF parts, check its sha256, convert with eaglenest's own converter.
- capture:   the same extraction code the flow uses (``run_extraction``) against an SGLang server launched
             with the capture plugin; then P1 (prefill tok/s with capture / without: the same client, the same
             samples, the same server flags, a plain server for "without") and P2 (end-to-end extraction
             tok/s / raw prefill tok/s).
- reference: per-layer comparison of captured shards with a transformers bf16 forward on the GPU.
- store:     ledger -> Arrow-indexed store.   train: EAGLE-3 drafter on the GPU.   export: SGLang folder,
             packed into <= 15 MB parts under OUT (bring it back; keep it out of git).
The live baseline-vs-EAGLE3 grid is scripts/gpu_bench_grid.py (eaglenest.speculative), run after these.

``--engine embedded`` dry-runs every phase on the CPU with the embedded server (tiny sizes).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eaglenest import contract  # noqa: E402
from eaglenest.engines.pool import (  # noqa: E402
    ServerProcess,
    embedded_command,
    launched,
    local_server,
    log_tail,
    probe_ready,
)
from eaglenest.engines.sglang_flags import sglang_flags  # noqa: E402
from eaglenest.models import GGUF_SHA256, convert_gguf  # noqa: E402

SGLANG_ARGS = sglang_flags(mem_fraction_static=0.5, cuda_graph=False, chunked_prefill_size=8192, log_level="warning")
REPORT: dict = {}


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def save(a) -> None:
    (a.work / "report.json").write_text(json.dumps(REPORT, indent=1, default=str))
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        shutil.copy(a.work / "report.json", a.out / "report.json")


def model_dir(a) -> Path:
    return Path(a.model) if a.model else a.work / "model"


# ------------------------------------------------------------------------------------------------ servers
def server(a, name: str, *, capture_dir: Path | None, port: int) -> ServerProcess:
    from eaglenest.engines.sglang_launcher import build_command

    if a.engine == "embedded":
        cmd, env = embedded_command(model=str(model_dir(a)), port=port, capture_dir=capture_dir and str(capture_dir),
                                    dtype="bfloat16"), {}
    else:
        cmd, env = build_command(model_dir=model_dir(a), capture_dir=capture_dir, port=port, sglang_args=SGLANG_ARGS)
    return local_server(cmd, port=port, env=env, log_path=a.work / "logs" / f"{name}.log")


@contextlib.contextmanager
def running(a, name: str, *, capture_dir: Path | None, port: int, while_starting=None) -> Iterator[ServerProcess]:
    """A ready server for the phase; its process group ends, its log tail is kept, on every exit path."""
    from eaglenest.engines.sglang_launcher import capture_ready, release_work_dir

    proc = server(a, name, capture_dir=capture_dir, port=port)
    ready = capture_ready if (capture_dir is not None and a.engine == "sglang") else probe_ready
    t0 = time.time()
    try:
        with launched(proc, timeout_s=600, ready=ready, while_starting=while_starting):
            REPORT.setdefault("servers", {})[name] = {"startup_s": round(time.time() - t0, 1),
                                                      "cmd": " ".join(proc.cmd)}
            say(f"{name}: ready after {time.time() - t0:.0f} s")
            yield proc
    finally:
        release_work_dir(proc.env)
        (a.work / "logs" / f"{name}.tail").write_text(log_tail(proc.log_path, 80))


# ------------------------------------------------------------------------------------------------ phases
def phase_model(a) -> dict:
    if a.model:
        return {"model": a.model, "converted": False}
    t0 = time.time()
    gguf = a.work / "SmolLM2-135M-Instruct.Q4_1.gguf"
    with open(gguf, "wb") as out:
        for part in a.gguf_parts:
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 22)
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    if digest != GGUF_SHA256:
        raise RuntimeError(f"joined GGUF has sha256 {digest}, expected {GGUF_SHA256}")
    convert_gguf(gguf, a.work / "model")
    return {"model": str(a.work / "model"), "converted": True, "convert_s": round(time.time() - t0, 1)}


def _params(a, url: str):
    from eaglenest.extraction.config import ExtractParams

    return ExtractParams(recipe="capture",
                         source=str(a.prompts), limit=a.limit, max_tokens=a.max_tokens, model=str(model_dir(a)),
                         engine=a.engine, server_urls=[url], batch_size=a.batch_size, concurrency=a.concurrency,
                         output_dir=str(a.work / "extractions"), extraction_id="gpu-run", shard_wait_s=120,
                         request_timeout_s=900, launch_timeout_s=600)


def _prefill_rate(samples, url: str, prefix: str, concurrency: int) -> dict:
    """Prefill-only throughput of one server through the extraction's own client (after a warm-up pass)."""
    from eaglenest.extraction.client import ClientConfig
    from eaglenest.extraction.prefill import prefill

    config = ClientConfig(concurrency=concurrency, timeout_s=900)
    prefill([dataclasses.replace(s, sample_id=f"{prefix}warm-{s.sample_id}") for s in samples[:256]], [url],
            config=config)
    renamed = [dataclasses.replace(s, sample_id=f"{prefix}{s.sample_id}") for s in samples]
    r = prefill(renamed, [url], config=config)
    return {"samples": len(r.answers), "failed": len(r.failures), "tokens": r.tokens,
            "seconds": round(r.elapsed_s, 2), "tok_s": round(r.tokens / max(r.elapsed_s, 1e-9), 1)}


def phase_capture(a) -> dict:
    from eaglenest.data.samples import read_samples
    from eaglenest.extraction.ledger import Ledger
    from eaglenest.extraction.run import run_extraction
    from eaglenest.extraction.state import open_extraction, prepare

    port = 31000
    ext = open_extraction(_params(a, f"http://127.0.0.1:{port}"))
    capture = ext.dir / "capture"
    ext_dir = ext.dir
    res: dict = {}
    timing: dict = {}

    def tokenize() -> None:  # samples.parquet is reused by run_extraction (same content key)
        t = time.time()
        prepare(ext)
        timing["prepare_s"] = round(time.time() - t, 1)

    with running(a, "capture", capture_dir=capture, port=port, while_starting=tokenize) as proc:
        res.update(timing)
        t0 = time.time()
        rep = run_extraction(_params(a, proc.url))
        res["extraction"] = rep
        res["extraction_wall_s"] = round(time.time() - t0, 1)
        entries = Ledger(ext_dir).entries()
        res["shard_bytes"] = sum(e.bytes for e in entries.values())
        res["tokens"] = sum(e.num_tokens for e in entries.values())
        subset = read_samples(ext_dir / "samples.parquet")[: a.p1_samples]
        res["p1_capture"] = _prefill_rate(subset, proc.url, "p1-", a.concurrency)
        for p in capture.glob("p1-*"):  # the P1 leg's own shards are not part of the extraction
            p.unlink()
    with running(a, "plain", capture_dir=None, port=port + 1) as proc:
        res["p1_plain"] = _prefill_rate(subset, proc.url, "p1raw-", a.concurrency)
    raw = res["p1_plain"]["tok_s"]
    res["P1_capture_over_plain"] = round(res["p1_capture"]["tok_s"] / raw, 4)
    run = rep.get("run", {})
    e2e_s = res["extraction_wall_s"] + res.get("prepare_s", 0.0)  # tokenizing overlapped the server's start-up
    res["end_to_end_tok_s"] = round(res["tokens"] / e2e_s, 1)
    res["P2_end_to_end_over_raw_prefill"] = round(res["end_to_end_tok_s"] / raw, 4)
    res["P2_excluding_tokenization"] = round(res["tokens"] / res["extraction_wall_s"] / raw, 4)
    res["capture_bytes_per_s"] = round(res["shard_bytes"] / max(run.get("prefill_s", e2e_s), 1e-9), 1)
    return res


def phase_reference(a) -> dict:
    import torch

    from eaglenest.engines.runtime import TargetRunner
    from eaglenest.extraction.ledger import Ledger

    ext_dir = a.work / "extractions" / "gpu-run"
    entries = sorted(Ledger(ext_dir).entries().values(), key=lambda e: e.num_tokens)
    picks = [entries[int(i * (len(entries) - 1) / 7)] for i in range(8)]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    runner = TargetRunner(model_dir(a), dtype="bfloat16", device=device)
    rows, worst = [], 0.0
    for e in picks:
        shard = contract.read_shard(ext_dir / "capture" / e.shard)
        ref = runner.capture([shard.input_ids.tolist()])[0]
        k = len(runner.aux_layer_ids)
        h = runner.hidden_size
        layers = {}
        for j, lid in enumerate(runner.aux_layer_ids):
            a_, b_ = shard.aux_hidden[:, j * h:(j + 1) * h].float(), ref.aux_hidden[:, j * h:(j + 1) * h].float()
            layers[f"aux{lid}"] = round(float((a_ - b_).norm() / b_.norm()), 5)
        layers["final"] = round(float((shard.final_hidden.float() - ref.final_hidden.float()).norm()
                                      / ref.final_hidden.float().norm()), 5)
        worst = max(worst, *layers.values())
        rows.append({"sample": e.sample_id, "tokens": e.num_tokens, "rel_err": layers, "k": k})
    return {"tolerance": a.tol, "worst_rel_err": worst, "ok": worst <= a.tol, "samples": rows}


def phase_store(a) -> dict:
    from eaglenest.store import convert

    t0 = time.time()
    s = convert(a.work / "extractions" / "gpu-run", str(a.work / "store")).to_dict()
    return {"summary": s, "seconds": round(time.time() - t0, 1)}


def phase_train(a) -> dict:
    import torch

    from eaglenest.drafter.config import TrainConfig
    from eaglenest.drafter.train import train

    cfg = TrainConfig(store=str(a.work / "store"), out_dir=str(a.work / "train"), target=str(model_dir(a)),
                      device="cuda" if torch.cuda.is_available() else "cpu", precision="bf16",
                      draft_vocab_size=a.draft_vocab, ttt_steps=a.ttt_steps, epochs=a.epochs,
                      max_tokens=a.train_max_tokens, max_minutes=a.train_minutes, lr=a.lr, warmup_steps=50,
                      eval_every=a.eval_every, save_every=a.eval_every, eval_max_samples=300)
    t0 = time.time()
    r = train(cfg).to_dict()
    r.pop("history", None)
    return {"config": cfg.model_dump(), "result": r, "seconds": round(time.time() - t0, 1)}


def phase_export(a) -> dict:
    from eaglenest.drafter.export import export_drafter

    out = export_drafter(a.work / "train", a.work / "export", fmt="sglang", overwrite=True)
    res = {"export": str(out), "bytes": sum(p.stat().st_size for p in out.iterdir())}
    if a.out:
        tar = a.work / "drafter.tar"
        with tarfile.open(tar, "w") as tf:
            tf.add(out, arcname="drafter-sglang")
            for extra in ("metrics.jsonl", "result.json", "loss_curve.png"):
                if (a.work / "train" / extra).is_file():
                    tf.add(a.work / "train" / extra, arcname=f"train/{extra}")
        subprocess.run(["split", "-b", "15M", "-d", str(tar), str(a.out / "drafter.tar.part")], check=True)
        res["parts"] = sorted(p.name for p in a.out.glob("drafter.tar.part*"))
        res["tar_sha256"] = hashlib.sha256(tar.read_bytes()).hexdigest()
    return res


PHASES = {"model": phase_model, "capture": phase_capture, "reference": phase_reference, "store": phase_store,
          "train": phase_train, "export": phase_export}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phases", required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/run"))
    p.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    p.add_argument("--engine", choices=("sglang", "embedded"), default="sglang")
    p.add_argument("--model", default=None, help="an existing HF folder (skips the GGUF conversion)")
    p.add_argument("--gguf-parts", nargs="*", default=[])
    p.add_argument("--prompts", type=Path, default=ROOT / ".gpu" / "prompts.jsonl.xz")
    p.add_argument("--limit", type=int, default=10_000)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--p1-samples", type=int, default=2000)
    p.add_argument("--tol", type=float, default=0.02)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--epochs", type=float, default=4.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--train-max-tokens", type=int, default=32768)
    p.add_argument("--train-minutes", type=float, default=5.0)
    p.add_argument("--eval-every", type=int, default=200)
    a = p.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    (a.work / "logs").mkdir(exist_ok=True)
    if (a.work / "report.json").is_file():
        REPORT.update(json.loads((a.work / "report.json").read_text()))
    ok = True
    for name in a.phases.split(","):
        t0 = time.time()
        say(f"== {name}")
        try:
            REPORT[name] = PHASES[name](a)
        except Exception as e:
            ok = False
            REPORT[name] = {"error": repr(e), "trace": traceback.format_exc()[-4000:]}
            say(f"{name} FAILED: {e!r}")
        REPORT[name]["phase_s"] = round(time.time() - t0, 1)
        save(a)
        say(f"== {name}: {time.time() - t0:.1f} s")
        if not ok:
            break
    if a.out:
        with tarfile.open(a.out / "logs.tar.xz", "w:xz") as tf:
            tf.add(a.work / "logs", arcname="logs")
    brief = {k: {kk: vv for kk, vv in v.items() if not isinstance(vv, (dict, list))} for k, v in REPORT.items()
             if isinstance(v, dict)}
    print(json.dumps(brief, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
