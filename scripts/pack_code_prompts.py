"""Coding prompts from the Python standard library's own functions, for the target to answer (regeneration).

    python scripts/pack_code_prompts.py --out code.jsonl.xz [--count 4000] [--append-to train-mt.jsonl.xz]

ShareGPT's first prompts are only 8,459, and the drafter trained on them accepts fewer tokens on code
(HumanEval) than on ShareGPT-like prompts. This writes user-only records ``{"id", "messages": [user]}`` asking
to implement, explain, test or use a public function of the standard library, named with its signature and
its docstring's first paragraph (functions without a docstring of 40+ characters are left out). The
regeneration recipe lets the target answer them. The prompts are fixed by the Python version (modules,
functions and templates in sorted order; the template picked by a hash of the function's name), so a re-run
writes the same file. No evaluation prompt can be among them: every prompt names a standard-library
function, and records whose text equals a user turn of mt-bench, humaneval or the ShareGPT held-out split
are dropped anyway (counted). ``--append-to`` writes the records after an existing pack, so one source
holds both; with ``--spread`` they are spread evenly through it instead (one after every n-th of its records), so
an extraction cut short by its time budget or ``--limit`` still gets both kinds in their proportion.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import lzma
import pkgutil
import sys
import time
import warnings
from pathlib import Path

from eaglenest.data.sources import write_jsonl
from eaglenest.speculative.prompts import PROMPT_SETS, user_texts

TEMPLATES = (
    "Write a Python function `{name}{sig}` that does the following: {doc}\nExplain your implementation briefly.",
    "Implement `{qual}{sig}` from scratch in plain Python (do not import {module}). What it does: {doc}",
    "Explain what Python's `{qual}{sig}` does, with a short example of its use.\nFrom its documentation: {doc}",
    "Write pytest unit tests for `{qual}{sig}`. Its documented behaviour: {doc}",
    "I have to solve this in Python: {doc}\nShow me how with `{qual}`, and the edge cases to watch for.",
)
SKIP_MODULES = ("antigravity", "this", "idlelib", "tkinter", "turtle", "test", "lib2to3", "pydoc_data", "ensurepip",
                "venv", "msilib", "winreg", "winsound", "_")


def first_paragraph(doc: str) -> str:
    text = inspect.cleandoc(doc).split("\n\n")[0]
    return " ".join(text.split())


class _Elided:
    def __repr__(self) -> str:
        return "..."


def signature_text(fn) -> str:
    """The signature with only literal defaults spelled out; others become ``...``. A default's repr may hold
    this process's state (``cgi.test``'s is the whole ``os.environ``) or a memory address (``object()``
    sentinels), which would leak into the prompts and change from run to run."""
    sig = inspect.signature(fn)
    params = []
    for p in sig.parameters.values():
        d = p.default
        if d is not inspect.Parameter.empty and not (
                d is None or isinstance(d, bool | int | float) or (isinstance(d, str | bytes) and len(d) <= 40)):
            p = p.replace(default=_Elided())
        params.append(p)
    return str(sig.replace(parameters=params))


def functions() -> list[tuple[str, str, str, str]]:
    """(module, name, signature, doc paragraph) of public stdlib functions with a docstring, sorted."""
    out: dict[str, tuple[str, str, str, str]] = {}
    names = sorted(m for m in sys.stdlib_module_names if not m.startswith(SKIP_MODULES))
    for mod_name in names:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mod = importlib.import_module(mod_name)
        except Exception:  # platform modules (winreg, ...), missing optional libraries
            continue
        mods = [mod]
        if hasattr(mod, "__path__"):  # packages: their public submodules too (json.decoder, ...)
            for info in sorted(pkgutil.iter_modules(mod.__path__), key=lambda i: i.name):
                if info.name.startswith("_") or info.name in ("tests", "test"):
                    continue
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        mods.append(importlib.import_module(f"{mod_name}.{info.name}"))
                except Exception:
                    continue
        for m in mods:
            for name, obj in _routines(m):
                doc = first_paragraph(obj.__doc__ or "")
                if len(doc) < 40:
                    continue
                try:
                    sig = signature_text(obj)
                except (TypeError, ValueError):
                    continue
                out.setdefault(f"{m.__name__}.{name}", (m.__name__, name, sig, doc))
    return [out[k] for k in sorted(out)]


def _routines(m):
    """(dotted name in the module, routine) of the module's public functions (Python or C) and of the public
    methods of its public classes (class and static methods left out)."""
    for name, obj in sorted(vars(m).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != m.__name__:
            continue
        if inspect.isroutine(obj):
            yield name, obj
        elif inspect.isclass(obj):
            for meth, fn in sorted(vars(obj).items()):
                if meth.startswith("_") or isinstance(fn, classmethod | staticmethod):
                    continue
                if inspect.isroutine(fn):
                    yield f"{name}.{meth}", fn


def spread(lines: list[bytes], records: list[dict]) -> list[dict]:
    """The pack's JSON ``lines`` with ``records`` placed evenly among them: record j after line
    ``(j + 1) * len(lines) // (len(records) + 1)``, order kept on both sides."""
    out: list[dict] = []
    cuts = [(j + 1) * len(lines) // (len(records) + 1) for j in range(len(records))]
    j = 0
    for i, line in enumerate(lines):
        out.append(json.loads(line))
        while j < len(records) and cuts[j] == i + 1:
            out.append(records[j])
            j += 1
    return out + records[j:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--count", type=int, default=4000, help="most prompts (one per function)")
    ap.add_argument("--append-to", help="a JSONL(.xz) pack to write before these records")
    ap.add_argument("--spread", action="store_true", help="spread these records evenly through --append-to's")
    a = ap.parse_args()
    t0 = time.perf_counter()
    excluded_texts = user_texts(list(PROMPT_SETS))
    records, excluded, modules = [], 0, set()
    for module, name, sig, doc in functions():
        qual = f"{module}.{name}"
        pick = int.from_bytes(hashlib.sha256(qual.encode()).digest()[:4], "big") % len(TEMPLATES)
        text = TEMPLATES[pick].format(name=name, qual=qual, sig=sig, doc=doc, module=module)
        if text.strip() in excluded_texts:
            excluded += 1
            continue
        records.append({"id": f"pycode-{qual}", "messages": [{"role": "user", "content": text}]})
        modules.add(module)
        if len(records) == a.count:
            break
    head = b""
    if a.append_to:
        raw = Path(a.append_to).read_bytes()
        head = lzma.decompress(raw) if a.append_to.endswith(".xz") else raw
    elif a.spread:
        ap.error("--spread needs --append-to")
    other = head.splitlines()
    data = (write_jsonl(a.out, spread(other, records)) if a.spread else write_jsonl(a.out, records, after=head))
    print(json.dumps({"prompts": len(records), "modules": len(modules),
                      "excluded_eval_prompts": excluded, "records_before": len(other), "spread": a.spread,
                      "python": sys.version.split()[0], "bytes": len(data),
                      "seconds": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
