"""The repository's deployments end to end: a real `prefect server start`, the pool script, `prefect deploy`
of deployments/prefect.yaml, a process worker, and runs started through the API: a re-run does no work,
a killed flow run ends Crashed and its re-run is idempotent.

One module-scoped stack (server ~10 s, deploy ~10 s, worker ~2 s); default tests ~90 s in all, the pipeline
test is marked slow (~85 s more). It does NOT use the session
``prefect_api`` fixture: its own server's URL is set for this module through ``temporary_settings`` (client
calls here) and the subprocesses' environment. Faults are planted with a gate file
(``EAGLENEST_FAULTS=...,gate=PATH`` in the worker's environment, inherited by the servers the flows launch),
so a run's parameters never change between the failure and the retry.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from eaglenest.engines.pool import ServerRecords
from tests.extract_helpers import ledger_ids

ROOT = Path(__file__).resolve().parents[2]
PREFECT_FILE = ROOT / "deployments" / "prefect.yaml"
PROCESS_POOL = "gpu-process"
FAULTS = "fail_every=3"  # request n % 3 == 0 is answered 503 while the gate file exists
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_group(proc: subprocess.Popen, grace_s: float = 15) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    except ProcessLookupError:
        pass


def _tail(path: Path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:] if path.is_file() else f"(no {path.name})"


class Stack:
    """The live server + worker, and helpers that talk to them the way a user (or the UI) does."""

    def __init__(self, api_url: str, env: dict, logs: Path, gate: Path, worker: subprocess.Popen):
        self.api_url, self.env, self.logs, self.gate, self.worker = api_url, env, logs, gate, worker

    def client(self):
        from prefect.client.orchestration import get_client

        return get_client(sync_client=True)

    def start(self, deployment: str, parameters: dict) -> str:
        from prefect.deployments import run_deployment

        run = run_deployment(deployment, parameters=parameters, timeout=0)
        return str(run.id)

    def state(self, run_id: str):
        with self.client() as c:
            return c.read_flow_run(run_id).state

    def wait(self, run_id: str, timeout_s: float = 240, states=FINAL) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            st = self.state(run_id)
            if st is not None and st.type.value in states:
                return st.type.value
            assert self.worker.poll() is None, "the worker died:\n" + _tail(self.logs / "worker.log")
            time.sleep(1)
        pytest.fail(f"flow run {run_id} not in {states} after {timeout_s} s (now {self.state(run_id)}):\n"
                    + _tail(self.logs / "worker.log"))

    def retry_like_the_ui(self, run_id: str) -> None:
        """Exactly what the Prefect UI's Retry button sends (prefect-ui-library WorkspaceFlowRunsApi.retryFlowRun):
        POST /flow_runs/{id}/set_state with a Scheduled state named AwaitingRetry and force=true."""
        body = {"state": {"type": "SCHEDULED", "name": "AwaitingRetry", "message": "Retry from the UI"}, "force": True}
        r = httpx.post(f"{self.api_url}/flow_runs/{run_id}/set_state", json=body, timeout=30)
        r.raise_for_status()
        assert r.json()["status"] == "ACCEPT", r.json()

    def artifacts(self, run_id: str):
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

        with self.client() as c:
            return c.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))


def _deployable(tmp: Path) -> Path:
    """The repo's prefect.yaml, minus deployments whose entrypoint file this checkout lacks (flows land on main
    one by one); the deployments that remain are deployed exactly as written."""
    spec = yaml.safe_load(PREFECT_FILE.read_text())
    spec["deployments"] = [d for d in spec["deployments"] if (ROOT / d["entrypoint"].split(":")[0]).is_file()]
    out = tmp / "prefect.yaml"
    out.write_text(yaml.safe_dump(spec, sort_keys=False))
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    tmp = tmp_path_factory.mktemp("deploy-e2e")
    logs, port = tmp / "logs", _free_port()
    logs.mkdir()
    api_url = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "EAGLENEST_FAULTS"))}
    env.update(PREFECT_HOME=str(tmp / "prefect-home"), PREFECT_API_URL=api_url,
               PREFECT_SERVER_ANALYTICS_ENABLED="false", PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false")
    prefect = [sys.executable, "-m", "prefect"]
    procs: list[subprocess.Popen] = []

    def popen(cmd, log, extra=None):
        p = subprocess.Popen(cmd, cwd=ROOT, env={**env, **(extra or {})}, stdout=(logs / log).open("wb"),
                             stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(p)
        return p

    try:
        server = popen([*prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)], "server.log")
        deadline = time.monotonic() + 90
        while True:
            assert server.poll() is None, "prefect server exited:\n" + _tail(logs / "server.log")
            try:
                if httpx.get(f"{api_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "prefect server not healthy in 90 s:\n" + _tail(logs / "server.log")
            time.sleep(0.5)
        for cmd in ([sys.executable, "deployments/setup_pools.py"],
                    [*prefect, "--no-prompt", "deploy", "--all", "--prefect-file", str(_deployable(tmp))]):
            done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
            assert done.returncode == 0, f"{cmd} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        gate = tmp / "fault-gate"
        worker = popen([*prefect, "worker", "start", "--pool", PROCESS_POOL, "--type", "process"], "worker.log",
                       {"PREFECT_WORKER_QUERY_SECONDS": "2", "EAGLENEST_ROOT": str(ROOT),  # only the worker knows it
                        "EAGLENEST_FAULTS": f"{FAULTS},gate={gate}"})
        with temporary_settings({PREFECT_API_URL: api_url}):
            yield Stack(api_url, env, logs, gate, worker)
    finally:
        for p in reversed(procs):
            _stop_group(p)


def test_pools_and_deployments_are_as_the_yaml_says(stack):
    """setup_pools gave both pools a concurrency limit of 1 (and stays idempotent); every deployment of the
    yaml whose flow exists is registered on its pool with the parameter schema enforced; the docker pool's
    job template carries GPU device requests and shm size that docker-py accepts."""
    import docker.types
    from prefect.utilities.templating import apply_values

    again = subprocess.run([sys.executable, "deployments/setup_pools.py"], cwd=ROOT, env=stack.env,
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and again.stdout.count("unchanged") == 3, again.stdout + again.stderr
    spec = yaml.safe_load(PREFECT_FILE.read_text())
    with stack.client() as c:
        pools = {p: c.read_work_pool(p) for p in ("gpu-process", "gpu-docker")}
        assert {p.concurrency_limit for p in pools.values()} == {1}
        assert c.read_work_pool("eaglenest-control").concurrency_limit is None  # fan-out waits there, unlimited
        assert pools["gpu-docker"].type == "docker" and pools["gpu-process"].type == "process"
        deployed = {f"{_flow_name(x)}/{x['name']}": c.read_deployment_by_name(f"{_flow_name(x)}/{x['name']}")
                    for x in spec["deployments"] if (ROOT / x["entrypoint"].split(":")[0]).is_file()}
    assert {"extract/extract-gpu-process", "extract/extract-gpu-docker", "train/train-gpu-docker",
            "bench/bench-gpu-process", "pipeline/pipeline-gpu-process", "pipeline/pipeline-gpu-docker",
            "pipeline-fanout/pipeline-fanout-control"} <= set(deployed)
    weekly = deployed["pipeline/pipeline-weekly-reextract-schedule-off"]
    assert weekly.parameters == {"params": {"fresh_extraction_id": True}}
    assert [(s.schedule.cron, s.active) for s in weekly.schedules] == [("0 3 * * 0", False)]  # off until configured
    assert all(d.enforce_parameter_schema for d in deployed.values())
    docker_dep = deployed["extract/extract-gpu-docker"]
    assert docker_dep.work_pool_name == "gpu-docker" and docker_dep.pull_steps == [
        {"prefect.deployments.steps.set_working_directory": {"directory": "/opt/eaglenest"}}]
    assert deployed["extract/extract-gpu-process"].pull_steps == [  # EAGLENEST_ROOT is read on the worker at run time
        {"deployments.steps.set_working_directory_from_env": {"variable": "EAGLENEST_ROOT"}}]
    # what the docker worker would build: the pool's job configuration with this deployment's job variables
    tpl = pools["gpu-docker"].base_job_template
    defaults = {k: v.get("default") for k, v in tpl["variables"]["properties"].items()}
    job = apply_values(tpl["job_configuration"], {**defaults, **docker_dep.job_variables})
    kwargs = job["container_create_kwargs"]
    assert job["image"] == "eaglenest:0.1.0" and kwargs["shm_size"] == "32g"
    host = docker.types.HostConfig(version="1.44", shm_size=kwargs["shm_size"], ipc_mode=kwargs["ipc_mode"],
                                   device_requests=kwargs["device_requests"])
    assert host["ShmSize"] == 32 << 30 and host["DeviceRequests"][0]["Capabilities"] == [["gpu"]]
    assert host["DeviceRequests"][0]["Count"] == -1  # every GPU of the host


def _flow_name(dep: dict) -> str:
    return {"flows/extract.py:extract": "extract", "flows/train.py:train_flow": "train",
            "flows/bench.py:bench": "bench", "flows/pipeline.py:pipeline": "pipeline",
            "flows/pipeline.py:pipeline_fanout": "pipeline-fanout"}[dep["entrypoint"]]


def _extract_params(model_dir, out: Path, extraction_id: str, **kw) -> dict:
    return {"recipe": "capture",
            "source": "sharegpt", "limit": 16, "max_turns": 1, "max_tokens": 384, "model": str(model_dir),
            "dtype": "float32", "batch_size": 4, "concurrency": 2, "output_dir": str(out),
            "extraction_id": extraction_id, "request_timeout_s": 30, "backoff_s": 0.01, "shard_wait_s": 1,
            "launch_timeout_s": 120, **kw}


def test_planted_extraction_failure_then_ui_retry_resumes_without_redoing_batches(stack, tiny_model_dir, tmp_path):
    """b: the gate is planted, the extract deployment's run fails (every 3rd request 503, one attempt, no resend
    rounds); the gate is lifted; Retry exactly as the UI sends it; the same run completes, sending only the
    requests of the samples left pending; the ledger holds every sample exactly once."""
    out = tmp_path / "out"
    params = _extract_params(tiny_model_dir, out, "e2e-retry", max_attempts=1, max_relaunch_rounds=0)
    stack.gate.touch()
    try:
        run_id = stack.start("extract/extract-gpu-process", {"params": params})
        assert stack.wait(run_id) == "FAILED", _tail(stack.logs / "worker.log")
    finally:
        stack.gate.unlink(missing_ok=True)
    ext_dir = out / "e2e-retry"
    first = json.loads((ext_dir / "report.json").read_text())
    pending = first["pending"]
    assert first["run"]["failed"] == pending > 0 and first["done"] == len(ledger_ids(ext_dir)) > 0
    assert first["samples"] == first["done"] + pending
    stack.retry_like_the_ui(run_id)
    assert stack.wait(run_id) == "COMPLETED", _tail(stack.logs / "worker.log")
    second = json.loads((ext_dir / "report.json").read_text())
    assert second["run"]["requests"] == pending  # only the pending samples were sent again: no batch redone
    assert second["run"]["failed"] == 0 and second["pending"] == 0 and second["complete"]
    ids = ledger_ids(ext_dir)
    assert len(ids) == len(set(ids)) == second["samples"] == first["samples"]
    with stack.client() as c:
        states = [s.name for s in c.read_flow_run_states(run_id)]
    assert "AwaitingRetry" in states and states[-1] == "Completed"  # one flow run, retried in place


def _pipeline_params(model_dir, run_dir: Path) -> dict:
    """The whole pipeline on the embedded default at tiny size (tiny random Llama, ~40 real ShareGPT prompts: enough
    that a SIGTERM sent once the first samples are ledgered lands mid-extraction, not after its last sample)."""
    return {"params": {
        "run_dir": str(run_dir),
        "extract": {"recipe": "capture",
                    "model": str(model_dir), "limit": 300, "max_turns": 1, "max_tokens": 384, "batch_size": 4,
                    "concurrency": 2, "dtype": "float32", "request_timeout_s": 30, "launch_timeout_s": 120,
                    "shard_wait_s": 1, "extraction_id": "e2e-pipe"},
        "train": {"max_steps": 4, "max_tokens": 1024, "max_seq_len": 384, "draft_vocab_size": 128, "ttt_steps": 2,
                  "eval_every": 0, "save_every": 2, "eval_max_samples": 2, "eval_fraction": 0.25, "device": "cpu",
                  "precision": "fp32", "threads": 1, "max_minutes": None},
        "export_formats": ["sglang"],
        "bench": {"num_prompts": 2, "max_new_tokens": 8, "ignore_eos": True, "concurrencies": [1, 2],
                  "target_concurrency": 1, "min_speedup": 0.0, "dtype": "float32", "threads": 1,
                  "ready_timeout_s": 120},
    }}


def _flow_pid(stack: Stack, run_id: str, timeout_s: float = 60) -> int:
    """The flow-run process's PID, as the process worker records it (infrastructure_pid = "<host>:<pid>")."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with stack.client() as c:
            infra = c.read_flow_run(run_id).infrastructure_pid
        if infra:
            return int(str(infra).rsplit(":", 1)[-1])
        time.sleep(0.2)
    pytest.fail(f"the worker never recorded the flow run's pid:\n{_tail(stack.logs / 'worker.log')}")


