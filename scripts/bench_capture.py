"""Benchmark: embedded-server prefill tok/s with capture on vs off, same prompts, same settings.

    python scripts/bench_capture.py [--model default] [--prompts 48] [--concurrency 8] [--repeats 2]

Prints tok/s for each mode, the ratio (capture on / off) and shard bytes per token. Prompts are real
text (Python standard-library sources, tokenized and cut to mixed lengths 64..768), sent length-sorted
as the extraction client sends them. Modes alternate over ``--repeats`` rounds; the best round of each
counts (quiet-moment figures on a shared 2-core machine).
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import os
import random
import shutil
import tempfile
from pathlib import Path

from eaglenest.engines.embedded import EmbeddedEngine, ServerSettings
from eaglenest.engines.prefill_load import send_all
from eaglenest.engines.runtime import TargetRunner
from eaglenest.engines.serving import BackgroundServer
from eaglenest.models import resolve_model


def make_prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    ids: list[int] = []
    for f in files[:60]:
        ids += tokenizer(Path(f).read_text(errors="replace"))["input_ids"]
    prompts = []
    for _ in range(n):
        length = rng.randint(64, 768)
        start = rng.randint(0, len(ids) - length - 1)
        prompts.append(ids[start : start + length])
    return sorted(prompts, key=len)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    a = ap.parse_args()

    runner = TargetRunner(resolve_model(a.model), dtype=a.dtype)
    prompts = make_prompts(runner.tokenizer, a.prompts)
    tokens = sum(map(len, prompts))
    work = Path(tempfile.mkdtemp(prefix="bench-capture-"))
    settings = ServerSettings(max_batch_size=8)
    best = {"off": float("inf"), "on": float("inf")}
    shard_bytes = 0
    try:
        warm = EmbeddedEngine(runner, capture_dir=None, settings=settings)
        with BackgroundServer(warm) as url:
            asyncio.run(send_all(url, prompts[:8], a.concurrency, "warm"))
        warm.close()
        for rnd in range(a.repeats):
            for mode in ("off", "on"):
                cap = work / f"cap-{rnd}" if mode == "on" else None
                engine = EmbeddedEngine(runner, capture_dir=cap, settings=settings)
                with BackgroundServer(engine) as url:
                    dt = asyncio.run(send_all(url, prompts, a.concurrency, mode))
                engine.close()
                best[mode] = min(best[mode], dt)
                if cap is not None:
                    shard_bytes = sum(p.stat().st_size for p in cap.iterdir())
                    shutil.rmtree(cap)
                print(f"round {rnd} capture {mode:>3}: {tokens / dt:8.1f} tok/s ({dt:.2f} s)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    on, off = tokens / best["on"], tokens / best["off"]
    print(f"model {runner.model_dir.name} dtype {runner.dtype_name} prompts {len(prompts)} tokens {tokens} "
          f"concurrency {a.concurrency}")
    print(f"prefill tok/s capture off {off:.1f}  on {on:.1f}  ratio on/off {on / off:.3f}")
    print(f"shard bytes per token {shard_bytes / tokens:.1f} (aux {len(runner.aux_layer_ids)}x{runner.hidden_size} "
          f"+ final {runner.hidden_size}, bf16, + int32 id)")


if __name__ == "__main__":
    main()
