"""The train flow on a real (temporary) Prefect API: artifacts, exports, and a cached re-run."""

from __future__ import annotations

import json
import shutil

from test_drafter_ddp import write_extraction

from eaglenest.drafter.config import TrainConfig


def test_train_flow_reports_exports_and_caches(prefect_api, tmp_path, tiny_model_dir, drafter_store):
    from prefect.client.orchestration import get_client

    from flows.train import TrainFlowParams, train_flow

    write_extraction(drafter_store, tmp_path / "ex")
    cfg = TrainConfig(store=str(tmp_path / "ex"), out_dir=str(tmp_path / "run"), target=str(tiny_model_dir),
                      draft_vocab_size=128, ttt_steps=2, max_steps=3, max_tokens=256, max_seq_len=128,
                      warmup_steps=1, eval_fraction=0.15, eval_max_samples=5, eval_every=2, precision="fp32",
                      threads=1)
    params = TrainFlowParams(train=cfg)
    out = train_flow(params)
    assert out["result"]["step"] == 3 and out["result"]["eval"]["anchors"] > 0
    assert (tmp_path / "run" / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "run/export/sglang/config.json").read_text())["architectures"] == [
        "LlamaForCausalLMEagle3"]
    spec = json.loads((tmp_path / "run/export/speculators/config.json").read_text())
    assert spec["speculators_model_type"] == "eagle3"
    metrics_before = (tmp_path / "run" / "metrics.jsonl").read_text()

    import asyncio

    async def artifact_keys():
        async with get_client() as client:
            return {a.key for a in await client.read_artifacts() if a.key}

    assert {"drafter-loss-curve", "drafter-training"} <= asyncio.run(artifact_keys())
    state = train_flow(params, return_state=True)
    assert state.is_completed() and state.result()["result"] == out["result"]
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics_before  # training did not run again

    shutil.rmtree(tmp_path / "run")  # outputs gone (deleted, other disk): the cache must not pretend they exist
    again = train_flow(params)
    assert again["result"]["step"] == 3 and (tmp_path / "run" / "metrics.jsonl").is_file()
    assert (tmp_path / "run/export/sglang/model.safetensors").is_file()
