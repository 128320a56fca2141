"""Injected faults during extraction (a killed writer, a server that never gets healthy, dies, hangs or answers
503, a wrong capture, NaN hidden states); each asserts nothing accepted is lost."""

import json
import os
import sys
import time
from collections import Counter
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save as st_save

from eaglenest import contract
from eaglenest.atomic import atomic_write_bytes
from eaglenest.engines.pool import LaunchError, ServerProcess, embedded_command
from eaglenest.engines.preflight import PreflightError
from eaglenest.engines.runtime import Captured
from eaglenest.engines.server_pool import LaunchSpec, ServerPool
from eaglenest.extraction.run import GIL_SWITCH_S, run_extraction
from eaglenest.extraction.state import open_extraction
from tests.extract_helpers import ThreadServer, assert_complete_and_exact, ledger_ids, with_


def group_gone(pid):
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_server_that_never_becomes_healthy_fails_bounded_with_its_log(tmp_path):
    child = "import time; time.sleep(120)"
    fake = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); "
            "print('fake server: loading forever', flush=True); time.sleep(120)")

    def make(port):
        return ServerProcess(cmd=[sys.executable, "-c", fake], url=f"http://127.0.0.1:{port}",
                             log_path=tmp_path / "fake.log")

    pool = ServerPool(specs=[LaunchSpec("fake", make)], launch_timeout_s=2, record_path=tmp_path / "servers.json")
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match="not ready after 2 s") as err:
        pool.start()
    assert time.monotonic() - t0 < 20  # bounded: the launch timeout plus the group's grace
    assert "fake server: loading forever" in str(err.value)  # the log tail says why
    leader = pool._owned[0].process.pid
    assert group_gone(leader)  # leader and its child, the whole process group
    assert not (tmp_path / "servers.json").exists()  # the record is cleared with the last server


def test_server_going_away_mid_run_is_relaunched_and_nothing_is_lost(tiny_extract_params, tiny_runner):
    """A server dying mid-batch, on in-thread servers (the subprocess + os._exit version is marked slow below)."""
    params = with_(tiny_extract_params, batch_size=32, concurrency=4)
    ext = open_extraction(params)
    launched = []

    def make(port):
        launched.append(ThreadServer(tiny_runner, ext.capture_dir, port, stop_after=6 if not launched else None))
        return launched[-1]

    pool = ServerPool(specs=[LaunchSpec("t", make)], launch_timeout_s=30, max_relaunches=2)
    seen = []
    report = run_extraction(params, pool=pool, on_progress=seen.append)
    assert_complete_and_exact(report, ext.dir)
    assert len(launched) == 2 and report["run"]["relaunches"] == 1
    (why,) = report["run"]["servers_taken_out"]  # the dead one (its /health refused too), and why
    assert "connection failed" in why and report["run"]["streaks_survived"] == 0
    # the samples it left are retried, not failed: the progress (its last line forced) never showed them as failed
    assert seen and all(p.failed == 0 for p in seen) and seen[-1].retrying == 0
    computed = sum(s.engine.stats["requests"] - 1 for s in launched)  # minus each readiness probe
    assert computed == report["samples"]  # each sample computed once: none lost, none redone
    assert not any(s.alive() for s in launched)


@pytest.mark.slow
def test_subprocess_server_dying_mid_run_is_relaunched_and_nothing_is_lost(tiny_extract_params):
    """Rows 1 + 9: the server process exits abruptly (os._exit) while answering and writing shards."""
    params = with_(tiny_extract_params, batch_size=32, concurrency=4, max_relaunch_rounds=2)
    ext = open_extraction(params)
    launches = []

    def make(port):
        env = {"EAGLENEST_FAULTS": "exit_after=7"} if not launches else {}  # the relaunch is healthy
        cmd = embedded_command(model=str(ext.model_dir), port=port, capture_dir=str(ext.capture_dir),
                               dtype="float32")
        proc = ServerProcess(cmd=cmd, url=f"http://127.0.0.1:{port}", log_path=ext.path(f"logs/s{len(launches)}.log"),
                             env=env)
        launches.append(proc)
        return proc

    pool = ServerPool(specs=[LaunchSpec("s", make)], launch_timeout_s=120, max_relaunches=2,
                      record_path=ext.path("servers.json"))
    report = run_extraction(params, pool=pool)
    assert_complete_and_exact(report, ext.dir)
    assert len(launches) == 2 and report["run"]["relaunches"] == 1
    assert launches[0].proc.returncode == 17  # it really died by the injected exit
    assert all(group_gone(p.pid) for p in launches)
    assert report["run"]["retries"] + report["run"]["requests"] >= report["samples"]


