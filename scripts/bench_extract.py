"""Benchmark P2: end-to-end extraction tok/s ÷ raw prefill tok/s of the same server.

    python scripts/bench_extract.py [--model default] [--samples 64] [--max-tokens 1024] [--concurrency 8]
                                    [--repeats 2] [--dtype auto]

One embedded server subprocess (launched like the extraction launches it: own process group, capture
into the extraction's folder). The same real ShareGPT samples (first turns that fit --max-tokens) are
sent three ways, alternating over --repeats rounds (best round of each counts: quiet-moment figures on a
shared machine):

- raw prefill: a bare async httpx client, prefill-only requests with ``nocapture:`` rids (no shard),
  same concurrency;
- raw capture: the same bare client with capture on (shards written, nothing validated);
- end to end: ``run_extraction`` from the source URL to the ledger: reading and tokenizing the
  source, prefill with capture, validation of every shard, ledger appends (servers already up).

Prints tok/s of each and P2 = end-to-end / raw prefill (plus end-to-end / raw capture, which isolates
the pipeline's own overhead from the capture overhead P1).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from pathlib import Path

from eaglenest.contract import NO_CAPTURE_RID_PREFIX
from eaglenest.engines.pool import embedded_command, free_port, launched, local_server
from eaglenest.engines.prefill_load import send_all
from eaglenest.extraction.config import ExtractParams
from eaglenest.extraction.run import run_extraction
from eaglenest.extraction.state import open_extraction, prepare


def reset(ext_dir: Path) -> None:
    """Forget everything an extraction did except its (server-owned) capture folder, which is emptied."""
    for p in ext_dir.iterdir():
        if p.name == "capture":
            for f in p.iterdir():
                f.unlink()
        elif p.name not in ("logs", "extraction.json", "prepare.json", "samples.parquet"):
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--source", default="sharegpt")
    ap.add_argument("--samples", type=int, default=64, help="records read from the source (first turns)")
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    a = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-extract-"))
    params = ExtractParams(recipe="capture",
                           source=a.source, limit=a.samples, max_turns=1, max_tokens=a.max_tokens, model=a.model,
                           dtype=a.dtype, batch_size=a.batch_size, concurrency=a.concurrency,
                           output_dir=str(work), extraction_id="bench")
    ext = open_extraction(params)
    prompts = sorted((s.input_ids.tolist() for s in prepare(ext).samples), key=len, reverse=True)  # longest first
    tokens = sum(map(len, prompts))
    port = free_port()
    server = local_server(embedded_command(model=str(ext.model_dir), port=port, capture_dir=str(ext.capture_dir),
                                           dtype=a.dtype), port=port, log_path=work / "server.log")
    best = {"raw prefill": float("inf"), "raw capture": float("inf"), "end to end": float("inf")}
    e2e_tokens = 0
    try:
        with launched(server, timeout_s=600):
            url = server.url
            # warm-up with every prompt once: the CPU kernels of each batch shape are built on first use
            asyncio.run(send_all(url, prompts, a.concurrency, NO_CAPTURE_RID_PREFIX + "warm"))
            e2e_params = ExtractParams(**{**params.model_dump(), "server_urls": [url]})
            for rnd in range(a.repeats):
                dt = asyncio.run(send_all(url, prompts, a.concurrency, f"{NO_CAPTURE_RID_PREFIX}raw{rnd}"))
                best["raw prefill"] = min(best["raw prefill"], dt)
                print(f"round {rnd} raw prefill  {tokens / dt:9.1f} tok/s ({dt:.2f} s)", flush=True)
                dt = asyncio.run(send_all(url, prompts, a.concurrency, f"raw-capture-{rnd}"))
                best["raw capture"] = min(best["raw capture"], dt)
                print(f"round {rnd} raw capture  {tokens / dt:9.1f} tok/s ({dt:.2f} s)", flush=True)
                reset(ext.dir)
                (ext.dir / "prepare.json").unlink()  # end to end includes reading + tokenizing the source
                t0 = time.perf_counter()
                report = run_extraction(e2e_params)
                dt = time.perf_counter() - t0
                if not report["complete"]:
                    raise SystemExit(f"extraction incomplete: {report['problems'][:3]}")
                e2e_tokens = report["tokens_done"]
                best["end to end"] = min(best["end to end"], dt * tokens / e2e_tokens)
                r = report["run"]
                print(f"round {rnd} end to end   {e2e_tokens / dt:9.1f} tok/s ({dt:.2f} s, "
                      f"{report['done']} samples validated; phases {r['phases_s']} prefill {r['prefill_s']} s "
                      f"validate {r['validate_s']} s)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rate = {k: tokens / v for k, v in best.items()}
    print(f"model {ext.model_dir.name} dtype {a.dtype} samples {len(prompts)} tokens {tokens} "
          f"concurrency {a.concurrency} batch {a.batch_size}")
    print("  ".join(f"{k} {v:.1f} tok/s" for k, v in rate.items()))
    print(f"P2 end-to-end / raw prefill = {rate['end to end'] / rate['raw prefill']:.3f}   "
          f"(end-to-end / raw capture = {rate['end to end'] / rate['raw capture']:.3f})")


if __name__ == "__main__":
    main()
