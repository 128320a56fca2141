"""Regeneration: the target answers each prompt itself, and the sample is rebuilt from its own answers.

Owns turning a conversation into one the target wrote: every assistant turn is replaced, in order, by
what the target generates for the conversation so far (turn i sees the target's own answers to turns
< i; ``POST /generate`` with a ``nocapture:`` rid, so nothing is captured; greedy or sampled per
:class:`RegenConfig`). A prompt-only record gets one answer. The sample's ids splice the template's
text (tokenized piecewise) with each answer's ids exactly as generated (``output_ids``; re-tokenizing
decoded text would change them), and the loss spans cover those answer ids plus the template's
end-of-turn token (so the drafter learns to stop), never the prompt or the template's other text.

:class:`Regenerator` is driven by the extraction's one loop: :meth:`Regenerator.start` and
:meth:`Regenerator.answered` return the next request (a :class:`~eaglenest.extraction.client.Job`),
the finished :class:`Sample`, or a :class:`Skipped` decision. Every answer is handed to ``on_answer``
(to persist it) before it is used, and answers given back through ``answers`` are replayed without a
request: a resumed run never asks for an answer it already has.

Invariants: a turn is generated only if prompt + ``min_new_tokens`` fits the token limit; an empty answer
skips the sample in the first turn (``empty_answer``) and drops the rest of the conversation later. An
answer cut by ``max_new_tokens`` or by the limit is, with ``keep_cut`` (the default), spliced as the
sample's last turn: loss on the ids the target wrote, no end of turn (it did not end), later turns dropped
(``meta['cut']``, ``meta['cut_kept']``); without ``keep_cut`` it is never trained on (first turn: the sample is
skipped as ``truncated`` / ``too_long``; later: that turn and the rest are dropped). Sampled generation uses
a per-sample, per-turn seed, so a re-run asks for the same thing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from eaglenest.contract import NO_CAPTURE_RID_PREFIX
from eaglenest.data.chat import ChatEncoder, SampleError, Skipped
from eaglenest.data.samples import Sample
from eaglenest.data.sources import Message
from eaglenest.extraction.client import Job


class AnswerError(ValueError):
    """The engine's answer to a generation request cannot be used (no text, or the engine aborted it): a terminal
    failure of that sample. Other errors while using an answer (a log that cannot be written) are not the engine's
    and are never reported as this."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RegenConfig:
    temperature: float = 0.0
    """0 = greedy."""
    top_p: float = 1.0
    max_new_tokens: int = 512
    """Most tokens per generated answer (also bounded by the token limit)."""
    min_new_tokens: int = 16
    """A turn is generated only if at least this many new tokens fit."""
    seed: int = 0
    keep_cut: bool = True
    """Train on an answer cut by max_new_tokens or the token limit (as the sample's last turn)."""


@dataclass(frozen=True, slots=True)
class TurnAnswer:
    """One generated answer, as persisted (``answers.jsonl``) and replayed on resume."""

    sample_id: str
    turn: int
    text: str
    output_ids: list[int] | None
    finish: str | None
    """The engine's finish reason type: stop | length | abort | None."""
    budget: int
    """max_new_tokens the request asked for (a ``length`` finish below the configured maximum means the
    token limit cut the answer, not max_new_tokens)."""

    def to_json(self) -> dict[str, Any]:
        return {"sample_id": self.sample_id, "turn": self.turn, "text": self.text, "output_ids": self.output_ids,
                "finish": self.finish, "budget": self.budget}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> TurnAnswer:
        ids = d.get("output_ids")
        return cls(str(d["sample_id"]), int(d["turn"]), str(d["text"]),
                   [int(x) for x in ids] if isinstance(ids, list) else None, d.get("finish"), int(d["budget"]))


@dataclass(slots=True)
class _State:
    sample: Sample
    out: list[Message] = field(default_factory=list)
    i: int = 0
    turn: int = 0
    dropped: int = 0
    cut: str | None = None
    """Why the turns from ``turn`` on were dropped (truncated | empty_answer | too_long), if an answer was cut."""
    cut_kept: bool = False
    """The cut answer itself is the sample's last turn (keep_cut)."""
    ids: list[int] = field(default_factory=list)
    """Token ids so far: rendered template text tokenized piecewise + the target's own answer ids."""
    text: str = ""
    """The template rendering of ``out[:rendered]`` (what ``ids`` stand for)."""
    spans: list[tuple[int, int]] = field(default_factory=list)
    rendered: int = 0
    pending: tuple[str, list[int], int] | None = None
    """(rendered prompt text, its new ids, the request's max_new_tokens) of the turn being generated."""


