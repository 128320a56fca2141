"""Shard checks per second (``check_shard`` + sha256, the validation's per-shard CPU work), alone and beside a
thread busy in Python (what the request loop is during an extraction), by the interpreter's switch interval.

    python scripts/bench_validate.py [--tokens 615] [--threads 2] [--shards 300]
    python scripts/bench_validate.py --pools [--threads 2] [--shards 300] [--rounds 3]

Prints one line per case and a JSON summary. The shards are synthetic (``fake_shard``: SmolLM2's hidden size and
3 aux layers by default), so nothing is read from disk: this isolates the CPU and GIL cost.
``--pools``: the whole ``validate_batch`` over shard files (regenerated samples; the argmax check against a
``--head-rows`` head), checked by ``--threads`` threads and by as many worker processes
(``ValidateConfig.processes``), beside a thread spinning in Python at the extraction's switch interval (the
request loop), the two sides alternating for ``--rounds``; prints shards/s of each and the processes/threads
ratio (best and median of the rounds); with ``--process-batch N`` (16) also processes that take N shards per task.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import sys
import threading
import time
from collections.abc import Callable

from eaglenest import contract
from eaglenest.data import Sample
from eaglenest.extraction import validate as v
from eaglenest.extraction.checking import check_pool
from eaglenest.testing.fake_store import fake_provenance, fake_shard


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=615)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shards", type=int, default=300)
    ap.add_argument("--intervals-ms", default="5,1,0.5,0.2")
    ap.add_argument("--pools", action="store_true", help="validate_batch: threads against worker processes")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--head-rows", type=int, default=256, help="--pools: rows of the synthetic LM head")
    ap.add_argument("--process-batch", type=int, default=16,
                    help="--pools: also processes with this many shards per task (ValidateConfig.process_batch)")
    a = ap.parse_args()
    if a.pools:
        return pools(a)
    prov = contract.Provenance(engine="bench", engine_version="0", model_path="m", model_hash="m", tokenizer_hash="t",
                               chat_template_hash="c", dtype="bfloat16", aux_layer_ids=(1, 2, 3),
                               hidden_size=a.hidden, num_layers=30)
    shards = [fake_shard(f"s{i}", a.tokens, prov, seed=i) for i in range(32)]
    datas = [contract.encode_shard(s) for s in shards]
    samples = [Sample(sample_id=s.sample_id, input_ids=s.input_ids.numpy(), loss_spans=[(1, a.tokens)]) for s in shards]
    expect = v.Expectation(aux_layer_ids=(1, 2, 3), hidden_size=a.hidden, num_layers=30, model_hash="m",
                           tokenizer_hash="t", chat_template_hash="c")

    def check(i: int) -> None:
        j = i % len(datas)
        v.check_shard(samples[j], datas[j], expect, where="bench")
        contract.sha256_bytes(datas[j])

    def rate(ex: cf.ThreadPoolExecutor) -> float:
        t0 = time.perf_counter()
        list(ex.map(check, range(a.shards)))
        return a.shards / (time.perf_counter() - t0)

    def spin(stop: threading.Event, loops: list[int]) -> None:
        n = 0
        while not stop.is_set():
            for _ in range(1000):
                pass
            n += 1
        loops.append(n)

    out: dict = {"tokens": a.tokens, "threads": a.threads, "cases": []}
    default = sys.getswitchinterval()
    with cf.ThreadPoolExecutor(a.threads) as ex:
        list(ex.map(check, range(len(datas))))  # warm
        alone = rate(ex)
        print(f"alone (switch {default * 1e3:g} ms): {alone:.0f} shards/s")
        out["alone_per_s"] = round(alone, 1)
        for ms in (float(x) for x in a.intervals_ms.split(",")):
            sys.setswitchinterval(ms / 1e3)
            stop, loops = threading.Event(), []
            th = threading.Thread(target=spin, args=(stop, loops))
            t0 = time.perf_counter()
            th.start()
            r = rate(ex)
            stop.set()
            th.join()
            spin_rate = loops[0] / (time.perf_counter() - t0)
            print(f"beside a spinning thread, switch {ms:g} ms: {r:.0f} shards/s (spinning thread {spin_rate:.0f} "
                  "loops/s)")
            out["cases"].append({"switch_ms": ms, "shards_per_s": round(r, 1), "spin_loops_per_s": round(spin_rate)})
    sys.setswitchinterval(default)
    print(json.dumps(out))


def spinning(fn: Callable[[], float]) -> float:
    """``fn()`` beside a thread busy in Python, at the extraction's switch interval."""
    from eaglenest.extraction.run import quick_gil_handoff

    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            for _ in range(1000):
                pass

    th = threading.Thread(target=spin)
    with quick_gil_handoff():
        th.start()
        try:
            return fn()
        finally:
            stop.set()
            th.join()


