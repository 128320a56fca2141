"""The sglang compatibility check: on a synthesized source tree (CPU) and on the installed sglang."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from eaglenest.engines import sglang_compat as compat


def _split_target(target: str) -> tuple[list[str], list[str]]:
    """(module parts, names inside): names start at the first capitalized part, or are the last part."""
    parts = target.split(".")[1:]
    cut = next((i for i, p in enumerate(parts) if p[:1].isupper()), len(parts) - 1)
    return parts[:cut], parts[cut:]


def _function(fact: compat.SourceFact, name: str, indent: str) -> list[str]:
    kw = "async def" if fact.is_async else "def"
    body = [f"{indent}    x = {s!r}" for s in fact.contains] or [f"{indent}    pass"]
    return [f"{indent}{kw} {name}({', '.join(fact.params)}):", *body]


def synthesize(root: Path, version: str = "0.5.17") -> Path:
    """A minimal sglang source tree satisfying every fact the plugin relies on."""
    pkg = root / "sglang"
    modules: dict[tuple[str, ...], dict[str, list[str]]] = {}
    for fact in compat.HOOKED + compat.RELIED_ON + (compat.PROBE_TARGET,):
        module, names = _split_target(fact.target)
        defs = modules.setdefault(tuple(module), {})
        if len(names) == 1 and fact.attributes:
            defs.setdefault(names[0], []).extend(f"    {a}: int = 0" for a in fact.attributes)
        elif len(names) == 1:
            defs[names[0]] = _function(fact, names[0], "")
        else:
            defs.setdefault(names[0], []).extend(_function(fact, names[1], "    "))
    for module, defs in modules.items():
        path = pkg.joinpath(*module).with_suffix(".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        chunks = [("\n".join(lines) if lines[0].lstrip().startswith(("def", "async")) and not lines[0].startswith(" ")
                   else f"class {name}:\n" + "\n".join(lines)) for name, lines in defs.items()]
        path.write_text("\n\n".join(chunks) + "\n")
    (pkg / "_version.py").write_text(f"__version__ = version = '{version}'\n")
    return pkg


def test_synthesized_supported_tree_passes(tmp_path):
    assert compat.check_compat(synthesize(tmp_path), probe=True) == "0.5.17"


def test_unknown_version_is_refused_clearly(tmp_path):
    with pytest.raises(compat.SGLangCompatError, match=r"sglang 0\.6\.0 .* not supported .*0\.5\.17"):
        compat.check_compat(synthesize(tmp_path, "0.6.0"))


def test_changed_signature_and_missing_code_are_named(tmp_path):
    pkg = synthesize(tmp_path)
    lp = pkg / "srt" / "layers" / "logits_processor.py"
    lp.write_text(lp.read_text().replace("logits_metadata", "metadata"))
    (pkg / "srt" / "managers" / "tokenizer_manager.py").unlink()
    with pytest.raises(compat.SGLangCompatError) as e:
        compat.check_compat(pkg)
    text = str(e.value)
    assert "LogitsProcessor.forward: parameters are now" in text
    assert "TokenizerManager._wait_one_response: module not found" in text


@pytest.mark.sglang
def test_installed_sglang_matches_the_hooks():
    root = os.environ.get("EAGLENEST_SGLANG_SOURCE")  # e.g. an unpacked sglang folder, for CPU machines
    if root is None and importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed")
    version = compat.check_compat(root, probe=True)
    assert version in compat.SUPPORTED_SGLANG_VERSIONS
