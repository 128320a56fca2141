"""Chat-template tokenization: assistant-only loss spans by prefix rendering; prompts longer than the context
are skipped before sending."""

import shutil

import numpy as np
import pytest

from eaglenest.data import ChatEncoder, Message, Record, Sample, build_samples, read_samples, write_samples
from eaglenest.data.chat import SampleError, fit_turns, truncate_turns

# SmolLM2-135M-Instruct's template: injects a default system prompt when the first message is not one.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def with_template(src, dst, template):
    shutil.copytree(src, dst)
    (dst / "chat_template.jinja").write_text(template)
    return dst


@pytest.fixture(scope="module")
def smol_encoder(tiny_model_dir, tmp_path_factory):
    return ChatEncoder(with_template(tiny_model_dir, tmp_path_factory.mktemp("smol") / "m", SMOLLM2_TEMPLATE))


def conv(*turns, system=None):
    msgs = [Message("system", system)] if system else []
    roles = ["user", "assistant"]
    return tuple(msgs + [Message(roles[i % 2], t) for i, t in enumerate(turns)])


@pytest.mark.parametrize("system", [None, "Be terse."])
def test_loss_spans_are_exactly_the_assistant_turns(smol_encoder, system):
    msgs = conv("What is 2+2?", "It is 4.", "And 3+3?", "Six, obviously.\n\nDone.", system=system)
    ids, spans = smol_encoder.encode(msgs)
    tok = smol_encoder.tokenizer
    full = tok.apply_chat_template([{"role": m.role, "content": m.content} for m in msgs], tokenize=True,
                                   return_dict=True)["input_ids"]
    assert ids == list(full)  # exactly what the template tokenizes to
    assert "SmolLM" in tok.decode(ids[: spans[0][0]]) or system  # the injected system prompt is not loss
    texts = [tok.decode(ids[a:b]) for a, b in spans]
    assert texts == ["It is 4.<|im_end|>", "Six, obviously.\n\nDone.<|im_end|>"]
    mask = np.zeros(len(ids), bool)
    for a, b in spans:
        mask[a:b] = True
    assert "What is 2+2?" not in tok.decode(np.asarray(ids)[mask].tolist())


def test_prompt_ids_end_with_the_generation_prompt(smol_encoder):
    ids = smol_encoder.prompt_ids(conv("Hi"))
    assert smol_encoder.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


def test_template_that_is_not_prefix_stable_is_refused(tiny_model_dir, tmp_path):
    bad = SMOLLM2_TEMPLATE + "{{ messages | length }}"  # appends the message count: prefixes disagree
    enc = ChatEncoder(with_template(tiny_model_dir, tmp_path / "m", bad))
    with pytest.raises(SampleError, match="not prefix-stable"):
        enc.encode(conv("q", "a"))


def test_long_samples_are_skipped_and_counted_never_truncated(smol_encoder):
    short = Record("short", conv("hi", "hello"), 0)
    ids, _ = smol_encoder.encode(short.messages)
    limit = len(ids)
    longer = Record("long", conv("hi", "hello there"), 1)
    prompt_only = Record("p", (Message("user", "hi"),), 2)
    samples, skipped = build_samples([short, longer, prompt_only], smol_encoder, max_tokens=limit)
    assert [s.sample_id for s in samples] == ["short"] and samples[0].num_tokens == limit
    assert {(s.sample_id, s.kind) for s in skipped} == {("long", "too_long"), ("p", "no_assistant")}
    # context length + 1 tokens: skipped before anything is sent
    _, skipped = build_samples([short], smol_encoder, max_tokens=limit - 1)
    assert skipped[0].kind == "too_long" and f"{limit} tokens > limit {limit - 1}" in skipped[0].reason
    # with regeneration the prompt is what must fit, and prompt-only records are kept
    samples, skipped = build_samples([prompt_only, longer], smol_encoder, max_tokens=limit, regenerate=True)
    assert [s.sample_id for s in samples] == ["p", "long"] and samples[0].loss_spans == ()


def test_truncate_turns_and_samples_file_roundtrip(smol_encoder, tmp_path):
    rec = Record("m", conv("a", "b", "c", "d"), 3)
    assert [m.content for m in truncate_turns(rec, 1).messages] == ["a", "b"]
    assert truncate_turns(rec, 5) is rec
    samples, _ = build_samples([rec, Record("n", conv("x", "y"), 4)], smol_encoder, max_tokens=10_000)
    write_samples(tmp_path / "s.parquet", samples)
    back = read_samples(tmp_path / "s.parquet")
    for a, b in zip(samples, back, strict=True):
        assert (a.sample_id, a.loss_spans, a.messages, a.source_index) == (b.sample_id, b.loss_spans, b.messages,
                                                                           b.source_index)
        assert np.array_equal(a.input_ids, b.input_ids) and a.digest() == b.digest()
    with pytest.raises(ValueError, match="not sorted"):
        Sample(sample_id="z", input_ids=[1, 2, 3], loss_spans=((2, 3), (0, 1)))


def test_fit_turns_keeps_the_whole_turns_that_fit(smol_encoder):
    rec = Record("m", conv("a " * 50, "b " * 50, "c " * 50, "d " * 50), 0)
    one, two = (len(smol_encoder.encode(truncate_turns(rec, n).messages)[0]) for n in (1, 2))
    assert fit_turns(rec, smol_encoder, two)[0].messages == rec.messages and fit_turns(rec, smol_encoder, two)[1] == two
    cut, n = fit_turns(rec, smol_encoder, two - 1)  # one token short of both turns: the first turn only
    assert [m.content for m in cut.messages] == ["a " * 50, "b " * 50] and n == one
    assert fit_turns(rec, smol_encoder, one - 1) is None  # not even the first turn
    assert fit_turns(Record("p", [Message("user", "hi")], 1), smol_encoder, 10_000) is None  # no assistant turn
    # a trailing unanswered user turn stays when the whole record fits (what --long drop measured before)
    tail = Record("t", conv("a", "b", "c " * 30), 0)
    whole = len(smol_encoder.encode(tail.messages)[0])
    assert fit_turns(tail, smol_encoder, whole) == (tail, whole)
    assert [m.content for m in fit_turns(tail, smol_encoder, whole - 1)[0].messages] == ["a", "b"]
