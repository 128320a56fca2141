"""Regeneration end to end on in-thread embedded servers: the target's own greedy answers spliced in, captures
and next turns ahead of new conversations, cut answers kept or skipped, and persisted answers (in place or carried
to a fresh folder) never asked for again."""

import json
from collections import Counter

import pytest

from eaglenest.extraction.run import run_extraction
from eaglenest.extraction.state import open_extraction
from tests.extract_helpers import (
    Kill,
    StopAfter,
    assert_complete_and_exact,
    kill_after_tokens,
    ledger_lines,
    record_rids,
    regen_source,
    with_,
)


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

    with pytest.raises(Kill):
        run_extraction(params, on_progress=kill_after_tokens(5 * 7))  # the client dies mid-regeneration
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

    with pytest.raises(Kill):
        run_extraction(params, on_progress=kill_after_tokens(5 * 7))  # the client dies mid-regeneration
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


def test_an_extraction_made_before_cut_answers_were_kept_resumes_with_skip(tiny_extract_params):
    """Its identity had no cut_answers field (skipping was the only behaviour): skip gives the same identity and
    id, keep (the default now) another one."""
    skip = with_(tiny_extract_params, extraction_id=None, regeneration={"enabled": True, "cut_answers": "skip"})
    keep = with_(skip, regeneration={"enabled": True})
    before = skip.identity()["regeneration"]
    assert "cut_answers" not in before and set(before) == {"enabled", "temperature", "top_p", "max_new_tokens", "seed"}
    assert keep.identity()["regeneration"]["cut_answers"] == "keep"
    assert skip.resolved_extraction_id() != keep.resolved_extraction_id()
