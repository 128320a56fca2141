"""Real SmolLM2-135M-Instruct + real ShareGPT through the Prefect flow (slow: minutes on 2 cores)."""

import pytest

from eaglenest.extraction.config import ExtractParams
from eaglenest.extraction.state import open_extraction
from tests.extract_helpers import assert_complete_and_exact, ledger_lines

pytestmark = pytest.mark.slow


def test_flow_extracts_real_sharegpt_with_smollm2_twice(prefect_api, tmp_path):
    from flows.extract import extract

    params = ExtractParams(recipe="capture",
                           limit=60, max_turns=1, max_tokens=1024, num_servers=1, batch_size=16, concurrency=8,
                           output_dir=str(tmp_path / "out"), extraction_id="smol")
    report = extract(params)
    ext = open_extraction(params)
    assert report["samples"] >= 40 and report["run"]["servers_launched"] == 1
    assert_complete_and_exact(report, ext.dir)
    e = ledger_lines(ext.dir)[0]
    assert e["bytes"] > e["num_tokens"] * 3 * 576 * 2  # 3 aux layers of H=576 in bf16 (+ final)
    again = extract(params)
    assert again["run"]["requests"] == 0 and again["run"]["servers_launched"] == 0  # zero engine work


@pytest.mark.timeout(1200)  # SmolLM2 decodes one answer at a time on the CPU: minutes for 4 answers
def test_regeneration_with_smollm2_agrees_with_its_lm_head(tmp_path):
    from eaglenest.extraction.run import run_extraction

    params = ExtractParams(limit=4, max_turns=1, max_tokens=768, num_servers=1, output_dir=str(tmp_path / "out"),
                           extraction_id="regen", regeneration={"enabled": True, "max_new_tokens": 192})
    report = run_extraction(params)
    r = report["run"]
    assert report["complete"] and r["regenerated"] > 0
    assert r["regenerated"] == report["samples"]  # cut answers are kept (the target's own tokens)
    assert report["run"]["argmax_agreement"] >= 0.9  # the capture predicts the target's own greedy tokens
