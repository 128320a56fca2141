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