def _states(stack: Stack, run_id: str) -> str:
    """The run's and its subflows' state history (for failure messages)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    with stack.client() as c:
        runs = [c.read_flow_run(run_id), *c.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run_id])))]
        return "\n".join(f"{r.name} ({r.id}): " + " -> ".join(f"{s.name}[{(s.message or '')[:300]}]"
                                                            for s in c.read_flow_run_states(r.id)) for r in runs)


def _group_gone(pid: int, within_s: float = 30) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow  # ~85 s more on 2 busy cores: the whole pipeline (extract, convert, train, export, bench) twice
def test_pipeline_sigterm_mid_extraction_crashes_then_rerun_completes_with_artifacts(stack, tiny_model_dir, tmp_path):
    """The pipeline's flow process gets SIGTERM once the extraction has ledgered some samples -> the
    run is Crashed (read through the API) and the servers it launched are gone (no orphans); then a run_deployment
    of the same parameters completes every stage, resuming the extraction (no ledgered sample is requested
    again), and publishes its artifacts: extraction progress at 100 %, tables, PNG plots."""
    params = _pipeline_params(tiny_model_dir, tmp_path / "run")
    ext_dir = tmp_path / "run" / "extractions" / "e2e-pipe"
    run_id = stack.start("pipeline/pipeline-gpu-process", params)
    pid = _flow_pid(stack, run_id)
    deadline = time.monotonic() + 180
    while not (ext_dir / "ledger.jsonl").is_file() or not ledger_ids(ext_dir):
        assert stack.state(run_id).type.value not in FINAL, "the run ended before it could be killed mid-extraction"
        assert time.monotonic() < deadline, "no sample ledgered in 180 s:\n" + _tail(stack.logs / "worker.log")
        time.sleep(0.1)
    server_pids = ServerRecords(ext_dir / "servers.json").pids()
    os.kill(pid, signal.SIGTERM)
    assert stack.wait(run_id, timeout_s=60) == "CRASHED", _states(stack, run_id)
    assert server_pids and all(_group_gone(p) for p in server_pids)  # no orphaned capture server
    kept = len(ledger_ids(ext_dir))

    again = stack.start("pipeline/pipeline-gpu-process", params)
    assert stack.wait(again, timeout_s=420) == "COMPLETED", _tail(stack.logs / "worker.log")
    summary = json.loads((tmp_path / "run" / "pipeline.json").read_text())
    assert [summary[s]["skipped"] for s in ("extract", "convert", "train", "export", "bench")] == [False] * 5
    report = json.loads((ext_dir / "report.json").read_text())
    assert report["complete"] and report["run"]["requests"] <= report["samples"] - kept  # resumed, nothing redone
    ids = ledger_ids(ext_dir)
    assert len(ids) == len(set(ids)) == report["samples"] == summary["convert"]["samples"]
    assert summary["bench"]["speedups"] and (tmp_path / "run" / "export" / "sglang" / "model.safetensors").is_file()

    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    with stack.client() as c:
        children = c.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[again])))
    runs = [again, *(str(r.id) for r in children)]
    arts = [a for r in runs for a in stack.artifacts(r)]
    by_type: dict[str, list] = {}
    for a in arts:
        by_type.setdefault(a.type, []).append(a)
    progress = [a for a in by_type.get("progress", []) if a.key == "extract-progress-e2e-pipe"]
    assert progress and float(progress[-1].data) == pytest.approx(100.0)
    tables = {a.key for a in by_type.get("table", [])}
    assert {"extract-summary-e2e-pipe", "drafter-training", "spec-bench-grid"} <= tables
    images = by_type.get("image", [])
    assert {"drafter-loss-curve"} <= {a.key for a in images} and len(images) >= 2  # loss curve + bench plots
    assert all(str(a.data).startswith("data:image/png;base64,") for a in images)
