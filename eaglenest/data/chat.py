"""Tokenization with the target's own chat template and an assistant-only loss mask.

Owns records -> :class:`~eaglenest.data.samples.Sample`. The loss mask is computed by rendering
PREFIXES of the conversation with the template (never by searching for role markers), so templates
that inject text (SmolLM2 adds a default system prompt when none is given) are handled: for an
assistant turn i, its tokens are those whose characters lie between the end of
``render(messages[:i], add_generation_prompt=True)`` and the end of ``render(messages[:i + 1])``
(trailing whitespace the template adds after the end-of-turn token excluded; the end-of-turn token
itself carries loss, so the drafter learns to stop).

Invariants: the ids are exactly ``tokenizer(render(messages), add_special_tokens=False)`` (what
``apply_chat_template(tokenize=True)`` returns); a template that is not prefix-stable fails the
sample with a reason instead of producing a wrong mask; samples longer than the limit are skipped
and counted, never truncated.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from eaglenest.data.samples import Sample
from eaglenest.data.sources import Message, Record


class SampleError(ValueError):
    """This conversation cannot become a sample (reason in the message). Counted as skipped."""

    def __init__(self, reason: str, kind: str = "template") -> None:
        super().__init__(reason)
        self.reason, self.kind = reason, kind


@dataclass(frozen=True, slots=True)
class Skipped:
    sample_id: str
    kind: str
    """too_long | no_assistant | template | regeneration."""
    reason: str


class ChatEncoder:
    """The target's tokenizer + chat template; hashes match the server's provenance fields."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        from eaglenest.models import model_fingerprint

        self.model_dir = Path(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.tokenizer.model_max_length = 1 << 40  # lengths are checked (and skipped) here, not warned about
        if not getattr(self.tokenizer, "chat_template", None):
            raise SampleError(f"the tokenizer in {self.model_dir} has no chat template; give a chat model")
        fp = model_fingerprint(self.model_dir)
        self.tokenizer_hash = fp["tokenizer_hash"]
        self.chat_template_hash = fp["chat_template_hash"]

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in messages],
                tokenize=False, add_generation_prompt=add_generation_prompt,
            )
        except Exception as e:  # jinja raises for conversations the template refuses
            raise SampleError(f"chat template refused the conversation: {e}") from None

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """Token ids of the conversation followed by the assistant generation prompt."""
        text = self.render(messages, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode(self, messages: Sequence[Message]) -> tuple[list[int], tuple[tuple[int, int], ...]]:
        """Token ids of the whole conversation and the half-open token spans of assistant turns."""
        full = self.render(messages)
        char_spans = []
        for i, m in enumerate(messages):
            if m.role != "assistant":
                continue
            if i == 0:
                raise SampleError("conversation starts with an assistant turn")
            start = self.render(messages[:i], add_generation_prompt=True)
            upto = self.render(messages[: i + 1])
            if not (full.startswith(start) and full.startswith(upto) and len(start) <= len(upto)):
                raise SampleError(
                    f"chat template is not prefix-stable at turn {i} (rendering a prefix of the conversation "
                    "is not a prefix of the full rendering), so the assistant mask cannot be derived"
                )
            end = len(upto)
            while end > len(start) and upto[end - 1].isspace():
                end -= 1
            char_spans.append((len(start), end))
        enc = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        starts = [s for s, _ in offsets]
        spans: list[tuple[int, int]] = []
        for a, b in char_spans:
            lo = bisect.bisect_left(starts, a)  # first token starting inside the turn
            hi = lo
            while hi < len(offsets) and offsets[hi][1] <= b:
                hi += 1
            if hi == lo:
                continue
            if spans and spans[-1][1] > lo:
                raise SampleError(f"assistant spans overlap at token {lo}")
            spans.append((lo, hi))
        return ids, tuple(spans)


def truncate_turns(record: Record, max_turns: int | None) -> Record:
    """Keep the conversation up to and including its ``max_turns``-th assistant turn."""
    if max_turns is None:
        return record
    seen = 0
    for i, m in enumerate(record.messages):
        if m.role == "assistant":
            seen += 1
            if seen == max_turns:
                return replace(record, messages=record.messages[: i + 1])
    return record


def fit_turns(record: Record, encoder: ChatEncoder, max_tokens: int) -> tuple[Record, int] | None:
    """The longest prefix of whole assistant turns that renders within ``max_tokens``, with its token count;
    None when not even the first turn fits (or the record has no assistant turn). A conversation too long as
    a whole keeps its first turns instead of being dropped."""
    turns = sum(m.role == "assistant" for m in record.messages)
    if turns == 0:
        return None
    ids, _ = encoder.encode(record.messages)  # as it is (a trailing unanswered user turn included)
    if len(ids) <= max_tokens:
        return record, len(ids)
    for n in range(turns, 0, -1):
        cut = truncate_turns(record, n)
        if len(cut.messages) == len(record.messages):
            continue  # the record itself, measured above
        ids, _ = encoder.encode(cut.messages)
        if len(ids) <= max_tokens:
            return cut, len(ids)
    return None


def build_sample(record: Record, encoder: ChatEncoder, *, max_tokens: int, regenerate: bool = False) -> Sample:
    """One record -> Sample, or SampleError (kind too_long / no_assistant / template).

    With ``regenerate`` the original answers will be replaced: the ids are the first prompt only
    (what must fit), and the messages keep the conversation's structure for the regeneration.
    """
    msgs = record.messages
    if regenerate:
        first_user = next(i for i, m in enumerate(msgs) if m.role == "user")
        ids, spans = encoder.prompt_ids(msgs[: first_user + 1]), ()
    elif not any(m.role == "assistant" for m in msgs):
        raise SampleError("no assistant turn to learn from (enable regeneration to answer prompts)", "no_assistant")
    else:
        ids, spans = encoder.encode(msgs)
        if not spans:
            raise SampleError("assistant turns produced no tokens", "template")
    if len(ids) > max_tokens:
        raise SampleError(f"{len(ids)} tokens > limit {max_tokens}", "too_long")
    return Sample(sample_id=record.id, input_ids=ids, loss_spans=spans, messages=msgs, source_index=record.index)


def build_samples(
    records: Sequence[Record], encoder: ChatEncoder, *, max_tokens: int, regenerate: bool = False,
    max_turns: int | None = None,
) -> tuple[list[Sample], list[Skipped]]:
    samples, skipped = [], []
    for r in records:
        try:
            samples.append(build_sample(truncate_turns(r, max_turns), encoder, max_tokens=max_tokens,
                                        regenerate=regenerate))
        except SampleError as e:
            skipped.append(Skipped(r.id, e.kind, e.reason))
    return samples, skipped
