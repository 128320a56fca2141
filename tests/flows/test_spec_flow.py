"""The bench flow end to end on the embedded engine: two real server processes, report, artifacts, gate."""

from __future__ import annotations

import json

import pytest

from eaglenest.speculative import prompts as P
from eaglenest.speculative.bench import BenchConfig
from eaglenest.speculative.serve import SpecConfig


def test_config_validation_names_the_field(tmp_path):
    with pytest.raises(ValueError, match="counts the root"):
        BenchConfig(draft="d", num_steps=3, num_draft_tokens=3)
    with pytest.raises(ValueError, match="target_concurrency"):
        BenchConfig(draft="d", concurrencies=[1, 4], target_concurrency=16)
    depth = SpecConfig().num_steps  # the default depth
    assert BenchConfig(draft="d", engine="embedded", topk=2, num_draft_tokens=6).spec.shape.name == f"tree{depth}x2n5"
    assert BenchConfig(draft="d", engine="sglang", topk=2, num_steps=3, num_draft_tokens=6).spec.draft_tokens == 6


def test_bench_flow_fails_the_gate_with_a_clear_message(prefect_api, spec_tiny, tmp_path):
    from prefect.client.orchestration import get_client

    from flows.bench import bench

    runner, _, fitted, seqs, plens = spec_tiny
    token_file = P.write_token_file(tmp_path / "prompts.jsonl", P.PromptSet(name="tiny", source="test", prompts=[]),
                                    [s[:n] for s, n in zip(seqs, plens, strict=True)][:4])
    cfg = BenchConfig(engine="embedded", model=str(runner.model_dir), draft=str(fitted), prompt_file=str(token_file),
                      max_new_tokens=12, ignore_eos=True, concurrencies=[1, 2], target_concurrency=2,
                      requests_per_level=4, min_speedup=1000.0, output_dir=str(tmp_path / "out"), dtype="float32",
                      threads=1, onednn_baseline="onednn", onednn_eagle3="onednn", ready_timeout_s=120)
    state = bench(config=cfg, return_state=True)
    assert state.is_failed()
    with pytest.raises(Exception, match=r"at concurrency 2 .*threshold 1000.00x.*do NOT deploy"):
        state.result()
    out = tmp_path / "out"
    report = json.loads((out / "report.json").read_text())  # written before the gate judged
    assert [lv["concurrency"] for lv in report["eagle3"]["levels"]] == [1, 2]
    assert all(lv["errors"] == 0 and lv["accept_length"] > 1.2 for lv in report["eagle3"]["levels"])
    assert all(lv["accept_length"] is None for lv in report["baseline"]["levels"])
    assert (out / "tok_s.png").is_file() and (out / "accept_length.png").is_file()
    assert not (out / "servers.json").exists()  # every server process group was ended

    async def artifact_keys():
        async with get_client() as client:
            return {a.key for a in await client.read_artifacts()}

    import asyncio

    assert {"spec-bench-grid", "spec-bench-report", "spec-bench-tok-s"} <= asyncio.run(artifact_keys())
