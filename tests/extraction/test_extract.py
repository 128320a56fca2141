"""Extraction end to end on in-thread embedded servers: real ShareGPT text, tiny model. Incomplete output is
invisible, over-long prompts are skipped before sending, and a re-run of a finished extraction does no engine work."""

import json
from collections import Counter

import pytest

from eaglenest.engines.pool import LaunchError
from eaglenest.engines.preflight import PreflightError
from eaglenest.extraction.run import run_extraction
from eaglenest.extraction.state import ConfigChanged, open_extraction
from tests.extract_helpers import (
    StopAfter,
    assert_complete_and_exact,
    ledger_ids,
    ledger_lines,
    record_rids,
    regen_source,
    with_,
)


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

    class Kill(BaseException):
        pass

    def kill_midway(p):
        if p.answered >= 3:  # validation runs in a thread: it may or may not have caught up at this moment
            raise Kill  # the client dies mid-run (SIGKILL-like: nothing after this line runs)

    with pytest.raises(Kill):
        run_extraction(params, on_progress=kill_midway)
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


@pytest.mark.parametrize("processes", [0, 2], ids=["checks-in-threads", "checks-in-processes"])
def test_regeneration_rebuilds_samples_from_the_targets_answers(tiny_extract_params, capture_servers, tmp_path,
                                                               processes):
    import httpx

    params = with_(tiny_extract_params, source=regen_source(tmp_path), max_turns=None,
                   regeneration={"enabled": True, "max_new_tokens": 8}, validate_processes=processes)
    ext = open_extraction(params)
    ((url, engine),) = capture_servers(ext.capture_dir)
    engine.greedy_decoder = StopAfter(engine.runner, k=6)
    report = run_extraction(with_(params, server_urls=[url]))
    assert report["complete"] and report["done"] == 3 and report["run"]["regenerated"] == 3
    # greedy answers were spliced as generated: the target's own LM head predicts them from the capture
    assert report["run"]["argmax_agreement"] >= 0.75
    r = report["run"]
    assert r["generated_tokens"] == 4 * 7  # 4 answers of 6 tokens + their end-of-turn
    assert set(r["phases_s"]) >= {"prepare", "launch", "connect", "regenerate", "prefill", "validate"}
    assert r["phases_s"]["regenerate"] > 0 and r["rates"]["generated_tok_per_s"] > 0
    assert r["rates"]["prefill_tok_per_s"] > 0 and r["rates"]["validated_per_s"] > 0
    lines = (ext.dir / "regenerated.jsonl").read_text().splitlines()
    regen = {json.loads(x)["sample_id"]: json.loads(x) for x in lines}
    two_turns = json.loads(regen["c"]["messages"])
    assert [r for r, _ in two_turns] == ["user", "assistant", "user", "assistant"] and two_turns[1][1] != "old"
    assert len(regen["c"]["loss_spans"]) == 2
    # the answer is the target's own greedy answer to that prompt, token for token
    from eaglenest.data import ChatEncoder, Message

    prompt = ChatEncoder(ext.model_dir).prompt_ids([Message("user", "Write a poem about the number 0.")])
    direct = httpx.post(f"{url}/generate", json={"input_ids": prompt, "rid": "nocapture:check", "sampling_params": {
        "max_new_tokens": 8, "temperature": 0}}).json()
    a, _ = regen["p0"]["loss_spans"][0]
    assert regen["p0"]["input_ids"][:a] == prompt
    assert regen["p0"]["input_ids"][a : a + 6] == direct["output_ids"][:-1]
    assert json.loads(regen["p0"]["messages"])[-1][1] == direct["text"]
    entries = ledger_lines(ext.dir)
    assert all(e["regenerated"] and "argmax_agreement" in e["stats"] for e in entries)
    sent = engine.stats["requests"]
    assert run_extraction(with_(params, server_urls=[url]))["run"]["requests"] == 0  # nothing regenerated again
    assert engine.stats["requests"] == sent
    assert Counter(e["sample_id"] for e in entries).most_common(1)[0][1] == 1


