"""Shard checks per second (``check_shard`` + sha256, the validation's per-shard CPU work), alone and beside a
thread busy in Python (what the request loop is during an extraction), by the interpreter's switch interval.

    python scripts/bench_validate.py [--tokens 615] [--threads 2] [--shards 300]

Prints one line per case and a JSON summary. The shards are synthetic (``fake_shard``: SmolLM2's hidden size and
3 aux layers by default), so nothing is read from disk: this isolates the CPU and GIL cost.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import sys
import threading
import time

from eaglenest import contract
from eaglenest.data import Sample
from eaglenest.extraction import validate as v
from eaglenest.testing.fake_store import fake_shard


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=615)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shards", type=int, default=300)
    ap.add_argument("--intervals-ms", default="5,1,0.5,0.2")
    a = ap.parse_args()
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


if __name__ == "__main__":
    main()
