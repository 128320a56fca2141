"""The Prefect ``extract`` flow against the session's real temporary Prefect API: a re-run does no engine work,
and a killed flow leaves no server process behind."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eaglenest.engines.pool import ServerRecords
from eaglenest.extraction.config import ExtractParams
from eaglenest.extraction.ledger import Ledger
from eaglenest.extraction.state import open_extraction
from tests.extract_helpers import assert_complete_and_exact

ROOT = Path(__file__).resolve().parents[2]


def read_artifacts(key):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as c:
        return c.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))


def test_flow_extracts_sharegpt_on_two_servers_then_reruns_with_zero_requests(prefect_api, tiny_model_dir, tmp_path,
                                                                                capture_servers):
    from flows.extract import extract

    params = ExtractParams(recipe="capture",
                           model=str(tiny_model_dir), limit=200, max_turns=1, max_tokens=512, batch_size=16,
                           concurrency=4, output_dir=str(tmp_path / "out"), extraction_id="flow-x",
                           request_timeout_s=60, shard_wait_s=1, store_url=str(tmp_path / "store"))
    ext_dir = open_extraction(params).dir
    servers = capture_servers(ext_dir / "capture", n=2)
    params = ExtractParams(**{**params.model_dump(), "server_urls": [u for u, _ in servers]})
    report = extract(params)
    assert report["samples"] >= 45  # real ShareGPT first turns that fit 512 tiny-model tokens
    assert_complete_and_exact(report, ext_dir)
    per_server = [e.stats["requests"] - 1 for _, e in servers]  # minus each readiness probe
    assert min(per_server) > 0 and sum(per_server) == report["samples"]  # split; none lost or doubled
    (summary,) = read_artifacts("extract-summary-flow-x")
    rows = {r["metric"]: r["value"] for r in json.loads(summary.data)}
    assert rows["done (total)"] == report["samples"] and rows["pending"] == 0 and rows["invalid"] == 0
    (progress,) = read_artifacts("extract-progress-flow-x")
    assert progress.data == pytest.approx(100.0)
    before = [e.stats["requests"] for _, e in servers]
    again = extract(params)
    assert [e.stats["requests"] for _, e in servers] == before  # the re-run sends zero requests
    assert again["run"]["requests"] == 0 and again["run"]["servers_launched"] == 0 and again["done"] == report["done"]
    # the store is the flow's last step: every validated sample, verified; the re-run converts nothing
    from eaglenest.store import open_store

    store = open_store(str(tmp_path / "store"), verify=True)
    assert sorted(store.sample_ids) == sorted(Ledger(ext_dir).entries()) and len(store) == report["done"]
    assert again["store"] == report["store"]


def _sigterm_flow_when(params, ready, extra_env):
    """Run the extract flow in a subprocess; SIGTERM it once ``ready(ext_dir)`` names the server pid; return
    that pid after the flow process exited."""
    from prefect.settings import PREFECT_API_URL

    ext_dir = open_extraction(params).dir
    code = ("import sys; from flows.extract import extract; from eaglenest.extraction.config import ExtractParams; "
            "extract(ExtractParams.model_validate_json(sys.argv[1]))")
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(ROOT), **extra_env}
    flow_proc = subprocess.Popen([sys.executable, "-c", code, params.model_dump_json()], cwd=ROOT, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline, server_pid = time.monotonic() + 180, None
        while server_pid is None and time.monotonic() < deadline and flow_proc.poll() is None:
            server_pid = ready(ext_dir)
            time.sleep(0.1)
        if server_pid is None:
            flow_proc.kill()
            pytest.fail("the flow never launched its server:\n" + flow_proc.stdout.read().decode()[-3000:])
        os.kill(flow_proc.pid, signal.SIGTERM)
        flow_proc.wait(timeout=60)
    finally:
        if flow_proc.poll() is None:
            os.killpg(flow_proc.pid, signal.SIGKILL)
    return server_pid


def _recorded_pid(ext_dir, *, after_shards=False):
    rec = ext_dir / "servers.json"
    pids = ServerRecords(rec).pids()
    if pids and (not after_shards or list((ext_dir / "capture").glob("*.safetensors"))):
        return pids[0]
    return None


def _assert_group_ends(pid, within_s=30):
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail(f"the server's process group {pid} survived the flow")


def _flow_state(extraction_id):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        runs = [r for r in c.read_flow_runs() if r.parameters.get("params", {}).get("extraction_id") == extraction_id]
    return runs[0].state.type.value if runs else None


def test_flow_sigterm_while_launching_ends_the_server_group(prefect_api, tiny_model_dir, tmp_path):
    """SIGTERM to the flow process while its embedded server subprocess starts: no orphaned server."""
    params = ExtractParams(recipe="capture",
                           model=str(tiny_model_dir), limit=20, max_turns=1, max_tokens=384, num_servers=1,
                           dtype="float32", output_dir=str(tmp_path / "out"), extraction_id="sig-launch")
    pid = _sigterm_flow_when(params, _recorded_pid, {})
    _assert_group_ends(pid)
    assert _flow_state("sig-launch") in ("CRASHED", "FAILED")


@pytest.mark.slow
def test_flow_sigterm_mid_prefill_ends_the_server_group(prefect_api, tiny_model_dir, tmp_path):
    """No orphaned server after SIGTERM mid-prefill: the server is serving (half of the requests hang) when the
    flow gets SIGTERM."""
    params = ExtractParams(recipe="capture",
                           model=str(tiny_model_dir), limit=40, max_turns=1, max_tokens=384, num_servers=1,
                           dtype="float32", output_dir=str(tmp_path / "out"), extraction_id="sig-prefill",
                           request_timeout_s=120, launch_timeout_s=120)
    pid = _sigterm_flow_when(params, lambda d: _recorded_pid(d, after_shards=True),
                             {"EAGLENEST_FAULTS": "hang_every=2,hang_s=5"})
    _assert_group_ends(pid)
    assert _flow_state("sig-prefill") in ("CRASHED", "FAILED")


def test_failed_samples_are_listed_in_a_problems_table_and_the_run_fails(prefect_api, tiny_model_dir, tmp_path,
                                                                          capture_servers, monkeypatch):
    """Requests that keep failing (no retries allowed) end the run Failed, each named with its reason in a
    table artifact; a re-run without the fault resumes only those samples."""
    from flows.extract import ExtractionIncomplete, extract

    params = ExtractParams(recipe="capture",
                           model=str(tiny_model_dir), limit=60, max_turns=1, max_tokens=384, batch_size=8,
                           concurrency=2, output_dir=str(tmp_path / "out"), extraction_id="flow-problems",
                           request_timeout_s=30, shard_wait_s=0.5, max_attempts=1, max_relaunch_rounds=0)
    ext_dir = open_extraction(params).dir
    monkeypatch.setenv("EAGLENEST_FAULTS", "fail_every=4,fail_status=500")
    ((url, _),) = capture_servers(ext_dir / "capture")
    params = ExtractParams(**{**params.model_dump(), "server_urls": [url]})
    with pytest.raises(ExtractionIncomplete, match="still pending"):
        extract(params)
    report = json.loads((ext_dir / "report.json").read_text())
    failed = report["run"]["failed"]
    assert failed > 0 and report["pending"] == failed
    (table,) = read_artifacts("extract-problems-flow-problems")
    rows = json.loads(table.data)
    assert len(rows) == failed and all(r["stage"] == "prefill" and r["kind"] and r["message"] for r in rows)
    assert {r["sample_id"] for r in rows}.isdisjoint(Ledger(ext_dir).entries())
    monkeypatch.delenv("EAGLENEST_FAULTS")
    ((url2, _),) = capture_servers(ext_dir / "capture")
    again = extract(ExtractParams(**{**params.model_dump(), "server_urls": [url2]}))
    assert again["run"]["requests"] == failed and again["pending"] == 0