def test_transient_503_every_kth_request_is_retried(tiny_extract_params, capture_servers, monkeypatch):
    ext = open_extraction(tiny_extract_params)
    monkeypatch.setenv("EAGLENEST_FAULTS", "fail_every=3")
    ((url, engine),) = capture_servers(ext.capture_dir)
    report = run_extraction(with_(tiny_extract_params, server_urls=[url]))
    assert_complete_and_exact(report, ext.dir)
    run = report["run"]
    assert run["retries"] > 0 and run["requests"] == report["samples"] + run["retries"]
    assert run["retry_errors"] == {"server_error HTTP 503": run["retries"]}
    assert engine.stats["requests"] == report["samples"] + 1  # 503s never reached the engine; +1 probe


def test_hung_requests_time_out_and_are_retried(tiny_extract_params, capture_servers, monkeypatch):
    tiny_extract_params = with_(tiny_extract_params, limit=50)
    ext = open_extraction(tiny_extract_params)
    monkeypatch.setenv("EAGLENEST_FAULTS", "hang_every=4,hang_s=5")
    ((url, _),) = capture_servers(ext.capture_dir)
    params = with_(tiny_extract_params, server_urls=[url], request_timeout_s=2.5)
    t0 = time.monotonic()
    report = run_extraction(params)
    assert_complete_and_exact(report, ext.dir)
    assert report["run"]["retries"] >= report["samples"] // 4 - 1
    assert time.monotonic() - t0 < 60  # no unbounded wait


def _corrupt_writes(engine, corrupt, times):
    """Make the engine write a corrupted shard for each rid's first ``times`` captures."""
    real, seen = engine._write, Counter()

    def write(w, cap):
        seen[w.rid] += 1
        return corrupt(real, w, cap) if seen[w.rid] <= times else real(w, cap)

    engine._write = write
    return seen, real


