"""Self-prompting: the target writes the user prompts as well as the answers (Magpie-style).

An instruct model fed only its chat template up to the start of a user turn (system prompt included, as
the template renders it) continues with a user request of its own, drawn from the distribution of requests
it was tuned on. Sampling many of them (temperature > 0, a seed per prompt) gives prompts no dataset is
needed for; the regeneration recipe then lets the target answer them, so the whole sample is the target's
own text. Measured with SmolLM2-135M-Instruct: advice, recipes, writing and planning requests, mostly one
or two sentences.

Left to itself the target writes mostly advice and explanations; chat benchmarks also ask for math, code,
roleplay, writing and extraction. ``starters`` steer it: prompt i begins with opening ``i mod n`` (e.g. "Solve
for x:") and the target writes the rest of the request, so the prompts spread over the kinds the openings name
while their text is still the target's. :data:`~eaglenest.extraction.starters.STARTER_SETS` has a built-in spread
(``kinds``) over the eight kinds MT-Bench groups its questions in; no opening is taken from an evaluation set,
and a finished prompt that equals an evaluation prompt is left out as before.

:func:`self_prompts` asks running capture servers (``POST /generate`` with ``nocapture:`` rids: nothing is
captured) for ``count`` user turns and keeps those that ended on their own (an end-of-turn, not
``max_new_tokens``), are at least ``min_chars`` long, are not a duplicate and are not a user turn of an
evaluation prompt set; every other one is counted by its reason. Records are ``{"id": "self-<seed>-<i>",
"messages": [user]}``, a source the extraction reads as it is.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from eaglenest.contract import NO_CAPTURE_RID_PREFIX
from eaglenest.data.chat import ChatEncoder, SampleError
from eaglenest.data.sources import Message, write_jsonl
from eaglenest.extraction.aio import run_sync
from eaglenest.extraction.client import Answer, ClientConfig, EngineClient, Job
from eaglenest.extraction.starters import STARTER_SETS

_MARK = "\u2063eaglenest-user-turn\u2063"
"""Stands in for the user's text while the template is rendered; no template holds it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SelfPromptConfig:
    count: int
    """User prompts asked for (fewer are kept: see the report's skip counts)."""
    seed: int = 0
    """Base seed; prompt i is sampled with a seed of its own, so a re-run asks for the same prompts (the embedded
    engine honours it; SGLang 0.5.17 only with ``--enable-deterministic-inference``, else the prompts differ)."""
    temperature: float = 1.0
    top_p: float = 0.95
    max_new_tokens: int = 256
    min_chars: int = 16
    starters: tuple[str, ...] = ()
    """Openings of the user's text: prompt i begins with ``starters[i % len(starters)]`` and the target writes the
    rest (an empty opening leaves it free). None: every prompt is the target's choice."""

    def __post_init__(self) -> None:
        if self.count < 1 or self.max_new_tokens < 1 or self.min_chars < 0:
            raise ValueError("count and max_new_tokens must be >= 1, min_chars >= 0")
        bad = [s for s in self.starters if s != s.strip()]
        if bad:
            raise ValueError(f"starters must not begin or end with whitespace (the target writes the space after "
                             f"one): {bad[:3]}")
        if not self.temperature > 0:
            raise ValueError("temperature must be > 0: greedy decoding writes the same prompt every time")


def user_turn_prefix(encoder: ChatEncoder) -> list[int]:
    """Token ids of the template up to where a first user message's text starts."""
    text = encoder.render([Message("user", _MARK)])
    if text.count(_MARK) != 1:
        raise SampleError("the chat template does not render the user's text once; cannot self-prompt")
    return encoder.tokenizer(text[: text.index(_MARK)], add_special_tokens=False)["input_ids"]


def starter_of(config: SelfPromptConfig, i: int) -> str:
    """The opening prompt ``i`` begins with ("" when none)."""
    return config.starters[i % len(config.starters)] if config.starters else ""


def prompt_jobs(prefix: list[int], config: SelfPromptConfig, encoder: ChatEncoder | None = None) -> list[Job]:
    """One request per prompt: the template prefix, then prompt i's opening (tokenized by ``encoder``)."""
    if config.starters and encoder is None:
        raise ValueError("starters need the target's encoder to tokenize them")
    opening = {s: encoder.tokenizer(s, add_special_tokens=False)["input_ids"] if s else []
               for s in config.starters}
    jobs = []
    for i in range(config.count):
        rid = f"{NO_CAPTURE_RID_PREFIX}self:{config.seed}:{i}"
        sp = {"max_new_tokens": config.max_new_tokens, "temperature": config.temperature, "top_p": config.top_p,
              "sampling_seed": config.seed * 1_000_003 + i}
        ids = prefix + opening.get(starter_of(config, i), [])
        jobs.append(Job(rid, {"input_ids": ids, "rid": rid, "sampling_params": sp}, payload=i))
    return jobs


