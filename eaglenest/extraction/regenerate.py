"""Regeneration: the target answers each prompt itself, and the sample is rebuilt from its own answers.

Owns turning a conversation into one the target wrote: every assistant turn is replaced, in order, by
what the target generates for the conversation so far (``POST /generate`` with a ``nocapture:`` rid,
so nothing is captured; greedy or sampled per :class:`RegenConfig`). A prompt-only record gets one
answer. The sample's ids splice the template's text (tokenized piecewise) with each answer's ids
exactly as generated (``output_ids``; re-tokenizing decoded text would change them), and the loss
spans cover those answer ids plus the template's end-of-turn token.

Invariants: a turn is generated only if prompt + ``max_new_tokens`` fits the token limit (a later turn
that does not fit is dropped with the rest, counted in ``meta['dropped_turns']``; a first turn that
does not fit skips the sample as too_long); sampled generation uses a per-sample, per-turn seed, so a
re-run asks for the same thing; requests go through :class:`~eaglenest.extraction.prefill.EngineClient`
(same retry policy as capture).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from eaglenest.contract import NO_CAPTURE_RID_PREFIX
from eaglenest.data.chat import ChatEncoder, SampleError, Skipped
from eaglenest.data.samples import Sample
from eaglenest.data.sources import Message
from eaglenest.extraction.prefill import Answer, ClientConfig, ClientStats, EngineClient, Failure, Job, run_sync


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


@dataclass(slots=True)
class RegenResult:
    samples: list[Sample] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    failures: dict[str, Failure] = field(default_factory=dict)
    stats: ClientStats = field(default_factory=ClientStats)
    truncated_answers: int = 0
    """Answers that hit max_new_tokens (kept; the template still closes the turn)."""


@dataclass(slots=True)
class _State:
    sample: Sample
    out: list[Message] = field(default_factory=list)
    i: int = 0
    turn: int = 0
    dropped: int = 0
    truncated: int = 0
    ids: list[int] = field(default_factory=list)
    """Token ids so far: rendered template text tokenized piecewise + the target's own answer ids."""
    text: str = ""
    """The template rendering of ``out[:rendered]`` (what ``ids`` stand for)."""
    spans: list[tuple[int, int]] = field(default_factory=list)
    rendered: int = 0
    pending: tuple[str, list[int]] | None = None
    error: SampleError | None = None