def _seed(base: int, sample_id: str, turn: int) -> int:
    digest = hashlib.sha256(f"{base}:{sample_id}:{turn}".encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


_CLOSING_RESERVE = 8
"""Tokens kept free for the template's end-of-turn after a generated answer."""

Outcome = Job | Sample | Skipped


@dataclass(slots=True)
class RegenStats:
    requests_planned: int = 0
    answers: int = 0
    """Answers received from the engine this run."""
    replayed: int = 0
    """Answers reused from an earlier run (no request)."""
    generated_tokens: int = 0
    samples: int = 0
    skipped: int = 0
    turns_cut: int = 0
    """Later turns whose answer was cut or empty: dropped with the rest of their conversation."""
    cut_kept: int = 0
    """Answers cut by max_new_tokens or the token limit, kept as their sample's last turn (keep_cut)."""


class Regenerator:
    """Builds each conversation turn by turn. The sample's ids are the template's text (tokenized piece
    by piece, each piece a suffix of the previous rendering) spliced with the answer ids exactly as the
    target generated them, so the capture sees the target's own tokens, not a re-tokenization."""

    def __init__(self, encoder: ChatEncoder, config: RegenConfig, max_tokens: int, *,
                 answers: Mapping[tuple[str, int], TurnAnswer] | None = None,
                 on_answer: Callable[[TurnAnswer], None] | None = None, priority: int = 0,
                 next_turn_priority: int | None = None) -> None:
        """``priority``: of a conversation's first request; ``next_turn_priority`` (default the same): of the
        requests for its later turns (a conversation under way may go ahead of new ones)."""
        self.encoder, self.config, self.max_tokens = encoder, config, max_tokens
        self.stop_ids = {i for i in (encoder.tokenizer.eos_token_id,) if i is not None}
        self.answers = dict(answers or {})
        self.on_answer, self.priority = on_answer, priority
        self.next_turn_priority = priority if next_turn_priority is None else next_turn_priority
        self.stats = RegenStats()

    # ---------------------------------------------------------------- driving
    def start(self, sample: Sample) -> Outcome:
        """The first request for ``sample`` (or its finished form when every answer is persisted)."""
        return self._advance(_State(sample))

    def answered(self, state: Any, body: dict[str, Any]) -> Outcome:
        """Use the engine's answer to a request of ours (``state`` is its ``Job.payload``); returns the next
        request, the sample, or a skip. A body without text, or an aborted generation, raises AnswerError
        (a terminal failure of the sample, reported; nothing is persisted for it)."""
        st: _State = state
        if not isinstance(body.get("text"), str):
            raise AnswerError("generation answer has no text")
        meta = body.get("meta_info") or {}
        finish = meta.get("finish_reason") if isinstance(meta, dict) else None
        kind = finish.get("type") if isinstance(finish, dict) else None
        if kind == "abort":  # the engine refused or dropped the request: a failure to report, not an answer
            raise AnswerError(f"generation aborted by the engine: {finish.get('message') or finish}")
        ids = body.get("output_ids")
        if isinstance(ids, list) and all(isinstance(x, int) for x in ids):
            ids = list(ids)
            if kind == "stop" and ids and (ids[-1] in self.stop_ids or ids[-1] == finish.get("matched")):
                ids.pop()  # the template writes its own end-of-turn
            self.stats.generated_tokens += len(body.get("output_ids"))
        else:
            ids = None
        self.stats.answers += 1
        ans = TurnAnswer(st.sample.sample_id, st.turn, body["text"], ids, kind, st.pending[2])
        if self.on_answer is not None:
            self.on_answer(ans)  # persisted before use: a crash from here on never asks for it again
        return self._use(st, ans)

    def _use(self, st: _State, ans: TurnAnswer) -> Outcome:
        try:
            self._splice(st, ans)
        except SampleError as e:
            return self._skip(st, e)
        return self._advance(st)

    def _advance(self, st: _State) -> Outcome:
        while True:
            try:
                job = self._next_job(st)
            except SampleError as e:
                return self._skip(st, e)
            if job is None:
                return self._finish(st)
            ans = self.answers.get((st.sample.sample_id, st.turn))
            if ans is None:
                self.stats.requests_planned += 1
                return job
            self.stats.replayed += 1
            try:
                self._splice(st, ans)
            except SampleError as e:
                return self._skip(st, e)

    def _skip(self, st: _State, e: SampleError) -> Skipped:
        self.stats.skipped += 1
        return Skipped(st.sample.sample_id, e.kind, e.reason)

    # ---------------------------------------------------------------- the splice
    def _tokens(self, text: str) -> list[int]:
        return self.encoder.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def _extend(self, st: _State, text: str) -> list[int]:
        if not text.startswith(st.text):
            raise SampleError("chat template is not prefix-stable across turns; cannot splice regenerated answers")
        return self._tokens(text[len(st.text):])

    def _next_job(self, st: _State) -> Job | None:
        """Advance to the next point that needs an answer; None when the conversation is complete."""
        orig = st.sample.messages
        while st.i < len(orig):
            m = orig[st.i]
            st.i += 1
            if m.role == "assistant":
                continue  # replaced by the target's own answer
            st.out.append(m)
            nxt = orig[st.i] if st.i < len(orig) else None
            if m.role != "user" or (nxt is not None and nxt.role != "assistant"):
                continue
            text = self.encoder.render(st.out, add_generation_prompt=True)
            delta = self._extend(st, text)
            prompt = st.ids + delta
            budget = min(self.config.max_new_tokens, self.max_tokens - len(prompt) - _CLOSING_RESERVE)
            if budget < min(self.config.min_new_tokens, self.config.max_new_tokens):
                self._drop_rest(st)
                return None
            st.pending = (text, delta, budget)
            sp: dict[str, Any] = {"max_new_tokens": budget, "temperature": self.config.temperature,
                                  "top_p": self.config.top_p}
            if self.config.temperature > 0:
                sp["sampling_seed"] = _seed(self.config.seed, st.sample.sample_id, st.turn)
            rid = f"{NO_CAPTURE_RID_PREFIX}regen:{st.sample.sample_id}:{st.turn}"
            return Job(rid, {"input_ids": prompt, "rid": rid, "sampling_params": sp}, payload=st,
                       priority=self.priority if st.turn == 0 else self.next_turn_priority)
        return None

    def _drop_rest(self, st: _State, *, keep_this: bool = False) -> None:
        """Every later turn is left out, and this one too unless ``keep_this`` (the conversation so far is the
        sample)."""
        orig = st.sample.messages
        st.dropped = sum(1 for x in orig[st.i if keep_this else st.i - 1:] if x.role == "user")
        st.i = len(orig)
        st.pending = None

    def _splice(self, st: _State, ans: TurnAnswer) -> None:
        """Splice one answer (its ids as generated, minus the stop token) and the turn's end."""
        text, delta, budget = st.pending
        content = ans.text
        problem = None
        if ans.finish == "length":
            limit = budget < self.config.max_new_tokens  # the token limit cut it, not max_new_tokens
            problem = SampleError(f"the answer to turn {st.turn} reached the token limit {self.max_tokens}",
                                  "too_long") if limit else SampleError(
                f"the answer to turn {st.turn} was cut at max_new_tokens={budget}", "truncated")
        elif not content.strip():
            problem = SampleError(f"the target's answer to turn {st.turn} is empty", "empty_answer")
        if problem is not None and problem.kind != "empty_answer" and self.config.keep_cut:
            self._splice_cut(st, ans, problem.kind)
            return
        if problem is not None:
            if st.turn == 0:
                raise problem
            # a cut or empty later answer is never trained on; the complete turns before it still are (skipping
            # the whole conversation threw away most multi-turn data: long conversations loop somewhere)
            self._drop_rest(st)
            st.cut = problem.kind
            self.stats.turns_cut += 1
            return
        ids = ans.output_ids if ans.output_ids is not None else self._tokens(content)  # text only: re-tokenized
        st.out.append(Message("assistant", content))
        full = self.encoder.render(st.out)
        if not full.startswith(text + content):
            raise SampleError("chat template changes an answer's text when rendering it; cannot splice")
        closing = full[len(text) + len(content):]
        core = closing.rstrip()
        core_ids, rest_ids = self._tokens(core), self._tokens(closing[len(core):])
        start = len(st.ids) + len(delta)
        st.ids = st.ids + delta + ids + core_ids + rest_ids
        if ids or core_ids:
            st.spans.append((start, start + len(ids) + len(core_ids)))
        st.text, st.rendered, st.pending = full, len(st.out), None
        st.turn += 1

    def _splice_cut(self, st: _State, ans: TurnAnswer, kind: str) -> None:
        """A cut answer as the sample's last turn: its ids as generated under the loss, nothing after them (the
        target did not end the turn, so no end-of-turn token is added or trained on)."""
        text, delta, _ = st.pending
        ids = ans.output_ids if ans.output_ids is not None else self._tokens(ans.text)
        start = len(st.ids) + len(delta)
        st.ids = st.ids + delta + ids
        if ids:
            st.spans.append((start, start + len(ids)))
        st.out.append(Message("assistant", ans.text))
        st.text, st.rendered = text + ans.text, len(st.out)
        st.turn += 1
        st.cut, st.cut_kept = kind, True
        self.stats.cut_kept += 1
        self._drop_rest(st, keep_this=True)

    def _finish(self, st: _State) -> Sample | Skipped:
        if not st.spans:
            least = min(self.config.min_new_tokens, self.config.max_new_tokens)
            return self._skip(st, SampleError(f"the prompt leaves fewer than {least} tokens for an answer "
                                              f"within {self.max_tokens}", "too_long"))
        if len(st.ids) > self.max_tokens:
            return self._skip(st, SampleError(f"{len(st.ids)} tokens after regeneration > limit {self.max_tokens}",
                                              "too_long"))
        self.stats.samples += 1
        meta = {"regen_turns": st.turn, "dropped_turns": st.dropped, **({"cut": st.cut} if st.cut else {}),
                **({"cut_kept": True} if st.cut_kept else {})}
        return st.sample.with_ids(st.ids, st.spans, messages=tuple(st.out[: st.rendered]), regenerated=True,
                                  meta=meta)
