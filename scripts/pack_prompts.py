"""Pack a prompt source into a small JSONL(.xz) of conversations that fit a token budget.

For hosts without the registry (the GPU machine) or to pin an exact sample set:

    python scripts/pack_prompts.py --out prompts.jsonl.xz --count 10000 --max-tokens 1024 --max-turns 2 \
        --exclude-prompt-set mt-bench --exclude-prompt-set humaneval --exclude-prompt-set sharegpt

Records are read with eaglenest.data (bad records reported and skipped), cut to their first
``--max-turns`` assistant turns and rendered with the target's chat template. A conversation longer than
``--max-tokens`` keeps its longest prefix of whole turns that fits (``--long cut``, the default: every
complete conversation whose first turn fits is used) or is dropped (``--long drop``, how the packs before
2026-12-01f were made); nothing is truncated mid-turn. A conversation with any user message of an
``--exclude-prompt-set`` (the sets accept length is reported on; sharegpt = its 200 held-out prompts) is dropped
and counted, so training data never holds an evaluation prompt. Output records are
``{"id", "messages"}``; the extraction's ``source`` accepts the file as it is (compression inferred).
"""

from __future__ import annotations

import argparse
import json
import time

from eaglenest.data import ChatEncoder, fit_turns, read_records, truncate_turns
from eaglenest.data.sources import write_jsonl
from eaglenest.models import resolve_model
from eaglenest.speculative.prompts import PROMPT_SETS, user_texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", default="sharegpt")
    ap.add_argument("--model", default="default", help="target whose chat template counts the tokens")
    ap.add_argument("--out", required=True)
    ap.add_argument("--count", type=int, default=10_000)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--max-turns", type=int, default=2)
    ap.add_argument("--long", choices=("cut", "drop"), default="cut",
                    help="a conversation over --max-tokens: keep the whole turns that fit, or drop it")
    ap.add_argument("--exclude-prompt-set", action="append", default=[], choices=PROMPT_SETS,
                    help="drop conversations holding a user message of this evaluation set (repeatable)")
    a = ap.parse_args()
    t0 = time.perf_counter()
    enc = ChatEncoder(resolve_model(a.model))
    src = read_records(a.source)
    excluded_texts = user_texts(a.exclude_prompt_set)
    kept, too_long, cut, excluded, tokens = [], 0, 0, 0, 0
    for rec in src.records:
        if any(m.role == "user" and m.content.strip() in excluded_texts for m in rec.messages):
            excluded += 1
            continue
        rec = truncate_turns(rec, a.max_turns)
        if not any(m.role == "assistant" for m in rec.messages):
            continue
        fit = fit_turns(rec, enc, a.max_tokens)
        if fit is None or (a.long == "drop" and fit[0] is not rec):  # drop: only a record that fits as it is
            too_long += 1
            continue
        cut += fit[0] is not rec
        rec, n = fit
        kept.append({"id": rec.id, "messages": [{"role": m.role, "content": m.content} for m in rec.messages]})
        tokens += n
        if len(kept) == a.count:
            break
    data = write_jsonl(a.out, kept)
    print(json.dumps({"kept": len(kept), "tokens": tokens, "mean_tokens": round(tokens / max(len(kept), 1), 1),
                      "too_long": too_long, "cut_to_fit": cut, "excluded_eval_prompts": excluded,
                      "excluded_sets": a.exclude_prompt_set, "bad_records": len(src.bad), "bytes": len(data),
                      "seconds": round(time.perf_counter() - t0, 1)}))
    if len(kept) < a.count:
        raise SystemExit(f"only {len(kept)} records fit; wanted {a.count}")


if __name__ == "__main__":
    main()
