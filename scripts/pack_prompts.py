"""Pack a prompt source into a small JSONL(.xz) of conversations that fit a token budget.

For hosts without the registry (the GPU machine) or to pin an exact sample set:

    python scripts/pack_prompts.py --out prompts.jsonl.xz --count 10000 --max-tokens 1024 --max-turns 2

Records are read with eaglenest.data (bad records reported and skipped), cut to their first
``--max-turns`` assistant turns, rendered with the target's chat template and kept only when the whole
conversation fits ``--max-tokens`` (nothing is truncated mid-turn). Output records are
``{"id", "messages"}``; the extraction's ``source`` accepts the file as it is (compression inferred).
"""

from __future__ import annotations

import argparse
import io
import json
import lzma
import time
from pathlib import Path

from eaglenest.contract import atomic_write_bytes
from eaglenest.data import ChatEncoder, read_records
from eaglenest.data.chat import truncate_turns
from eaglenest.models import resolve_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", default="sharegpt")
    ap.add_argument("--model", default="default", help="target whose chat template counts the tokens")
    ap.add_argument("--out", required=True)
    ap.add_argument("--count", type=int, default=10_000)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--max-turns", type=int, default=2)
    a = ap.parse_args()
    t0 = time.perf_counter()
    enc = ChatEncoder(resolve_model(a.model))
    src = read_records(a.source)
    kept, too_long, tokens = [], 0, 0
    for rec in src.records:
        rec = truncate_turns(rec, a.max_turns)
        if not any(m.role == "assistant" for m in rec.messages):
            continue
        ids, _ = enc.encode(rec.messages)
        if len(ids) > a.max_tokens:
            too_long += 1
            continue
        kept.append({"id": rec.id, "messages": [{"role": m.role, "content": m.content} for m in rec.messages]})
        tokens += len(ids)
        if len(kept) == a.count:
            break
    buf = io.BytesIO()
    for r in kept:
        buf.write((json.dumps(r, ensure_ascii=False) + "\n").encode())
    data = buf.getvalue()
    if a.out.endswith(".xz"):
        data = lzma.compress(data, preset=9)
    atomic_write_bytes(Path(a.out), data)
    print(json.dumps({"kept": len(kept), "tokens": tokens, "mean_tokens": round(tokens / max(len(kept), 1), 1),
                      "too_long": too_long, "bad_records": len(src.bad), "bytes": len(data),
                      "seconds": round(time.perf_counter() - t0, 1)}))
    if len(kept) < a.count:
        raise SystemExit(f"only {len(kept)} records fit; wanted {a.count}")


if __name__ == "__main__":
    main()
