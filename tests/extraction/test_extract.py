"""Extraction end to end on in-thread embedded servers: real ShareGPT text, tiny model. Incomplete output is
invisible, over-long prompts are skipped before sending, and a re-run of a finished extraction does no engine work.
(Regeneration end to end: test_extract_regeneration.py.)"""

import json

import pytest

from eaglenest.engines.pool import LaunchError
from eaglenest.engines.preflight import PreflightError
from eaglenest.extraction.run import run_extraction
from eaglenest.extraction.state import ConfigChanged, open_extraction
from tests.extract_helpers import Kill, assert_complete_and_exact, kill_when, ledger_ids, ledger_lines, with_


def test_two_servers_split_one_run_then_rerun_sends_nothing(tiny_extract_params, capture_servers):
    params = tiny_extract_params
    ext_dir = open_extraction(params).dir
    servers = capture_servers(ext_dir / "capture", n=2)
    params = with_(params, server_urls=[u for u, _ in servers])
    progress = []
    report = run_extraction(params, on_progress=progress.append)
    assert report["samples"] >= 15 and report["skipped_total"] + report["samples"] + report["bad_records"] >= 100
    assert_complete_and_exact(report, ext_dir)
    per_server = [e.stats["requests"] - 1 for _, e in servers]  # minus the readiness probe
    assert all(n > 0 for n in per_server) and sum(per_server) == report["samples"]  # split, none doubled
    assert report["run"]["requests"] == report["samples"] and report["run"]["tokens"] == report["tokens_done"]
    assert progress[-1].answered == report["samples"] and progress[-1].validated == report["samples"]
    # loss spans come from the chat template: assistant tokens only, never the prompt
    entry = ledger_lines(ext_dir)[0]
    assert 0 < entry["loss_tokens"] < entry["num_tokens"] and entry["loss_spans"][0][0] > 0
    before = [e.stats["requests"] for _, e in servers]
    again = run_extraction(params)
    assert [e.stats["requests"] for _, e in servers] == before  # a finished extraction re-run does zero engine work
    assert again["run"]["requests"] == 0 and again["done"] == report["done"]


def test_interrupted_run_resumes_with_only_the_missing_work(tiny_extract_params, capture_servers):
    params = with_(tiny_extract_params, batch_size=4, concurrency=1)  # nothing else in flight at the kill
    ext_dir = open_extraction(params).dir
    ((url, engine),) = capture_servers(ext_dir / "capture")
    params = with_(params, server_urls=[url])

    # the client dies mid-run; validation runs in a thread: it may or may not have caught up at this moment
    with pytest.raises(Kill):
        run_extraction(params, on_progress=kill_when(lambda p: p.answered >= 3))
    in_ledger = set(ledger_ids(ext_dir))
    shards = {p.name for p in (ext_dir / "capture").glob("*.safetensors")}
    answered_not_validated = len(shards) - len(in_ledger)
    # validation runs in a thread beside the requests: it may have caught up with the answers at the kill
    assert in_ledger and answered_not_validated >= 0
    sent_before = engine.stats["requests"]
    report = run_extraction(params)
    assert_complete_and_exact(report, ext_dir)
    missing = report["samples"] - len(in_ledger) - answered_not_validated
    assert report["run"]["reused_shards"] == answered_not_validated  # validated, not requested again
    probe = 1 if report["samples"] > len(in_ledger) else 0  # a resume with every sample in the ledger sends nothing
    assert report["run"]["requests"] == missing == engine.stats["requests"] - sent_before - probe
    assert engine.stats["requests"] == report["samples"] + 1 + probe  # each sample asked for once in all (+ probes)


def test_stale_temporaries_and_torn_tails_are_ignored_and_cleaned(tiny_extract_params, capture_servers):
    params = tiny_extract_params
    ext = open_extraction(params)
    stale = [ext.capture_dir / "x.safetensors.abc123.tmp", ext.dir / "samples.parquet.deadbeef.tmp"]
    for p in stale:
        p.write_bytes(b"half")
    (ext.dir / "ledger.jsonl").write_text('{"sample_id": "torn", "sha')  # a crash mid-append
    ((url, _),) = capture_servers(ext.capture_dir)
    report = run_extraction(with_(params, server_urls=[url]))
    assert_complete_and_exact(report, ext.dir)
    assert not any(p.exists() for p in stale)
    assert "torn" not in ledger_ids(ext.dir)


