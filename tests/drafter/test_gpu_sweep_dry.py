"""scripts/gpu_sweep.py's CPU dry run: two configs train at once in their own processes on a real extraction
folder, every eval set is scored, and sweep.json + sweep.png come out (what the GPU run writes to $OUT)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # two training processes on the tiny model: ~1-2 min on a shared 2-core machine
def test_sweep_dry_run_on_the_cpu(tiny_extract_params, capture_servers, tmp_path, tiny_model_dir):
    from eaglenest.extraction.run import run_extraction
    from eaglenest.extraction.state import open_extraction

    params = tiny_extract_params.model_copy(update={"limit": 80})
    ext = open_extraction(params).dir
    ((url, _),) = capture_servers(ext / "capture")
    report = run_extraction(params.model_copy(update={"server_urls": [url]}))
    assert report["done"] >= 10
    tiny = {"device": "cpu", "max_steps": 3, "draft_vocab_size": 200, "max_tokens": 512, "max_seq_len": 512,
            "threads": 1, "eval_fraction": 0.2, "eval_max_samples": 4}
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps({"a": tiny, "b": {**tiny, "lr": 3e-3, "ttt_steps": 2}}))
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, str(ROOT / "scripts/gpu_sweep.py"), "--store", str(ext), "--target",
                          str(tiny_model_dir), "--grid", str(grid), "--eval-set", f"other={ext}", "--eval-every", "2",
                          "--work", str(tmp_path / "work")], env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    sweep = json.loads((out / "sweep.json").read_text())
    assert set(sweep["configs"]) == {"a", "b"}
    for c in sweep["configs"].values():
        assert c["result"]["status"] == "done" and c["result"]["step"] == 3
        assert set(c["curves"]) == {"heldout", "other"}
        assert [p["step"] for p in c["curves"]["other"]] == [2, 3] and c["curves"]["other"][0]["train_tokens"] > 0
    assert (out / "sweep.png").stat().st_size > 1000


def test_a_continued_config_keeps_its_drafters_vocabulary():
    """The sweep's base vocabulary (32000) reaches only fresh configs: a continuation that names no vocabulary
    leaves it unset, so the trainer keeps the drafter's own (a 16000-token drafter was refused before)."""
    import runpy

    from eaglenest.drafter.config import TrainConfig

    script = runpy.run_path(str(ROOT / "scripts" / "gpu_sweep.py"))
    sweep_config, base = script["sweep_config"], script["BASE"]
    schedule = {"epochs": 2.0, "eval_every": 200, "max_minutes": 5.0}
    fixed = {"store": "/s", "target": "/t", "out_dir": "/o", "eval_sets": {}}
    fresh = TrainConfig(**sweep_config({"lr": 2e-3}, schedule, fixed))
    assert fresh.draft_vocab_size == base["draft_vocab_size"] and fresh.lr == 2e-3
    cont = TrainConfig(**sweep_config({"lr": 3e-4, "init_from": "/d/n12"}, schedule, fixed))
    assert cont.draft_vocab_size is None and cont.init_from == "/d/n12" and cont.epochs == 2.0
    named = TrainConfig(**sweep_config({"init_from": "/d/n12", "draft_vocab_size": 16000}, schedule, fixed))
    assert named.draft_vocab_size == 16000
    # the grid may change the schedule, never where the run reads and writes
    over = TrainConfig(**sweep_config({"epochs": 1.2, "out_dir": "/elsewhere"}, schedule, fixed))
    assert over.epochs == 1.2 and over.out_dir == "/o"


def test_the_planned_vocabulary_is_the_trainers(tmp_path, monkeypatch):
    """--planned-vocab (what gpu_session's KL_AB times) follows the trainer's one rule: BASE's 32000 for a fresh
    config, a continued drafter's own unless the config asks for more, never more than the target's vocabulary."""
    import runpy

    from eaglenest.drafter.train_state import planned_vocab_size

    planned = runpy.run_path(str(ROOT / "scripts" / "gpu_sweep.py"))["planned_vocab"]
    target, drafter = tmp_path / "target", tmp_path / "n13"
    for folder, cfg in ((target, {"vocab_size": 49152}), (drafter, {"draft_vocab_size": 16000})):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(cfg))
    assert planned({}, str(target)) == 32000
    assert planned({"draft_vocab_size": 8000}, str(target)) == 8000
    assert planned({"init_from": str(drafter)}, str(target)) == 16000
    assert planned({"init_from": str(drafter), "draft_vocab_size": 32000}, str(target)) == 32000
    assert planned_vocab_size(None, None, 500, "cuda") == 500 and planned_vocab_size(None, None, 49152, "cpu") == 8192
    # "auto" resolves as the trainer does (this machine: no GPU)
    assert planned({"device": "auto", "draft_vocab_size": None}, str(target)) == 8192
    import torch

    from eaglenest.models import auto_device

    assert auto_device("auto") == "cpu" and auto_device("cuda:1") == "cuda:1"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # one rule: a visible GPU turns "auto" into cuda
    assert auto_device("auto") == "cuda" and auto_device("cpu") == "cpu"
    assert planned({"device": "auto", "draft_vocab_size": None}, str(target)) == 32000


def test_the_sweep_scores_seven_steps_deep_and_never_shallower_than_it_trains():
    import runpy

    sweep_config = runpy.run_path(str(ROOT / "scripts" / "gpu_sweep.py"))["sweep_config"]
    assert sweep_config({"ttt_steps": 4}, {}, {})["eval_steps"] == 7
    assert sweep_config({"ttt_steps": 10}, {}, {})["eval_steps"] == 10
    assert sweep_config({"ttt_steps": 4, "eval_steps": 5}, {}, {})["eval_steps"] == 5
