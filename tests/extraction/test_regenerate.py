"""Regeneration's multi-turn splice (ids and loss mask against a hand-built expectation), its skips, and the
replay of persisted answers (no request for an answer already given)."""

import pytest

from eaglenest.data import ChatEncoder, Message, Record, build_samples
from eaglenest.data.chat import Skipped
from eaglenest.data.samples import Sample
from eaglenest.extraction.client import Job
from eaglenest.extraction.regenerate import RegenConfig, Regenerator, TurnAnswer
from tests.data.test_data_chat import SMOLLM2_TEMPLATE, with_template


@pytest.fixture(scope="module")
def enc(tiny_model_dir, tmp_path_factory):
    return ChatEncoder(with_template(tiny_model_dir, tmp_path_factory.mktemp("smol") / "m", SMOLLM2_TEMPLATE))


SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def conversation(*turns: str) -> tuple[Message, ...]:
    return tuple(Message(("user", "assistant")[i % 2], t) for i, t in enumerate(turns))


def sample_of(enc, messages, *, max_tokens=4096, max_turns=None) -> Sample:
    (s,), _ = build_samples([Record("c", messages, 0)], enc, max_tokens=max_tokens, regenerate=True,
                            max_turns=max_turns)
    return s


def answer(enc, text: str, *, finish="stop") -> dict:
    ids = enc.tokenizer(text, add_special_tokens=False)["input_ids"]
    eos = enc.tokenizer.eos_token_id
    return {"text": text, "output_ids": ids + ([eos] if finish == "stop" else []),
            "meta_info": {"finish_reason": {"type": finish, **({"matched": eos} if finish == "stop" else {})}}}


def drive(regen: Regenerator, sample: Sample, replies: list[dict]) -> tuple[object, list[Job]]:
    """Answer each request in order with the next reply; returns (final outcome, the requests made)."""
    out, jobs = regen.start(sample), []
    while isinstance(out, Job):
        jobs.append(out)
        out = regen.answered(out.payload, replies[len(jobs) - 1])
    return out, jobs