def test_captures_and_next_turns_go_ahead_of_new_conversations(tiny_extract_params, capture_servers, tmp_path):
    """One generation in flight, so they arrive in the queue's order: a conversation's next turn right after its
    first, before any new conversation. Captures have a lane of their own (one in flight): each sample's
    capture is sent, and the generations' order is the same as if there were none."""
    params = with_(tiny_extract_params, source=regen_source(tmp_path, 5), max_turns=None, concurrency=1,
                   regeneration={"enabled": True, "max_new_tokens": 8})
    ext = open_extraction(params)
    ((url, engine),) = capture_servers(ext.capture_dir)
    engine.greedy_decoder = StopAfter(engine.runner, k=6)
    rids = record_rids(engine)
    progress = []
    report = run_extraction(with_(params, server_urls=[url]), on_progress=progress.append)
    assert_complete_and_exact(report, ext.dir)
    sent = [r for r in rids if r.startswith("nocapture:regen:") or not r.startswith("nocapture:")]  # no probe
    started = [r.split(":")[2] for r in sent if r.startswith("nocapture:regen:") and r.endswith(":0")]
    expected = [f"nocapture:regen:{sid}:{turn}" for sid in started for turn in range(2 if sid == "c" else 1)]
    assert len(started) == 6 and [r for r in sent if r.startswith("nocapture:")] == expected
    assert sorted(r for r in sent if not r.startswith("nocapture:")) == sorted(started)  # each captured once
    assert progress[-1].capturing == 0 and progress[-1].answered == 6


def test_answers_cut_by_max_new_tokens_are_kept_or_skipped_with_their_reason(tiny_extract_params, capture_servers,
                                                                            tmp_path):
    params = with_(tiny_extract_params, source=regen_source(tmp_path), max_turns=None, extraction_id="skip",
                   regeneration={"enabled": True, "max_new_tokens": 4, "cut_answers": "skip"})
    ext = open_extraction(params)
    ((url, engine),) = capture_servers(ext.capture_dir)
    engine.greedy_decoder = StopAfter(engine.runner, k=6)  # never ends within 4 tokens
    report = run_extraction(with_(params, server_urls=[url]))
    assert report["complete"] and report["done"] == 0 and report["skipped"] == {"truncated": 3}
    assert {(p["stage"], p["kind"]) for p in report["problems"]} == {("regenerate", "truncated")}
    again = run_extraction(with_(params, server_urls=[url]))  # the skip decisions are persisted too
    assert again["run"]["requests"] == 0 and again["skipped"] == {"truncated": 3}
    # the default keeps them: every sample is its first (cut) answer, 4 tokens under the loss
    kept = with_(params, extraction_id="keep", regeneration={"enabled": True, "max_new_tokens": 4},
                 server_urls=[url], server_capture_dir=str(ext.capture_dir))
    report = run_extraction(kept)
    assert report["complete"] and report["done"] == 3 and report["skipped"] == {} and report["run"]["cut_kept"] == 3
    assert all(e["loss_tokens"] == 4 for e in ledger_lines(open_extraction(kept).dir))


def test_interrupted_regeneration_never_asks_for_an_answer_twice(tiny_extract_params, capture_servers, tmp_path):
    params = with_(tiny_extract_params, source=regen_source(tmp_path, 12), max_turns=None, concurrency=1,
                   regeneration={"enabled": True, "max_new_tokens": 8})
    ext = open_extraction(params)
    ((url, engine),) = capture_servers(ext.capture_dir)
    engine.greedy_decoder = StopAfter(engine.runner, k=6, delay_s=0.1)  # slow enough to stop midway
    rids = record_rids(engine)
    params = with_(params, server_urls=[url])

    class Kill(BaseException):
        pass

    def kill_midway(p):
        if p.generated_tokens >= 5 * 7:
            raise Kill  # the client dies mid-regeneration

    with pytest.raises(Kill):
        run_extraction(params, on_progress=kill_midway)
    answers = [json.loads(line) for line in (ext.dir / "answers.jsonl").read_text().splitlines()]
    assert 5 <= len(answers) < 14
    persisted = {f"nocapture:regen:{a['sample_id']}:{a['turn']}" for a in answers}
    asked_before = len(rids)
    report = run_extraction(params)
    assert_complete_and_exact(report, ext.dir)
    asked_again = [r for r in rids[asked_before:] if r.startswith("nocapture:regen:")]
    assert not persisted & set(asked_again)  # a persisted answer is replayed, never asked for again
    generated = {r for r in rids if r.startswith("nocapture:regen:")}
    assert generated == persisted | set(asked_again)
    assert len(generated) == 14  # 12 prompts + a 2-turn conversation
    assert len({r for r in rids if not r.startswith("nocapture:")}) == 13  # every sample captured
    # only the request in flight when the client died (concurrency 1: at most one, a capture or an answer) is
    # asked for twice: its answer never reached the client
    assert len(rids) - len(set(rids)) <= 1