def pools(a: argparse.Namespace) -> None:
    import statistics
    import tempfile
    from pathlib import Path

    import torch

    prov = fake_provenance(hidden_size=a.hidden)
    # the LM head's multiply is a GPU's work on a GPU host: a small head keeps the rows' way there (gathered in
    # the check, sent back from a process) without the CPU matmul of 49,152 rows that would swamp both sides
    lm_head = torch.randn(a.head_rows, a.hidden) / a.hidden**0.5
    expect = v.Expectation(aux_layer_ids=prov.aux_layer_ids, hidden_size=prov.hidden_size,
                           num_layers=prov.num_layers, model_hash=prov.model_hash, tokenizer_hash=prov.tokenizer_hash,
                           chat_template_hash=prov.chat_template_hash, provenance=prov)
    sides = {"threads": v.ValidateConfig(shard_wait_s=0, workers=a.threads),
             "processes": v.ValidateConfig(shard_wait_s=0, processes=a.threads, process_batch=1)}
    if a.process_batch > 1:
        sides[f"processes-x{a.process_batch}"] = v.ValidateConfig(shard_wait_s=0, processes=a.threads,
                                                                  process_batch=a.process_batch)
    rates: dict[str, list[float]] = {k: [] for k in sides}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        execs = {k: stack.enter_context(check_pool(c)) for k, c in sides.items()}
        for r in range(-1, a.rounds):  # round -1 warms up (the processes start and import at their first task)
            for k, cfg in sides.items():  # alternating, fresh files each time (validation moves nothing here)
                ext = Path(tmp) / f"{k}-{r}"
                (ext / "capture").mkdir(parents=True)
                samples = []
                for i in range(a.shards):
                    sh = fake_shard(f"{k}{r}-{i}", a.tokens, prov, seed=i % 32)
                    (ext / "capture" / contract.shard_filename(sh.sample_id)).write_bytes(contract.encode_shard(sh))
                    samples.append(Sample(sample_id=sh.sample_id, input_ids=sh.input_ids.numpy(),
                                          loss_spans=((a.tokens // 5, a.tokens),), regenerated=True))

                def run(ext: Path = ext, samples: list = samples, cfg: v.ValidateConfig = cfg, k: str = k) -> float:
                    t0 = time.perf_counter()
                    res = v.validate_batch(samples, extraction_dir=ext, expect=expect, config=cfg, lm_head=lm_head,
                                           pool=execs[k])
                    assert len(res.entries) == len(samples), res.invalid[:1]
                    return len(samples) / (time.perf_counter() - t0)

                rate = spinning(run)
                if r >= 0:
                    rates[k].append(rate)
                print(f"round {r + 1}{' (warm-up)' if r < 0 else ''}: {k} {rate:.1f} shards/s", flush=True)
    out = {"tokens": a.tokens, "workers": a.threads, "shards": a.shards, "rounds": a.rounds,
           "shards_per_s": {k: [round(x, 1) for x in xs] for k, xs in rates.items()}}
    for k in (k for k in rates if k != "threads"):  # each side against threads: best, and median of the rounds
        ratio = [p / t for p, t in zip(rates[k], rates["threads"], strict=True)]
        out[f"{k}_over_threads"] = {"best": round(max(rates[k]) / max(rates["threads"]), 3),
                                    "median_of_rounds": round(statistics.median(ratio), 3)}
        print(f"{k} / threads: best {out[f'{k}_over_threads']['best']}x, median of rounds "
              f"{out[f'{k}_over_threads']['median_of_rounds']}x")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
