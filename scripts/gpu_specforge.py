"""GPU machine: SpecForge's EAGLE-3 trainer side by side with eaglenest's, on the same store samples. No Prefect.

    python scripts/gpu_specforge.py all --store /tmp/store-bf16 --target /tmp/smol/model --work /tmp/sf \
        [--max-train-tokens 1500000] [--epochs 2] [--draft-vocab 16000] [--lr 1e-3] \
        [--eval-set mt-bench=/tmp/calib/calibration ...] [--draft NAME=EXPORT_DIR ...]
    or one phase at a time: convert | train-specforge | train-eaglenest | score (each reads what the earlier wrote)

The command line and the report; what is shared between the trainers, how SpecForge is driven and how both are
scored live in scripts/specforge_side_by_side.py (the flags are its Settings' fields).
Writes $OUT/specforge_side_by_side.json (settings, selection, per trainer tokens, steps, seconds, tokens/s and the
scores) and prints a table. Live SGLang: scripts/gpu_bench_grid.py --draft WORK/specforge-export (and
WORK/eaglenest-export) with --only eagle3 --baseline-json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, fields
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project root travels with the command

import torch
from specforge_side_by_side import (  # this script's folder is first on sys.path
    EN_EXPORT,
    SELECTION,
    SF_EXPORT,
    Settings,
    convert,
    export_specforge,
    score,
    select_samples,
    specforge_config,
    train_eaglenest,
    train_specforge,
)

from eaglenest.atomic import atomic_write_bytes
from eaglenest.store import open_samples


def table(report: dict) -> str:
    lines = ["| drafter | tokens | steps | fit s | tok/s | steady tok/s | set | AL/cycle @3 | @7 | acc0 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, sets in report.get("scores", {}).items():
        tr = report.get("train", {}).get(name, {})
        for set_name, r in sets.items():
            cyc = r["accept_length_cycles"]
            steady = tr.get("steady_tokens_per_s")
            lines.append(f"| {name} | {tr.get('tokens', '')} | {tr.get('steps', '')} | {tr.get('fit_s', 0):.1f} | "
                         f"{tr.get('tokens_per_s', 0):.0f} | {f'{steady:.0f}' if steady else ''} | {set_name} | "
                         f"{cyc.get('3', float('nan')):.3f} | {cyc.get(str(len(cyc)), float('nan')):.3f} | "
                         f"{r['step_acc'][0]:.3f} |")
    return "\n".join(lines)


def _versions() -> dict[str, str | None]:
    import importlib.metadata

    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {n: version(n) for n in ("torch", "transformers", "specforge", "datasets", "eaglenest")}


def _pairs(items: list[str], what: str) -> dict[str, str]:
    bad = [x for x in items if "=" not in x]
    if bad:
        raise SystemExit(f"{what} takes NAME=PATH, got {bad}")
    return dict(x.split("=", 1) for x in items)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("phase", choices=["all", "convert", "train-specforge", "train-eaglenest", "score"])
    for f in fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        kind = {"int": int, "float": float, "int | None": int, "bool": lambda v: v.lower() in ("1", "true", "yes")
                }.get(str(f.type), str)
        ap.add_argument(flag, type=kind, required=f.name in ("store", "target", "work"), default=f.default
                        if f.name not in ("store", "target", "work") else None)
    ap.add_argument("--eval-set", action="append", default=[], help="NAME=STORE_OR_EXTRACTION (repeatable)")
    ap.add_argument("--draft", action="append", default=[], help="NAME=SGLANG_EXPORT also scored (repeatable)")
    a = ap.parse_args(argv)
    s = Settings(**{f.name: getattr(a, f.name) for f in fields(Settings)})
    work = Path(s.work)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    report_path = out / "specforge_side_by_side.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() and a.phase != "all" else {}
    report.update(settings=asdict(s), command=" ".join(sys.argv), versions=_versions(), device=(
        torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"))
    atomic_write_bytes(work / "settings.json", json.dumps(asdict(s)).encode())
    store = open_samples(s.store, check_sha256=s.check_sha256)
    sel = select_samples(store, s)
    if a.phase in ("all", "convert"):
        report["convert"] = {k: v for k, v in convert(store, s, sel).items() if k != "selection"}
        print(f"converted {sel.tokens} tokens of {len(sel.indices)} samples (SpecForge batch {sel.batch_size} x "
              f"accumulation {sel.accumulation_steps}; eaglenest {sel.eaglenest_steps_per_epoch} steps/epoch)",
              flush=True)
    if a.phase in ("all", "train-specforge"):
        lm_head_key = json.loads((work / SELECTION).read_text())["lm_head_key"]
        sf = train_specforge(specforge_config(s, sel, lm_head_key), mean_tokens=sel.tokens / len(sel.indices))
        report.setdefault("train", {})["specforge"] = sf
        atomic_write_bytes(report_path, json.dumps(report, indent=1, default=str).encode())
        print(json.dumps({k: v for k, v in sf.items() if k != "log"}), flush=True)
        export_specforge(work)
    if a.phase in ("all", "train-eaglenest"):
        en = train_eaglenest(store, s, sel)
        report.setdefault("train", {})["eaglenest"] = en
        print(json.dumps(en), flush=True)
    atomic_write_bytes(report_path, json.dumps(report, indent=1, default=str).encode())
    if a.phase in ("all", "score"):
        drafts = {n: work / d for n, d in (("eaglenest", EN_EXPORT), ("specforge", SF_EXPORT)) if (work / d).is_dir()}
        drafts.update({n: Path(p) for n, p in _pairs(a.draft, "--draft").items()})
        report["scores"] = score(store, s, drafts, _pairs(a.eval_set, "--eval-set"))
        atomic_write_bytes(report_path, json.dumps(report, indent=1, default=str).encode())
        print(table(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
