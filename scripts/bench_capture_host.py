"""Benchmark the host side of the SGLang capture path, piece by piece, without a GPU: MB/s and tok/s each.

    python scripts/bench_capture_host.py [--samples 200] [--tokens 574] [--hidden 576] [--workdir /tmp]
                                         [--pieces encode,publish,writer,validate,argmax,client]

Shards are the default target's shape (3 aux layers, ``--hidden``, ``--tokens`` per sample: 574 is the
regenerate recipe's mean on ShareGPT first turns). Pieces, each over the same samples:
- encode: ``contract.encode_shard`` (finite check + safetensors bytes), what the writer child does per shard;
- publish: ``contract.publish_shard`` (write, fsync, link, fsync the folder, sha256 for the receipt);
- writer: the whole :class:`~eaglenest.engines.sglang_capture.CaptureWriter` (the child's code: coalesce,
  encode, publish on its thread pool, receipts) fed host batches of 16 requests, wall time to the last receipt;
- validate: :func:`~eaglenest.extraction.validate.validate_batch` without the argmax check (read, decode, ids,
  finite, norms, sha256; its thread pool), plus one-thread timings of each check;
- argmax: the regenerated-sample LM-head argmax check on THIS machine's CPU (on a GPU host it runs on the GPU);
- client: :class:`~eaglenest.extraction.client.EngineClient` over an in-process mock transport answering at
  once (request JSON, answer parsing, the priority queue): the client's own cost per capture request.
Numbers on a shared 2-core machine are noisy: take the best of ``--repeats``.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import torch

from eaglenest import contract
from eaglenest.data.samples import Sample
from eaglenest.engines.sglang_capture import CaptureWriter, HostBatch, ReqView, Segment
from eaglenest.extraction import validate as v
from eaglenest.extraction.aio import run_sync
from eaglenest.extraction.client import ClientConfig, EngineClient, Job
from eaglenest.extraction.lm_head import argmax_agreement
from eaglenest.extraction.prefill import capture_request, check_capture_answer
from eaglenest.testing.fake_store import fake_provenance, fake_shard


def best(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def line(name: str, seconds: float, n: int, tokens: int, nbytes: int) -> None:
    print(f"{name:<28} {n / seconds:9.1f} samples/s {tokens / seconds:11,.0f} tok/s "
          f"{nbytes / seconds / 1e6:8.1f} MB/s   ({seconds * 1e3 / n:.2f} ms/sample)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=574)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--pieces", default="encode,publish,writer,validate,argmax,client")
    a = ap.parse_args()
    pieces = set(a.pieces.split(","))
    prov = fake_provenance(hidden_size=a.hidden, aux_layer_ids=(1, 14, 26), num_layers=30)
    shards = [fake_shard(f"s{i}", a.tokens, prov, seed=i) for i in range(a.samples)]
    n, tokens = len(shards), len(shards) * a.tokens
    encoded = [contract.encode_shard(s) for s in shards]
    nbytes = sum(map(len, encoded))
    print(f"{n} shards x {a.tokens} tokens, H={a.hidden}: {nbytes / n / a.tokens:,.0f} B/token, "
          f"{nbytes / 1e6:,.0f} MB in all", flush=True)
    work = Path(tempfile.mkdtemp(prefix="bench-caphost-", dir=a.workdir))
    try:
        if "encode" in pieces:
            line("encode_shard", best(lambda: [contract.encode_shard(s) for s in shards], a.repeats), n, tokens, nbytes)
        if "publish" in pieces:
            def publish() -> None:
                d = work / "pub"
                shutil.rmtree(d, ignore_errors=True)
                d.mkdir()
                for s, data in zip(shards, encoded, strict=True):
                    contract.publish_shard(d / contract.shard_filename(s.sample_id), data)
            line("publish_shard (1 thread)", best(publish, a.repeats), n, tokens, nbytes)
        if "writer" in pieces:
            line("CaptureWriter (4 threads)", best(lambda: run_writer(work, shards, prov), a.repeats), n, tokens,
                 nbytes)
        samples = [Sample(sample_id=s.sample_id, input_ids=s.input_ids.numpy(),
                          loss_spans=((a.tokens // 5, a.tokens),), regenerated=True) for s in shards]
        expect = v.Expectation(aux_layer_ids=prov.aux_layer_ids, hidden_size=prov.hidden_size,
                               num_layers=prov.num_layers, model_hash=prov.model_hash,
                               tokenizer_hash=prov.tokenizer_hash, chat_template_hash=prov.chat_template_hash,
                               provenance=prov)
        if "validate" in pieces:
            ext = work / "ext"
            cap = ext / "capture"
            cap.mkdir(parents=True, exist_ok=True)
            for s, data in zip(shards, encoded, strict=True):
                (cap / contract.shard_filename(s.sample_id)).write_bytes(data)
            for workers in (1, v.ValidateConfig().workers):
                cfg = v.ValidateConfig(workers=workers)

                def validate(cfg: v.ValidateConfig = cfg) -> None:
                    res = v.validate_batch(samples, extraction_dir=ext, expect=expect, config=cfg)
                    assert len(res.entries) == n, res.invalid[:1]
                line(f"validate_batch ({workers} thr)", best(validate, a.repeats), n, tokens, nbytes)
            paths = [cap / contract.shard_filename(s.sample_id) for s in shards]
            steps: dict[str, Callable[[], object]] = {
                "  read_bytes": lambda: [p.read_bytes() for p in paths],
                "  decode_shard": lambda: [contract.decode_shard(d) for d in encoded],
                "  sha256": lambda: [contract.sha256_bytes(d) for d in encoded],
            }
            decoded = [contract.decode_shard(d) for d in encoded]
            steps["  nonfinite"] = lambda: [(v._nonfinite(v._bits(s.aux_hidden)), v._nonfinite(v._bits(s.final_hidden)))
                                            for s in decoded]
            steps["  norms"] = lambda: [v._norms(s) for s in decoded]
            for name, fn in steps.items():
                line(name, best(fn, a.repeats), n, tokens, nbytes)
        if "argmax" in pieces:
            head = torch.randn(a.vocab, a.hidden)  # [V, H] fp32, as load_lm_head returns it
            m = min(n, 16)
            sec = best(lambda: [argmax_agreement(s.final_hidden, s.input_ids, samples[i].loss_spans, head)
                                for i, s in enumerate(shards[:m])], 1)
            line("argmax (this CPU)", sec, m, m * a.tokens, nbytes * m // n)
        if "client" in pieces:
            line("EngineClient (mock)", best(lambda: run_client(samples), a.repeats), n, tokens, nbytes)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_writer(work: Path, shards: list[contract.Shard], prov: contract.Provenance, per_batch: int = 16) -> None:
    cap, rec = work / "wcap", work / "wrec"
    for d in (cap, rec):
        shutil.rmtree(d, ignore_errors=True)
    writer = CaptureWriter(capture_dir=cap, receipt_dir=rec, provenance=prov, threads=4)
    for i in range(0, len(shards), per_batch):
        group = shards[i: i + per_batch]
        segments, row = [], 0
        for s in group:
            t = s.num_tokens
            segments.append(Segment(ReqView(s.sample_id, 0, t, t, True, s.input_ids.tolist()), row, row))
            row += t
        writer.submit(HostBatch(segments, torch.cat([s.aux_hidden for s in group]),
                                torch.cat([s.final_hidden for s in group])))
    writer.close()
    assert writer.stats["shards"] == len(shards), writer.stats


def run_client(samples: list[Sample]) -> None:
    ok = {"text": "", "meta_info": {"finish_reason": {"type": "length"}}}

    async def answer(request: httpx.Request) -> httpx.Response:
        body = np.frombuffer(request.content, dtype=np.uint8)  # the JSON body was built and sent
        assert body.size
        return httpx.Response(200, json=ok)

    client = EngineClient(["http://bench"], config=ClientConfig(concurrency=64), transport=httpx.MockTransport(answer))
    jobs = [Job(s.sample_id, capture_request(s), payload=s, check=check_capture_answer) for s in samples]
    out = run_sync(lambda: client.run(jobs))
    assert len(out) == len(samples)


if __name__ == "__main__":
    main()
