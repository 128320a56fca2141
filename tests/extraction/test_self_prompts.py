"""Self-prompting: the template up to a user turn is what the target continues; only finished, new, long enough,
non-evaluation prompts are kept, each reason counted; every prompt has its own seed."""

from __future__ import annotations

import json

import httpx
import pytest

from eaglenest.data import ChatEncoder, Message, read_records
from eaglenest.extraction.self_prompts import SelfPromptConfig, keep_prompts, self_prompts, user_turn_prefix

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def smol_dir(tiny_model_dir, tmp_path_factory):
    import shutil

    dst = tmp_path_factory.mktemp("smol") / "m"
    shutil.copytree(tiny_model_dir, dst)
    (dst / "chat_template.jinja").write_text(SMOLLM2_TEMPLATE)
    return dst


def body(text, finish="stop"):
    return {"text": text, "output_ids": [5] * max(1, len(text) // 4), "meta_info": {"finish_reason": {"type": finish}}}


def test_the_prefix_is_the_template_up_to_the_users_text(smol_dir):
    enc = ChatEncoder(smol_dir)
    prefix = user_turn_prefix(enc)
    text = enc.tokenizer.decode(prefix)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant") and text.endswith("<|im_start|>user\n")
    # what a continuation of it renders to is exactly a conversation of that user message
    assert text + "hi<|im_end|>\n" == enc.render([Message("user", "hi")])


def test_only_finished_new_long_enough_non_eval_prompts_are_kept():
    cfg = SelfPromptConfig(count=7, seed=3, min_chars=10)
    answers = [(6, body("Plan a trip to Rome for me.")), (0, body("How do I bake bread at home?")),
               (1, body("How do I bake  BREAD at home?")),  # the same prompt (case and spacing aside)
               (2, body("Write me a long story about", finish="length")), (3, body("Hi?")),
               (4, body("what is the  capital of France?")), (5, body("   "))]  # 4: an eval prompt, respaced
    records, skipped = keep_prompts(answers, cfg, exclude={"What is the capital of France?"})
    assert [r["id"] for r in records] == ["self-3-0", "self-3-6"]  # in prompt order
    assert records[0]["messages"] == [{"role": "user", "content": "How do I bake bread at home?"}]
    assert dict(skipped) == {"duplicate": 1, "cut": 1, "too_short": 2, "eval_prompt": 1}


def test_self_prompts_asks_each_prompt_once_with_its_own_seed(smol_dir, tmp_path):
    sent = []

    def handler(request: httpx.Request) -> httpx.Response:
        req = json.loads(request.content)
        sent.append(req)
        i = int(req["rid"].rsplit(":", 1)[1])
        return httpx.Response(200, json=body(f"Question number {i % 3} about gardening?"))

    out = tmp_path / "self.jsonl.xz"
    report = self_prompts(["http://fake:1"], smol_dir, SelfPromptConfig(count=6, seed=1), out,
                          transport=httpx.MockTransport(handler))
    assert report["asked"] == 6 and report["kept"] == 3 and report["skipped"] == {"duplicate": 3}
    assert report["failed"] == {} and report["requests"] == 6
    assert sorted(r["rid"] for r in sent) == [f"nocapture:self:1:{i}" for i in range(6)]
    assert len({r["sampling_params"]["sampling_seed"] for r in sent}) == 6
    assert all(r["sampling_params"]["temperature"] == 1.0 for r in sent)
    assert len({tuple(r["input_ids"]) for r in sent}) == 1  # every request is the same template prefix
    src = read_records(str(out))
    assert [r.id for r in src.records] == ["self-1-0", "self-1-1", "self-1-2"] and not src.bad
    assert [m.role for m in src.records[0].messages] == ["user"]


def test_greedy_self_prompting_is_refused():
    with pytest.raises(ValueError, match="temperature must be > 0"):
        SelfPromptConfig(count=3, temperature=0.0)


def test_nothing_kept_is_an_error_naming_why(smol_dir, tmp_path):
    transport = httpx.MockTransport(lambda r: httpx.Response(200, json=body("never ends", finish="length")))
    with pytest.raises(RuntimeError, match=r"no prompt was kept of 2 \(skipped \{'cut': 2\}"):
        self_prompts(["http://fake:1"], smol_dir, SelfPromptConfig(count=2), tmp_path / "x.jsonl",
                     transport=transport)
    assert not (tmp_path / "x.jsonl").exists()


def test_openings_are_taken_in_turn_and_the_target_writes_the_rest(smol_dir, tmp_path):
    from eaglenest.extraction.self_prompts import STARTER_SETS

    enc = ChatEncoder(smol_dir)
    prefix = user_turn_prefix(enc)
    sent = {}

    def handler(request: httpx.Request) -> httpx.Response:
        req = json.loads(request.content)
        i = int(req["rid"].rsplit(":", 1)[1])
        sent[i] = req["input_ids"]
        return httpx.Response(200, json=body(["", " 2x + 3 = 7, step by step.", " a pirate on a ship.",
                                              " the following: bake bread."][i % 4]))

    cfg = SelfPromptConfig(count=8, seed=2, starters=("Solve for x:", "Pretend you are", ""), min_chars=10)
    out = tmp_path / "steered.jsonl"
    report = self_prompts(["http://fake:1"], smol_dir, cfg, out, transport=httpx.MockTransport(handler))
    # each request is the template prefix, then its opening's tokens (none for the empty opening)
    for i, ids in sent.items():
        opening = cfg.starters[i % 3]
        assert ids[: len(prefix)] == prefix
        assert enc.tokenizer.decode(ids[len(prefix):]) == opening
    texts = {r.id: r.messages[0].content for r in read_records(str(out)).records}
    # prompt 0: an opening the target did not continue is no request; 1: "Pretend you are" + its continuation
    assert "self-2-0" not in texts and texts["self-2-1"] == "Pretend you are 2x + 3 = 7, step by step."
    assert texts["self-2-2"] == "a pirate on a ship."  # the empty opening: the target's own start
    assert texts["self-2-3"] == "Solve for x: the following: bake bread."
    assert report["starters"] == 3 and report["skipped"]["too_short"] >= 1
    assert len(STARTER_SETS["kinds"]) == 48 and len(set(STARTER_SETS["kinds"])) == 48


def test_code_openings_reach_the_target_as_written(smol_dir, tmp_path):
    """The ``code`` set's openings (newlines and a code fence inside) are sent token for token, and the target's
    continuation follows the opening's last word: a function header it writes itself."""
    from eaglenest.extraction.self_prompts import STARTER_SETS

    code = STARTER_SETS["code"]
    assert len(set(code)) == len(code) == 12 and sum("```python" in s for s in code) == 6
    every = [o for openings in STARTER_SETS.values() for o in openings]  # kinds, code, creative
    assert len(every) == len(set(every)) == 72  # taken together, no opening counts twice
    enc = ChatEncoder(smol_dir)
    prefix = user_turn_prefix(enc)
    sent = {}

    def handler(request: httpx.Request) -> httpx.Response:
        req = json.loads(request.content)
        sent[int(req["rid"].rsplit(":", 1)[1])] = req["input_ids"]
        return httpx.Response(200, json=body(' add(a: int, b: int) -> int:\n    """Sum of a and b."""\n```'))

    cfg = SelfPromptConfig(count=len(code), starters=code)
    out = tmp_path / "code.jsonl"
    self_prompts(["http://fake:1"], smol_dir, cfg, out, transport=httpx.MockTransport(handler))
    for i, ids in sent.items():
        assert ids[: len(prefix)] == prefix and enc.tokenizer.decode(ids[len(prefix):]) == code[i]
    texts = {r.id: r.messages[0].content for r in read_records(str(out)).records}
    assert texts["self-0-0"] == ('Complete this Python function:\n\n```python\ndef add(a: int, b: int) -> int:\n'
                                 '    """Sum of a and b."""\n```')


def test_openings_with_surrounding_space_are_refused():
    with pytest.raises(ValueError, match="whitespace"):
        SelfPromptConfig(count=2, starters=("Solve for x: ",))
