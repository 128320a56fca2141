"""Print one regenerated sample decoded back to text next to its source conversation (the target's answers in
place of the given ones; loss-masked tokens between [[ and ]]).

    python scripts/show_regenerated.py runs/extractions/<id> [--turns 2] [--sample ID]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eaglenest.data.chat import ChatEncoder
from eaglenest.data.samples import read_samples
from eaglenest.extraction.state import REGENERATED, JsonlLog


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("extraction_dir")
    ap.add_argument("--turns", type=int, default=2, help="pick a sample with at least this many regenerated turns")
    ap.add_argument("--sample", help="this sample id instead")
    ap.add_argument("--model", default="default", help="the extraction's target (its --model)")
    a = ap.parse_args(argv)
    ext = Path(a.extraction_dir)
    rows = [d for d in JsonlLog.read(ext / REGENERATED) if "input_ids" in d]
    pick = next((d for d in rows if (a.sample and d["sample_id"] == a.sample)
                 or (not a.sample and d["meta"].get("regen_turns", 0) >= a.turns)), None)
    if pick is None:
        print(f"no regenerated sample with >= {a.turns} turns in {ext / REGENERATED}", file=sys.stderr)
        return 1
    source = {s.sample_id: s for s in read_samples(ext / "samples.parquet")}[pick["sample_id"]]
    from eaglenest.models import resolve_model

    tok = ChatEncoder(resolve_model(a.model)).tokenizer
    print(f"== source conversation {pick['sample_id']} ==")
    for m in source.messages:
        print(f"[{m.role}] {m.content}\n")
    ids, text, last = pick["input_ids"], [], 0
    for lo, hi in pick["loss_spans"]:
        text += [tok.decode(ids[last:lo]), "[[", tok.decode(ids[lo:hi]), "]]"]
        last = hi
    text.append(tok.decode(ids[last:]))
    print(f"== the sample as captured ({len(ids)} tokens, {pick['meta']}) ==")
    print("".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
