"""Micro-benchmark: one target verify forward over k rows vs one plain decode step, on the CPU.

    python scripts/bench_verify_cpu.py [--contexts 100,300,600] [--rows 2,4,8] [--reps 40] [--transformers | --stock]

The part of a speculation cycle that the target costs, without a drafter: for each cached context
length, a 1-row step (oneDNN off: the best plain setting) and a k-row forward with aux states (oneDNN
on: the verify setting) run alternately on the decoders' target
(:func:`~eaglenest.speculative.target.decode_target`) and the same KV cache, which is cut back after
each. Prints medians in ms and the verify's cost in plain steps. ``--transformers`` times the prepared
transformers forward instead of the lean one, ``--stock`` transformers' own forward (no
:func:`~eaglenest.speculative.fastpath.prepare_target`). Load from other processes adds noise: wrap it
in ``flock /tmp/bench.lock``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", default="100,300,600", help="cached tokens before the timed forwards")
    ap.add_argument("--rows", default="2,4,8", help="verify rows (root + drafts)")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--transformers", action="store_true", help="the prepared transformers forward, not the lean one")
    ap.add_argument("--stock", action="store_true", help="transformers' forward, not the prepared target")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from eaglenest.engines.runtime import TargetRunner
    from eaglenest.models import resolve_model
    from eaglenest.speculative.onednn import pack_linears, phase
    from eaglenest.speculative.target import HFTarget, decode_target

    runner = TargetRunner(resolve_model(a.model), dtype=a.dtype)
    model = runner.model
    if a.stock:
        pack_linears(model)  # the verify's oneDNN setting needs prepacked weights either way
        target = HFTarget(model, runner.aux_layer_ids)
    else:
        target = decode_target(model, runner.aux_layer_ids, lean=not a.transformers)
    rows = [int(r) for r in a.rows.split(",")]
    vocab = int(model.config.vocab_size)
    print(f"{runner.model_dir.name} {runner.dtype_name}, {torch.get_num_threads()} threads, "
          f"{'stock transformers' if a.stock else type(target).__name__}")
    g = torch.Generator().manual_seed(0)
    for ctx in (int(c) for c in a.contexts.split(",")):
        cache = target.new_cache(ctx + max(rows))
        with torch.inference_mode(), phase(True):
            target.forward(cache, torch.randint(3, vocab, (1, ctx), generator=g), last_only=True)
        times: dict[int, list[float]] = {n: [] for n in [1, *rows]}
        with torch.inference_mode():
            for rep in range(a.reps + 5):
                for n in times:
                    ids = torch.randint(3, vocab, (1, n), generator=g)
                    with phase(n > 1):
                        t = time.perf_counter()
                        logits, _ = target.forward(cache, ids, aux=n > 1)
                        logits.argmax(dim=-1).tolist()
                        if rep >= 5:
                            times[n].append(time.perf_counter() - t)
                    target.keep_rows(cache, ctx, [])
        step = statistics.median(times[1])
        cells = [f"step {1e3 * step:6.2f} ms"] + [
            f"verify{n} {1e3 * statistics.median(times[n]):6.2f} ms = {statistics.median(times[n]) / step:.2f} steps"
            for n in rows]
        print(f"context {ctx:5d}: " + "  ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