def test_samples_beyond_the_context_are_skipped_before_sending(tiny_extract_params, capture_servers, tmp_path):
    from eaglenest.data import ChatEncoder, Message

    enc = ChatEncoder(tiny_extract_params.model)
    conv = [Message("user", "hello there " * 20), Message("assistant", "general kenobi " * 20)]
    n = len(enc.encode(conv)[0])
    rows = [{"id": "fits", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
            {"id": "over", "messages": [{"role": m.role, "content": m.content} for m in conv]}]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    params = with_(tiny_extract_params, source=str(tmp_path / "p.jsonl"), max_tokens=n - 1, context_headroom=0)
    ext_dir = open_extraction(params).dir
    ((url, engine),) = capture_servers(ext_dir / "capture")
    report = run_extraction(with_(params, server_urls=[url]))
    assert report["skipped"] == {"too_long": 1} and report["done"] == 1 and report["complete"]
    assert engine.stats["requests"] == 1 + 1  # probe + the sample that fits
    assert f"{n} tokens > limit {n - 1}" in json.loads((ext_dir / "prepare.json").read_text())["skipped"][0]["reason"]


def test_resume_with_other_content_settings_is_refused(tiny_extract_params):
    open_extraction(tiny_extract_params)
    with pytest.raises(ConfigChanged, match="limit: 100 -> 10"):
        open_extraction(with_(tiny_extract_params, limit=10))
    open_extraction(with_(tiny_extract_params, batch_size=3, concurrency=1))  # operational knobs may change


def test_server_with_other_aux_layers_is_refused_before_any_request(tiny_extract_params, tiny_model_dir):
    from eaglenest.engines.embedded import EmbeddedEngine
    from eaglenest.engines.runtime import TargetRunner
    from eaglenest.engines.serving import BackgroundServer

    ext = open_extraction(tiny_extract_params)
    engine = EmbeddedEngine(TargetRunner(tiny_model_dir, dtype="float32", aux_layer_ids=(0, 2, 5)),
                            capture_dir=ext.capture_dir)
    with BackgroundServer(engine) as url:
        with pytest.raises(PreflightError, match=r"captures aux layers \[0, 2, 5\], the run asks for \[1, 3, 4\]"):
            run_extraction(with_(tiny_extract_params, server_urls=[url]))
        assert engine.stats["requests"] == 1  # the readiness probe only
    engine.close()


def test_sglang_servers_are_built_by_the_sglang_launcher(tiny_extract_params, monkeypatch):
    import sys
    import types

    import eaglenest.engines
    from eaglenest.extraction.connect import launch_specs

    calls = []
    fake = types.ModuleType("eaglenest.engines.sglang_launcher")

    def build_command(**kw):
        calls.append(kw)
        return ["python3", "-m", "sglang.launch_server", "--port", str(kw["port"])], {"SGL_X": "1"}

    fake.build_command = build_command
    monkeypatch.setitem(sys.modules, "eaglenest.engines.sglang_launcher", fake)
    monkeypatch.setattr(eaglenest.engines, "sglang_launcher", fake, raising=False)
    ext = open_extraction(with_(tiny_extract_params, engine="sglang", num_servers=2, sglang_args=["--tp-size", "2"]))
    procs = [spec.make(31000 + i) for i, spec in enumerate(launch_specs(ext))]
    assert procs[1].cmd[-1] == "31001" and procs[1].url == "http://127.0.0.1:31001" and procs[0].env == {"SGL_X": "1"}
    assert calls[0]["capture_dir"] == ext.capture_dir and calls[0]["aux_layer_ids"] == [1, 3, 4]
    assert calls[0]["model_dir"] == ext.model_dir and calls[0]["host"] == "127.0.0.1"
    # data parallel on one host: each server gets its own GPUs
    assert calls[0]["sglang_args"] == ["--tp-size", "2", "--base-gpu-id", "0"]
    assert calls[1]["sglang_args"] == ["--tp-size", "2", "--base-gpu-id", "2"]
    # more servers than GPUs: they share the GPU, started one after another, each with its memory share of the
    # user's total; at tensor parallel > 1 refused before anything starts, naming what to do
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    calls.clear()
    one_gpu = open_extraction(with_(tiny_extract_params, engine="sglang", num_servers=2, extraction_id="g",
                                    sglang_args=["--mem-fraction-static", "0.7"]))
    specs = launch_specs(one_gpu)
    for i, spec in enumerate(specs):
        spec.make(31000 + i)
    assert [s.launch_group for s in specs] == ["gpu-0", "gpu-0"]
    assert calls[0]["sglang_args"] == ["--base-gpu-id", "0", "--mem-fraction-static", "0.35"]
    assert calls[1]["sglang_args"] == ["--base-gpu-id", "0", "--mem-fraction-static", "0.538"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    with pytest.raises(LaunchError, match="share GPUs only at tensor parallel 1"):
        launch_specs(open_extraction(with_(tiny_extract_params, engine="sglang", num_servers=2, extraction_id="t",
                                           sglang_args=["--tp-size", "2"])))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    # regeneration decodes: every request in flight (the generations, plus the captures' lane: 768 // 4) is
    # admitted and the generations are replayed in one CUDA graph batch, unless the user said otherwise
    calls.clear()
    regen = with_(tiny_extract_params, engine="sglang", concurrency=768, extraction_id="r",
                  regeneration={"enabled": True}, sglang_args=["--cuda-graph-max-bs=256"])
    launch_specs(open_extraction(regen))[0].make(31000)
    assert calls[0]["sglang_args"] == ["--cuda-graph-max-bs=256", "--max-running-requests", "960"]
    calls.clear()
    own = with_(regen, extraction_id="s", sglang_args=[], capture_concurrency=64)
    launch_specs(open_extraction(own))[0].make(31000)
    assert calls[0]["sglang_args"] == ["--max-running-requests", "832", "--cuda-graph-max-bs", "768"]


def test_resume_on_a_server_with_other_numerics_is_refused(tiny_extract_params, capture_servers, tiny_model_dir):
    from eaglenest.engines.embedded import EmbeddedEngine
    from eaglenest.engines.runtime import TargetRunner
    from eaglenest.engines.serving import BackgroundServer

    params = with_(tiny_extract_params, limit=20)
    ext = open_extraction(params)
    ((url, _),) = capture_servers(ext.capture_dir)  # float32
    assert run_extraction(with_(params, server_urls=[url]))["done"] > 1
    ledger = ext.dir / "ledger.jsonl"
    ledger.write_text("".join(ledger.read_text().splitlines(keepends=True)[:-1]))  # one sample left to do
    for shard in ext.capture_dir.iterdir():
        shard.unlink()
    engine = EmbeddedEngine(TargetRunner(tiny_model_dir, dtype="bfloat16"), capture_dir=ext.capture_dir)
    with BackgroundServer(engine) as other:
        with pytest.raises(ConfigChanged, match=r"dtype.*differ from .*provenance.json"):
            run_extraction(with_(params, server_urls=[other]))
        assert engine.stats["requests"] == 1  # refused before any sample was sent (the probe only)
    engine.close()