def test_three_turns_are_regenerated_in_context_with_the_mask_on_the_answers_only(enc):
    tok = enc.tokenizer
    msgs = conversation("What is 2+2?", "old answer one", "And 3+3?", "old two", "Thanks!", "old three")
    replies = [answer(enc, "It is 4."), answer(enc, "Six."), answer(enc, "You are welcome.")]
    out, jobs = drive(Regenerator(enc, RegenConfig(max_new_tokens=64), 4096), sample_of(enc, msgs), replies)
    assert isinstance(out, Sample) and out.regenerated and out.meta == {"regen_turns": 3, "dropped_turns": 0}

    # hand-built: the ChatML text with the target's answers in place of the originals
    turns = [("What is 2+2?", "It is 4."), ("And 3+3?", "Six."), ("Thanks!", "You are welcome.")]
    pieces, spans, ids = [], [], []
    for i, (q, a) in enumerate(turns):
        prompt = (SYSTEM if i == 0 else "") + f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
        ids += tok(prompt, add_special_tokens=False)["input_ids"]
        start = len(ids)
        ids += tok(a, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
        spans.append((start, len(ids)))
        ids += tok("\n", add_special_tokens=False)["input_ids"]
        pieces.append(prompt + a + "<|im_end|>\n")
    assert out.input_ids.tolist() == ids
    assert out.loss_spans == tuple(spans)
    assert [tok.decode(out.input_ids[a:b]) for a, b in out.loss_spans] == [
        "It is 4.<|im_end|>", "Six.<|im_end|>", "You are welcome.<|im_end|>"]
    assert tok.decode(out.input_ids) == "".join(pieces)
    # the same conversation tokenized whole (the given-answers path) gives the same ids and mask
    given = [m if m.role == "user" else Message("assistant", a) for m, a in
             zip(out.messages, ["", "It is 4.", "", "Six.", "", "You are welcome."], strict=True)]
    assert enc.encode(given) == (ids, tuple(spans))

    # turn i sees the target's own answers to turns < i, never the original ones
    second = tok.decode(jobs[1].body["input_ids"])
    assert "It is 4." in second and "old answer one" not in second and second.endswith("<|im_start|>assistant\n")
    assert [j.body["rid"] for j in jobs] == ["nocapture:regen:c:0", "nocapture:regen:c:1", "nocapture:regen:c:2"]


def test_max_turns_limits_the_turns_regenerated(enc):
    msgs = conversation("a?", "x", "b?", "y", "c?", "z")
    replies = [answer(enc, "A."), answer(enc, "B.")]
    out, jobs = drive(Regenerator(enc, RegenConfig(), 4096), sample_of(enc, msgs, max_turns=2), replies)
    assert len(jobs) == 2 and len(out.loss_spans) == 2 and [m.content for m in out.messages][-1] == "B."


@pytest.mark.parametrize(("reply", "kind"), [("cut", "truncated"), ("empty", "empty_answer")])
def test_an_empty_answer_or_a_cut_one_when_asked_to_skip_is_never_trained_on(enc, reply, kind):
    def bad():
        return answer(enc, "la la la", finish="length") if reply == "cut" else answer(enc, "  ")

    config = RegenConfig(max_new_tokens=8, keep_cut=False)
    msgs = conversation("q?", "x", "r?", "y", "s?", "z")
    # the first answer: the sample is skipped with the reason
    out, _ = drive(Regenerator(enc, config, 4096), sample_of(enc, msgs), [bad()])
    assert isinstance(out, Skipped) and out.kind == kind and "turn 0" in out.reason
    # a later answer: it and the turns after it are dropped, the complete turns before it are the sample
    regen = Regenerator(enc, config, 4096)
    out, jobs = drive(regen, sample_of(enc, msgs), [answer(enc, "Fine."), bad()])
    assert isinstance(out, Sample) and len(jobs) == 2 and out.meta == {"regen_turns": 1, "dropped_turns": 2,
                                                                      "cut": kind}
    assert [m.content for m in out.messages] == ["q?", "Fine."] and len(out.loss_spans) == 1
    assert regen.stats.turns_cut == 1


@pytest.mark.parametrize("turn", [0, 1])
def test_a_cut_answer_is_kept_as_the_last_turn_without_an_end_of_turn(enc, turn):
    """The target's own ids up to the cut are trained on; nothing after them (no end-of-turn token: the target
    did not end the turn; the later turns are dropped, their context would hold an answer that never ended)."""
    tok = enc.tokenizer
    msgs = conversation("q?", "x", "r?", "y", "s?", "z")
    cut = answer(enc, " la la la la", finish="length")
    replies = [answer(enc, "Fine.")] * turn + [cut]
    regen = Regenerator(enc, RegenConfig(max_new_tokens=8), 4096)
    out, jobs = drive(regen, sample_of(enc, msgs), replies)
    assert isinstance(out, Sample) and len(jobs) == turn + 1
    assert out.meta == {"regen_turns": turn + 1, "dropped_turns": 2 - turn, "cut": "truncated", "cut_kept": True}
    assert regen.stats.cut_kept == 1 and regen.stats.turns_cut == 0
    # the sample ends with the cut answer's ids exactly as generated, all of them under the loss
    assert out.input_ids.tolist() == jobs[-1].body["input_ids"] + cut["output_ids"]
    a, b = out.loss_spans[-1]
    assert (a, b) == (len(jobs[-1].body["input_ids"]), out.num_tokens) and len(out.loss_spans) == turn + 1
    assert tok.decode(out.input_ids[a:b]) == " la la la la"
    assert [m.content for m in out.messages][-1] == " la la la la"


def test_a_later_turn_beyond_the_token_cap_is_dropped_and_a_first_one_skips(enc):
    msgs = conversation("q?", "x", "r " * 200 + "?", "y")
    cap = sample_of(enc, msgs).num_tokens + 8 + 64  # the first turn fits, the long second prompt does not
    out, jobs = drive(Regenerator(enc, RegenConfig(max_new_tokens=32), cap), sample_of(enc, msgs, max_tokens=cap),
                      [answer(enc, "Fine.")])
    assert isinstance(out, Sample) and len(jobs) == 1 and out.meta["dropped_turns"] == 1 and out.num_tokens <= cap
    # the limit (not max_new_tokens) cut the first answer: the conversation is over the cap
    cap = sample_of(enc, msgs[:2]).num_tokens + 8 + 20  # room for a 20-token answer and the closing
    out, _ = drive(Regenerator(enc, RegenConfig(max_new_tokens=512, keep_cut=False), cap),
                   sample_of(enc, msgs[:2], max_tokens=cap), [answer(enc, "Fine fine fine", finish="length")])
    assert isinstance(out, Skipped) and out.kind == "too_long"
    # kept (the default), that answer is the sample, within the cap
    out, _ = drive(Regenerator(enc, RegenConfig(max_new_tokens=512), cap), sample_of(enc, msgs[:2], max_tokens=cap),
                   [answer(enc, "Fine fine fine", finish="length")])
    assert isinstance(out, Sample) and out.meta["cut"] == "too_long" and out.num_tokens <= cap


def test_persisted_answers_are_replayed_without_a_request(enc):
    msgs = conversation("What is 2+2?", "x", "And 3+3?", "y")
    persisted: list[TurnAnswer] = []
    first = Regenerator(enc, RegenConfig(), 4096, on_answer=persisted.append)
    out, jobs = drive(first, sample_of(enc, msgs), [answer(enc, "It is 4."), answer(enc, "Six.")])
    assert len(jobs) == 2 and [a.turn for a in persisted] == [0, 1]
    # a resumed run that had persisted the first answer asks only for the second
    again = Regenerator(enc, RegenConfig(), 4096,
                        answers={("c", 0): TurnAnswer.from_json(persisted[0].to_json())})
    out2, jobs2 = drive(again, sample_of(enc, msgs), [answer(enc, "Six.")])
    assert [j.body["rid"] for j in jobs2] == ["nocapture:regen:c:1"] and again.stats.replayed == 1
    assert out2.input_ids.tolist() == out.input_ids.tolist() and out2.loss_spans == out.loss_spans
    # with every answer persisted, no request at all
    full = Regenerator(enc, RegenConfig(), 4096, answers={("c", a.turn): a for a in persisted})
    assert isinstance(full.start(sample_of(enc, msgs)), Sample)