def keep_prompts(answers: list[tuple[int, dict[str, Any]]], config: SelfPromptConfig, *,
                 exclude: set[str] = frozenset()) -> tuple[list[dict], Counter]:
    """(records in prompt order, skip counts by reason) from (prompt index, answer body) pairs."""
    skipped: Counter = Counter()
    seen: set[str] = set()
    evals = {_key(t) for t in exclude}
    records = []
    for i, body in sorted(answers, key=lambda a: a[0]):
        meta = body.get("meta_info") or {}
        finish = meta.get("finish_reason") if isinstance(meta, dict) else None
        written = str(body.get("text") or "")
        text = (starter_of(config, i) + written).strip()
        key = _key(text)
        if not isinstance(finish, dict) or finish.get("type") != "stop":
            skipped["cut"] += 1  # ran into max_new_tokens (or was aborted): not a finished request
        elif len(text) < config.min_chars or not written.strip():
            skipped["too_short"] += 1  # (an opening the target did not continue is no request)
        elif key in evals:
            skipped["eval_prompt"] += 1
        elif key in seen:
            skipped["duplicate"] += 1
        else:
            seen.add(key)
            records.append({"id": f"self-{config.seed}-{i}", "messages": [{"role": "user", "content": text}]})
    return records, skipped


def _key(text: str) -> str:
    """What two prompts share when they differ only in case and spacing."""
    return " ".join(text.lower().split())


def self_prompts(server_urls: list[str], model_dir: str | Path, config: SelfPromptConfig, out: str | Path, *,
                 exclude: set[str] = frozenset(), client: ClientConfig | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> dict[str, Any]:
    """Ask the servers for ``config.count`` user prompts; write the kept ones to ``out`` (JSONL, .xz
    compressed by name); returns the report (kept, skipped by reason, failed requests, tokens)."""
    encoder = ChatEncoder(model_dir)
    prefix = user_turn_prefix(encoder)
    engine = EngineClient(server_urls, config=client or ClientConfig(concurrency=64), transport=transport)
    jobs = prompt_jobs(prefix, config, encoder)
    outcomes = run_sync(lambda: engine.run(jobs))  # (a SIGTERM always ends it: see aio)
    answers = [(o.payload, o.body) for o in outcomes if isinstance(o, Answer)]
    failed = Counter(o.reason for o in outcomes if not isinstance(o, Answer))
    records, skipped = keep_prompts(answers, config, exclude=exclude)
    if not records:
        raise RuntimeError(f"no prompt was kept of {config.count} (skipped {dict(skipped)}, failed {dict(failed)})")
    write_jsonl(out, records)
    generated = sum(len(b.get("output_ids") or []) for _, b in answers)
    return {"asked": config.count, "kept": len(records), "skipped": dict(skipped), "failed": dict(failed),
            "generated_tokens": generated, "requests": engine.stats.requests, "starters": len(config.starters),
            "out": str(out)}


def exclusions(prompt_sets: Sequence[str] = (), file: str | Path | None = None, *,
               name: str = "exclude file") -> set[str]:
    """User texts a self prompt must not equal: those of evaluation ``prompt_sets`` and of ``file`` (a JSON list
    of strings). Raises ValueError naming ``name`` (the option or field) and what is wrong with ``file``."""
    from eaglenest.speculative.prompts import user_texts

    out = set(user_texts(list(prompt_sets)))
    if file is not None:
        try:
            texts = json.loads(Path(file).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{name} {file}: not readable JSON ({e})") from None
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise ValueError(f"{name} {file}: expected a JSON list of strings")
        out |= {t.strip() for t in texts}
    return out


def starters_of(sets: Sequence[str], own: Sequence[str] = (), *, name: str = "starter set") -> tuple[str, ...]:
    """``own`` openings, then those of the built-in ``sets`` (ValueError naming ``name`` for one not built in)."""
    for s in sets:
        if s not in STARTER_SETS:
            raise ValueError(f"{name} {s!r}: not a built-in set (have: {', '.join(STARTER_SETS)})")
    return tuple(own) + tuple(s for n in sets for s in STARTER_SETS[n])


def ask_for_extraction(ext_dir: Path, model_dir: str | Path, params: Any, server_urls: list[str], *,
                       concurrency: int) -> dict[str, Any]:
    """The prompts of an extraction (``params``: its ``SelfPromptParams``) from its own servers, written to
    ``ext_dir/self-prompts.jsonl.xz`` all at once (a run killed meanwhile leaves none, and the next one asks
    again), with the report beside it (self-prompts.json)."""
    from eaglenest.extraction.state import SELF_PROMPTS

    cfg = SelfPromptConfig(count=params.count, seed=params.seed, temperature=params.temperature, top_p=params.top_p,
                           max_new_tokens=params.max_new_tokens, starters=starters_of(params.starter_sets))
    exclude = exclusions(params.exclude_prompt_sets, params.exclude_file, name="self_prompts.exclude_file")
    tmp = ext_dir / f".{SELF_PROMPTS}.partial.jsonl.xz"
    report = self_prompts(server_urls, model_dir, cfg, tmp, exclude=exclude,
                          client=ClientConfig(concurrency=concurrency))
    report["out"] = str(ext_dir / SELF_PROMPTS)
    (ext_dir / "self-prompts.json").write_text(json.dumps(report, indent=1))
    os.replace(tmp, ext_dir / SELF_PROMPTS)
    return report