def test_answers_carried_to_a_fresh_folder_are_captured_without_regenerating(tiny_extract_params, capture_servers,
                                                                            tmp_path):
    """The GPU session's way: only answers.jsonl and regenerated.jsonl of a killed run travel to a new machine
    (a fresh output folder, no shards, no ledger); the same command captures what they hold and asks the
    engine only for the answers they lack."""
    import shutil

    params = with_(tiny_extract_params, source=regen_source(tmp_path, 12), max_turns=None, concurrency=1,
                   regeneration={"enabled": True, "max_new_tokens": 8})
    ext = open_extraction(params)
    ((url, engine),) = capture_servers(ext.capture_dir)
    engine.greedy_decoder = StopAfter(engine.runner, k=6, delay_s=0.1)
    params = with_(params, server_urls=[url])

    class Kill(BaseException):
        pass

    def kill_midway(p):
        if p.generated_tokens >= 5 * 7:
            raise Kill

    with pytest.raises(Kill):
        run_extraction(params, on_progress=kill_midway)
    answered = len((ext.dir / "answers.jsonl").read_text().splitlines())
    fresh = with_(params, output_dir=str(tmp_path / "elsewhere"))
    moved = open_extraction(fresh)
    for name in ("answers.jsonl", "regenerated.jsonl"):
        if (ext.dir / name).is_file():
            shutil.copy(ext.dir / name, moved.dir / name)
    ((url2, engine2),) = capture_servers(moved.capture_dir)
    engine2.greedy_decoder = StopAfter(engine2.runner, k=6)
    rids = record_rids(engine2)
    report = run_extraction(with_(fresh, server_urls=[url2]))
    assert_complete_and_exact(report, moved.dir)
    generated = [r for r in rids if r.startswith("nocapture:regen:")]
    assert len(generated) == len(set(generated)) == 14 - answered  # the carried answers are never asked again
    captured = [r for r in rids if not r.startswith("nocapture:")]
    assert len(captured) == len(set(captured)) == 13  # and every sample is captured here, once


def test_answers_of_fewer_turns_carried_to_a_fresh_folder_are_replayed_and_later_turns_generated(
        tiny_extract_params, capture_servers, tmp_path):
    """A run of first turns only; its answers.jsonl alone (no regenerated.jsonl: those samples end after turn 0)
    starts a run of every turn in a fresh folder: turn 0 is replayed, only the second turn is asked for, and the
    conversation is spliced with both answers in place."""
    import shutil

    params = with_(tiny_extract_params, source=regen_source(tmp_path, 12), max_turns=1, concurrency=1,
                   regeneration={"enabled": True, "max_new_tokens": 8})
    ext = open_extraction(params)
    ((url, engine),) = capture_servers(ext.capture_dir)
    engine.greedy_decoder = StopAfter(engine.runner, k=6)
    first = run_extraction(with_(params, server_urls=[url]))
    assert first["complete"] and first["run"]["requests"] >= 13
    assert len((ext.dir / "answers.jsonl").read_text().splitlines()) == 13  # one answer per record
    every = with_(params, max_turns=None, output_dir=str(tmp_path / "elsewhere"))
    moved = open_extraction(every)
    shutil.copy(ext.dir / "answers.jsonl", moved.dir / "answers.jsonl")
    ((url2, engine2),) = capture_servers(moved.capture_dir)
    engine2.greedy_decoder = StopAfter(engine2.runner, k=6)
    rids = record_rids(engine2)
    report = run_extraction(with_(every, server_urls=[url2]))
    assert_complete_and_exact(report, moved.dir)
    assert [r for r in rids if r.startswith("nocapture:regen:")] == ["nocapture:regen:c:1"]
    assert report["run"]["replayed_answers"] == 13
    lines = (moved.dir / "regenerated.jsonl").read_text().splitlines()
    regen = {json.loads(x)["sample_id"]: json.loads(x) for x in lines}
    assert len(regen["c"]["loss_spans"]) == 2  # both answers under the loss


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


def test_an_extraction_made_before_cut_answers_were_kept_resumes_with_skip(tiny_extract_params):
    """Its identity had no cut_answers field (skipping was the only behaviour): skip gives the same identity and
    id, keep (the default now) another one."""
    skip = with_(tiny_extract_params, extraction_id=None, regeneration={"enabled": True, "cut_answers": "skip"})
    keep = with_(skip, regeneration={"enabled": True})
    before = skip.identity()["regeneration"]
    assert "cut_answers" not in before and set(before) == {"enabled", "temperature", "top_p", "max_new_tokens", "seed"}
    assert keep.identity()["regeneration"]["cut_answers"] == "keep"
    assert skip.resolved_extraction_id() != keep.resolved_extraction_id()