def _seed(base: int, sample_id: str, turn: int) -> int:
    digest = hashlib.sha256(f"{base}:{sample_id}:{turn}".encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


_CLOSING_RESERVE = 8
"""Tokens kept free for the template's end-of-turn after a generated answer."""


class _Planner:
    """Builds each conversation turn by turn. The sample's ids are the template's text (tokenized piece
    by piece, each piece a suffix of the previous rendering) spliced with the answer ids exactly as the
    target generated them, so the capture sees the target's own tokens, not a re-tokenization."""

    def __init__(self, encoder: ChatEncoder, config: RegenConfig, max_tokens: int) -> None:
        self.encoder, self.config, self.max_tokens = encoder, config, max_tokens
        self.stop_ids = {i for i in (encoder.tokenizer.eos_token_id,) if i is not None}

    def _tokens(self, text: str) -> list[int]:
        return self.encoder.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def _extend(self, st: _State, text: str) -> list[int]:
        if not text.startswith(st.text):
            raise SampleError("chat template is not prefix-stable across turns; cannot splice regenerated answers")
        return self._tokens(text[len(st.text):])

    def next_job(self, st: _State) -> Job | None:
        """Advance to the next point that needs an answer; None when the conversation is complete."""
        try:
            return self._next_job(st)
        except SampleError as e:
            st.error, st.i = e, len(st.sample.messages)
            return None

    def _next_job(self, st: _State) -> Job | None:
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
                st.dropped = sum(1 for x in orig[st.i - 1:] if x.role == "user")
                st.i = len(orig)
                return None
            st.pending = (text, delta)
            sp: dict[str, Any] = {"max_new_tokens": budget, "temperature": self.config.temperature,
                                  "top_p": self.config.top_p}
            if self.config.temperature > 0:
                sp["sampling_seed"] = _seed(self.config.seed, st.sample.sample_id, st.turn)
            rid = f"{NO_CAPTURE_RID_PREFIX}regen:{st.sample.sample_id}:{st.turn}"
            return Job(rid, {"input_ids": prompt, "rid": rid, "sampling_params": sp}, payload=st)
        return None

    def answered(self, st: _State, body: dict[str, Any]) -> None:
        """Splice one generated answer (its ids as generated, minus the stop token) and the turn's end."""
        text, delta = st.pending
        content = body["text"]
        finish = (body.get("meta_info") or {}).get("finish_reason") or {}
        kind = finish.get("type") if isinstance(finish, dict) else None
        ids = body.get("output_ids")
        if isinstance(ids, list) and all(isinstance(x, int) for x in ids):
            ids = list(ids)
            if kind == "stop" and ids and (ids[-1] in self.stop_ids or ids[-1] == finish.get("matched")):
                ids.pop()  # the template writes its own end-of-turn
        else:  # the server returned text only: tokenize it (may differ from what was generated)
            ids = self._tokens(content)
        st.truncated += kind == "length"
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

    def finish(self, st: _State) -> Sample:
        if st.error is not None:
            raise st.error
        if not st.spans:
            least = min(self.config.min_new_tokens, self.config.max_new_tokens)
            raise SampleError(f"the prompt leaves fewer than {least} tokens for an answer "
                              f"within {self.max_tokens}", "too_long")
        if len(st.ids) > self.max_tokens:
            raise SampleError(f"{len(st.ids)} tokens after regeneration > limit {self.max_tokens}", "too_long")
        meta = {"regen_turns": st.turn, "dropped_turns": st.dropped, "truncated_answers": st.truncated}
        return st.sample.with_ids(st.ids, st.spans, messages=tuple(st.out[: st.rendered]), regenerated=True,
                                  meta=meta)


async def regenerate_async(
    samples: Sequence[Sample], servers: Sequence[str], encoder: ChatEncoder, *, max_tokens: int,
    config: RegenConfig | None = None, client_config: ClientConfig | None = None, transport=None,
    on_sample: Callable[[Sample], None] | None = None,
) -> RegenResult:
    """Regenerate every sample's assistant turns; ``on_sample`` sees each finished sample (to persist it)."""
    planner = _Planner(encoder, config or RegenConfig(), max_tokens)
    client = EngineClient(servers, config=client_config, transport=transport)
    result = RegenResult(stats=client.stats)

    def settle(st: _State) -> None:
        try:
            sample = planner.finish(st)
        except SampleError as e:
            result.skipped.append(Skipped(st.sample.sample_id, e.kind, e.reason))
            return
        result.samples.append(sample)
        result.truncated_answers += st.truncated
        if on_sample is not None:
            on_sample(sample)

    def on_outcome(o: Answer | Failure) -> list[Job]:
        st: _State = o.payload
        if isinstance(o, Failure):
            result.failures[st.sample.sample_id] = o
            return []
        if not isinstance(o.body.get("text"), str):
            result.failures[st.sample.sample_id] = Failure(
                o.key, "terminal", "contract", "generation answer has no text", o.server, o.attempts)
            return []
        try:
            planner.answered(st, o.body)
        except SampleError as e:
            st.error = e
            settle(st)
            return []
        job = planner.next_job(st)
        if job is None:
            settle(st)
            return []
        return [job]

    first: list[Job] = []
    for s in samples:
        st = _State(s)
        job = planner.next_job(st)
        if job is None:
            settle(st)
        else:
            first.append(job)
    await client.run(first, on_outcome=on_outcome)
    return result


def regenerate(samples: Sequence[Sample], servers: Sequence[str], encoder: ChatEncoder, **kwargs) -> RegenResult:
    """Blocking :func:`regenerate_async`."""
    return run_sync(lambda: regenerate_async(samples, servers, encoder, **kwargs))