def plant_nan(real, w, cap):
    aux = cap.aux_hidden.clone()
    aux[len(w.input_ids) // 2, 3] = float("nan")
    meta = {"schema_version": "1", "sample_id": w.rid, "provenance": real.__self__.provenance.to_json()}
    data = st_save({"input_ids": torch.tensor(w.input_ids, dtype=torch.int32), "aux_hidden": aux,
                    "final_hidden": cap.final_hidden}, metadata=meta)
    atomic_write_bytes(real.__self__.capture_dir / contract.shard_filename(w.rid), data)
    return None  # like SGLang: no capture meta in the answer


def drop_last_row(real, w, cap):
    real(replace(w, input_ids=w.input_ids[:-1]), Captured(cap.aux_hidden[:-1], cap.final_hidden[:-1]))
    return None


def test_planted_nan_is_quarantined_requeued_once_and_recovered(tiny_extract_params, capture_servers):
    ext = open_extraction(tiny_extract_params)
    ((url, engine),) = capture_servers(ext.capture_dir)
    seen, _ = _corrupt_writes(engine, plant_nan, times=1)
    report = run_extraction(with_(tiny_extract_params, server_urls=[url]))
    assert_complete_and_exact(report, ext.dir)  # nothing lost
    assert report["run"]["requeued"] == report["samples"] and set(seen.values()) == {2}  # re-sent exactly once
    reasons = [json.loads(p.read_text()) for p in (ext.dir / "quarantine").glob("*.reason.json")]
    assert len(reasons) == report["samples"] and all(r["kind"] == "nonfinite" for r in reasons)
    assert all("non-finite value in aux_hidden" in r["reason"] for r in reasons)


def test_short_capture_every_time_is_terminal_after_one_resend(tiny_extract_params, capture_servers):
    params = with_(tiny_extract_params, limit=40)
    ext = open_extraction(params)
    ((url, engine),) = capture_servers(ext.capture_dir)
    seen, real_write = _corrupt_writes(engine, drop_last_row, times=99)
    report = run_extraction(with_(params, server_urls=[url]))
    n = report["samples"]
    assert report["done"] == 0 and report["run"]["invalid"] == n and report["pending"] == n
    assert set(seen.values()) == {2}  # one re-send, then terminal: no retry storm
    assert all("rows, the request had" in p["message"] for p in report["problems"])
    assert not list(ext.capture_dir.glob("*.safetensors"))  # nothing wrong is kept
    engine._write = real_write  # the server is fixed: a re-run completes
    assert_complete_and_exact(run_extraction(with_(params, server_urls=[url])), ext.dir)


def test_server_without_capture_block_is_refused_or_reported_missing(tiny_extract_params, capture_servers):
    params = with_(tiny_extract_params, limit=40, shard_wait_s=0.3)
    ((url, engine),) = capture_servers(None)  # an unpatched server: answers, captures nothing
    engine.model_info = lambda: {"model_path": "x", "context_length": 2048}
    with pytest.raises(PreflightError, match="no capture block"):
        run_extraction(with_(params, server_urls=[url]))  # the embedded engine always reports one
    sg = with_(params, server_urls=[url], engine="sglang", extraction_id="sg")
    report = run_extraction(sg)
    n = report["samples"]
    assert report["done"] == 0 and report["run"]["invalid"] == n and report["run"]["requests"] == n  # no retry
    assert all("capture missing" in p["message"] for p in report["problems"])
    sg_dir = open_extraction(sg).dir
    assert not (sg_dir / "ledger.jsonl").exists() or ledger_ids(sg_dir) == []


def _drive(middleware, n):
    """Send ``n`` POST /generate requests through ``middleware``; return their status codes."""
    import asyncio

    async def one():
        sent = []

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(msg):
            sent.append(msg)

        await middleware({"type": "http", "method": "POST", "path": "/generate"}, receive, send)
        return next(m["status"] for m in sent if m["type"] == "http.response.start")

    return [asyncio.run(one()) for _ in range(n)]


def test_fault_gate_applies_faults_only_while_the_gate_file_exists(tmp_path):
    from eaglenest.testing.faults import FaultMiddleware, Faults

    async def ok_app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    gate = tmp_path / "gate"
    faults = Faults.parse(f"fail_every=2,fail_status=500,gate={gate}")
    assert faults.gate == str(gate) and faults.fail_every == 2 and not faults.active
    mw = FaultMiddleware(ok_app, faults)
    assert _drive(mw, 3) == [200, 200, 200]  # no gate file: untouched and not counted
    gate.touch()
    assert _drive(mw, 4) == [200, 500, 200, 500]  # planted: every 2nd request from the plant on
    gate.unlink()
    assert _drive(mw, 3) == [200, 200, 200]  # lifted
    gate.touch()
    assert _drive(mw, 2) == [200, 500]  # re-planted: counting restarts
    assert _drive(FaultMiddleware(ok_app, Faults.parse("fail_every=2")), 2) == [200, 503]  # no gate: always on
    with pytest.raises(ValueError, match="gate needs a file path"):
        Faults.parse("fail_every=2,gate=")


def test_the_run_starts_on_the_first_ready_server_and_the_next_joins_it(tiny_extract_params, tiny_runner):
    """Two launched servers of one launch group (sharing a GPU: the second starts once the first is ready): work
    starts on the first, and the second, ready only once the first has answered several captures, joins the
    round in progress and takes its share; nothing lost, none redone."""
    params = with_(tiny_extract_params, batch_size=32, concurrency=2, num_servers=2)
    ext = open_extraction(params)
    launched: list[ThreadServer] = []
    first_answered: list[int] = []  # by the first server when the second became ready
    switch: list[float] = []

    def make(port):
        server = ThreadServer(tiny_runner, ext.capture_dir, port)
        if not launched:  # the first answers slowly enough that the run is still going when the second joins
            submit = server.engine.submit

            def slow(work):
                switch.append(sys.getswitchinterval())
                time.sleep(0.03)
                return submit(work)

            server.engine.submit = slow
        else:
            ready = server.wait_ready

            def after_first_answers(**kw):
                deadline = time.monotonic() + 10
                while launched[0].engine.stats["requests"] < 6 and time.monotonic() < deadline:
                    time.sleep(0.01)
                first_answered.append(launched[0].engine.stats["requests"])
                ready(**kw)

            server.wait_ready = after_first_answers
        launched.append(server)
        return server

    pool = ServerPool(specs=[LaunchSpec(f"t{i}", make, launch_group="gpu-0") for i in range(2)],
                      launch_timeout_s=30, join_late=True)
    before = sys.getswitchinterval()
    report = run_extraction(params, pool=pool)
    assert_complete_and_exact(report, ext.dir)
    assert first_answered[0] >= 6  # the run did not wait for the second server
    assert set(switch) == {min(before, GIL_SWITCH_S)} and sys.getswitchinterval() == before  # quick, then restored
    computed = [s.engine.stats["requests"] - 1 for s in launched]  # minus each readiness probe
    assert sum(computed) == report["samples"] and computed[1] > 0  # the late one took a share, none redone
    ready = report["run"]["servers"]["ready_after_s"]
    assert set(ready) == {"t0", "t1"} and ready["t1"] >= ready["t0"]
    assert report["run"]["servers"]["launch_failures"] == [] and report["run"]["relaunches"] == 0
    assert not any(s.alive() for s in launched)
