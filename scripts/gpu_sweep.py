"""GPU machine: train several drafter configs at once on one GPU (one process each), no Prefect.

    python scripts/gpu_sweep.py --store STORE --target MODEL_DIR [--eval-set mt-bench=/tmp/calib/calibration ...]
        [--grid grid.json | --only base,lr3e-3] [--epochs 2] [--max-minutes 20] [--work /tmp/sweep]

Each config is the base recipe (``eaglenest train --draft-vocab 32000 --max-tokens 32768 --lr 1e-3``, TTT 7,
step-based schedule over --epochs) with a few fields changed: tokens per step (grad_accum), lr, epochs, TTT
length, draft vocabulary size. ``--grid`` is a JSON object {name: {TrainConfig field: value}} replacing the
preset grid. Every process evaluates the held-out ShareGPT split and every --eval-set (never trained on; a
calibration capture holding several prompt sets gives each key its own set) every --eval-every steps.
Run folders (checkpoints) stay in --work; $OUT gets sweep.json (per config: the overrides, the result's status,
steps, tokens, tokens/s, and the curves of accept length per verify cycle and per start against training
tokens per eval set) and sweep.png (accept length per cycle @3 and @7 against training tokens). --max-minutes
is a safety stop only: a config it cuts short says so in its result ("time_budget" and a note).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project root travels with the command

# 32K tokens a step: on scripts/bench_train.py's 512-token rows the H200 step costs what 16K does (0.145 vs 0.151 s:
# the host's kernel launches set its pace); one config trains at 143.6K tok/s, not 108.9K (results/2026-12-04-h200)
# eval_steps 7: every config is also scored seven draft steps deep, as deep as the 7-step trees served, whatever its TTT
BASE = {"draft_vocab_size": 32000, "max_tokens": 32768, "max_seq_len": 2048, "lr": 1e-3, "ttt_steps": 7,
        "eval_steps": 7, "device": "cuda", "save_every": 500, "log_every": 50, "threads": 2}
PRESET = {
    "base": {},
    "lr3e-4": {"lr": 3e-4},
    "lr3e-3": {"lr": 3e-3},
    "tok4x": {"grad_accum": 4},  # 4x tokens per optimizer step at the same data
    "ttt3": {"ttt_steps": 3},
    "vocab16k": {"draft_vocab_size": 16000},
}


def sweep_config(over: dict, schedule: dict, fixed: dict) -> dict:
    """One grid config's TrainConfig fields: BASE, the sweep's ``schedule`` (epochs, eval_every, max_minutes),
    the config's own ``over`` on both, then ``fixed`` (store, target, out_dir, eval sets: never the grid's).
    A config that continues a drafter (``init_from``) keeps that drafter's vocabulary unless it names one: BASE's
    32000 would contradict a 16000-token drafter (2026-12-06c: a continuation was refused for a size its grid
    never asked for)."""
    base = {k: v for k, v in BASE.items() if not (over.get("init_from") and k == "draft_vocab_size")}
    cfg = {**base, **schedule, **over, **fixed}
    if "eval_steps" not in over:  # never shallower than the config trains
        cfg["eval_steps"] = max(cfg["eval_steps"], cfg["ttt_steps"])
    return cfg


def planned_vocab(over: dict, target: str) -> int:
    """The draft vocabulary the trainer will use for one grid config (``over``) on ``target`` (a model folder)."""
    from eaglenest.drafter.train_state import planned_vocab_size
    from eaglenest.models import auto_device

    cfg = sweep_config(over, {}, {})
    init = cfg.get("init_from")
    own = json.loads((Path(init) / "config.json").read_text()).get("draft_vocab_size") if init else None
    vocab_size = json.loads((Path(target) / "config.json").read_text())["vocab_size"]
    return planned_vocab_size(cfg.get("draft_vocab_size"), own, vocab_size, auto_device(cfg["device"]))


def worker(config_path: str) -> int:
    import logging

    from eaglenest.drafter.config import TrainConfig
    from eaglenest.drafter.train import train

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    res = train(TrainConfig(**json.loads(Path(config_path).read_text())))
    print(json.dumps({k: v for k, v in res.to_dict().items() if k != "history"}), flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--store")
    ap.add_argument("--target")
    ap.add_argument("--eval-set", action="append", default=[], help="NAME=STORE_OR_EXTRACTION (repeatable)")
    ap.add_argument("--grid", help="JSON file {name: {field: value}} (default: the preset grid)")
    ap.add_argument("--only", help="comma-separated config names of the grid")
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--max-minutes", type=float, default=None, help="safety stop per config")
    ap.add_argument("--work", default="/tmp/sweep")
    ap.add_argument("--planned-vocab", action="store_true",
                    help="print the draft vocabulary size the grid's first config will train with (needs --target)")
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker)
    if a.planned_vocab:
        if not (a.grid and a.target):
            ap.error("--planned-vocab needs --grid and --target")
        print(planned_vocab(next(iter(json.loads(Path(a.grid).read_text()).values())), a.target))
        return 0
    if not (a.store and a.target):
        ap.error("--store and --target are required")
    from eaglenest.drafter.config import TrainConfig
    from eaglenest.drafter.report import eval_curves, plot_sweep

    out = Path(os.environ.get("OUT", "/tmp/out"))
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    grid = json.loads(Path(a.grid).read_text()) if a.grid else PRESET
    if a.only:
        grid = {k: grid[k] for k in a.only.split(",")}
    eval_sets = dict(x.split("=", 1) for x in a.eval_set)
    procs = {}
    configs = {}
    for name, over in grid.items():
        cfg = TrainConfig(**sweep_config(
            over, {"epochs": a.epochs, "eval_every": a.eval_every, "max_minutes": a.max_minutes},
            {"store": a.store, "target": a.target, "out_dir": str(work / name), "eval_sets": eval_sets}))
        configs[name] = cfg
        (work / f"{name}.json").write_text(cfg.model_dump_json())
        log = open(work / f"{name}.log", "ab")  # noqa: SIM115 (the child owns it until it exits)
        procs[name] = subprocess.Popen([sys.executable, __file__, "--worker", str(work / f"{name}.json")],
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        print(f"started {name}: {over} (pid {procs[name].pid})", flush=True)
    t0 = time.monotonic()
    try:
        while any(p.poll() is None for p in procs.values()):
            time.sleep(15)
            running = [n for n, p in procs.items() if p.poll() is None]
            print(f"{time.monotonic() - t0:.0f} s: running {running}", flush=True)
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
    report = {"command": " ".join(sys.argv), "base": BASE, "epochs": a.epochs, "eval_sets": eval_sets,
              "wall_s": round(time.monotonic() - t0, 1), "configs": {}}
    curves = {}
    for name, cfg in configs.items():
        run = Path(cfg.out_dir)
        result = json.loads((run / "result.json").read_text()) if (run / "result.json").is_file() else None
        curves[name] = eval_curves(run)
        report["configs"][name] = {
            "overrides": grid[name], "exit_code": procs[name].returncode,
            "result": {k: result.get(k) for k in ("status", "note", "step", "total_steps", "train_tokens",
                                                  "tokens_per_s", "train_seconds", "time_split")} if result else None,
            "curves": curves[name],
            "log_tail": (work / f"{name}.log").read_text(errors="replace")[-1500:] if not result else None}
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(report, indent=1))
    plot_sweep(curves, out / "sweep.png")
    for name, c in report["configs"].items():
        last = {s: {d: round(v, 3) for d, v in (pts[-1]["accept_length_cycles"] or {}).items() if d in ("3", "7")}
                for s, pts in c["curves"].items() if pts}
        print(name, c["result"] and c["result"]["status"], "accept length per cycle", last, flush=True)
        if c["log_tail"]:  # a config that wrote no result: why (its log stays in --work, which does not come back)
            print(f"{name} exited {c['exit_code']} without a result; its log ends:\n{c['log_tail']}", flush=True)
    return 0 if all(p.returncode == 0 for p in procs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
