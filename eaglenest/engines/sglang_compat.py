"""Which sglang versions the capture plugin supports, and a source-level check that they still fit.

Owns the list of sglang functions the plugin hooks or relies on (:data:`HOOKED`, :data:`RELIED_ON`)
and :func:`check_compat`, which reads the INSTALLED sglang's source with ``ast`` (never importing it:
no GPU needed) and fails with every mismatch named when a version is unknown or a hooked function
moved or changed its parameters. Run it before spending a GPU: the launcher does, and so does the
``sglang``-marked test.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_SGLANG_VERSIONS: tuple[str, ...] = ("0.5.17",)


class SGLangCompatError(RuntimeError):
    """The installed sglang is missing, of an unsupported version, or its hooked code changed. Terminal."""


@dataclass(frozen=True, slots=True)
class SourceFact:
    """A function (or class attribute) in sglang's source that the plugin depends on."""

    target: str
    """Dotted path: module, then class / function names."""
    params: tuple[str, ...] = ()
    """Leading parameter names, in order (checked as a prefix of the signature)."""
    is_async: bool | None = None
    contains: tuple[str, ...] = ()
    """Source snippets that must appear in the function body."""
    attributes: tuple[str, ...] = ()
    """For a class target: names assigned or annotated in its body or ``__init__``."""


HOOKED: tuple[SourceFact, ...] = (
    SourceFact("sglang.srt.model_executor.model_runner.ModelRunner.init_attention_backends", ("self",),
               contains=("configure_aux_hidden_state_capture",)),
    SourceFact("sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new", ("cls", "batch", "model_runner"),
               contains=("rids=",)),
    SourceFact("sglang.srt.managers.tokenizer_manager.TokenizerManager._init_req_state", ("self", "obj", "request")),
    SourceFact("sglang.srt.managers.tokenizer_manager.TokenizerManager._wait_one_response", ("self", "obj", "request"),
               is_async=True, contains=("finish_reason",)),
    SourceFact("sglang.srt.entrypoints.http_server.model_info", (), is_async=True),
)
"""Targets registered with sglang's HookRegistry (plus the draft probe, checked separately)."""

PROBE_TARGET = SourceFact("sglang.srt.models.llama_eagle3.LlamaModel.forward",
                          ("self", "input_ids", "positions", "forward_batch"), contains=("spec_info.hidden_states",))

RELIED_ON: tuple[SourceFact, ...] = (
    SourceFact("sglang.srt.plugins.load_plugins", (), contains=("GENERAL_PLUGINS_GROUP", "apply_hooks")),
    SourceFact("sglang.srt.plugins.hook_registry.HookRegistry.register", ("cls", "target", "hook", "hook_type")),
    SourceFact("sglang.srt.managers.scheduler.run_scheduler_process", contains=("load_plugins()",)),
    SourceFact("sglang.srt.entrypoints.http_server.get_model_info", is_async=True, contains=("await model_info()",)),
    SourceFact("sglang.srt.layers.logits_processor.LogitsProcessor.forward",
               ("self", "input_ids", "hidden_states", "lm_head", "logits_metadata", "aux_hidden_states")),
    SourceFact("sglang.srt.models.llama.LlamaForCausalLM.set_eagle3_layers_to_capture", ("self", "layer_ids"),
               contains=("val + 1",)),
    SourceFact("sglang.srt.models.llama.LlamaForCausalLM.forward", contains=("self.logits_processor(",)),
    SourceFact("sglang.srt.models.llama.LlamaModel.forward",
               contains=("layers_to_capture", "hidden_states + residual")),
    SourceFact("sglang.srt.model_executor.forward_batch_info.ForwardBatch",
               attributes=("rids", "forward_mode", "extend_seq_lens_cpu", "extend_prefix_lens_cpu")),
    SourceFact("sglang.srt.model_executor.forward_batch_info.ForwardMode", attributes=("EXTEND",)),
    SourceFact("sglang.srt.managers.schedule_batch.ScheduleBatch", attributes=("reqs", "prefix_lens", "extend_lens")),
    SourceFact("sglang.srt.managers.schedule_batch.Req", attributes=("rid", "origin_input_ids", "output_ids")),
    SourceFact("sglang.srt.server_args.ServerArgs",
               attributes=("disable_radix_cache", "cuda_graph_config", "enable_mixed_chunk", "skip_server_warmup",
                           "cuda_graph_backend_prefill")),
)


def locate_sglang() -> Path:
    """The installed sglang package folder (found without importing it)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise SGLangCompatError(
            "sglang is not installed in this environment; install a supported version "
            f"({', '.join(SUPPORTED_SGLANG_VERSIONS)}), e.g. `pip install 'eaglenest[sglang]'`"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def installed_version(root: Path) -> str:
    """sglang's version from its source (``_version.py``), else from its distribution metadata."""
    for name in ("_version.py", "version.py"):
        path = root / name
        if path.is_file():
            m = re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]", path.read_text())
            if m:
                return m.group(1)
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        raise SGLangCompatError(f"cannot tell the version of the sglang at {root}") from None


def _module_file(root: Path, parts: list[str]) -> tuple[Path, list[str]] | None:
    """Longest module prefix of ``parts`` (after 'sglang') that exists as a file; rest = names inside."""
    for cut in range(len(parts), 0, -1):
        base = root.joinpath(*parts[:cut])
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate, parts[cut:]
    return None


def _find(body: list[ast.stmt], names: list[str]) -> ast.AST | None:
    node: ast.AST | None = None
    for name in names:
        found = None
        for stmt in body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and stmt.name == name:
                found = stmt  # the last definition wins, as at runtime
        if found is None:
            return None
        node = found
        body = getattr(found, "body", [])
    return node


def _class_attributes(node: ast.ClassDef) -> set[str]:
    names: set[str] = set()
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            names.add(stmt.target.id)
        elif isinstance(stmt, ast.Assign):
            names.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == "__init__":
            for sub in ast.walk(stmt):
                if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) and \
                        isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    names.add(sub.attr)
    return names


def check_fact(root: Path, fact: SourceFact) -> list[str]:
    """Problems with one fact in the sglang source at ``root`` (the package folder)."""
    parts = fact.target.split(".")
    if parts[0] != "sglang":
        return [f"{fact.target}: not an sglang path"]
    located = _module_file(root, parts[1:])
    if located is None:
        return [f"{fact.target}: module not found under {root}"]
    path, names = located
    source = path.read_text()
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        return [f"{fact.target}: cannot parse {path}: {e}"]
    node = _find(tree.body, names)
    if node is None:
        return [f"{fact.target}: not defined in {path.relative_to(root.parent)}"]
    problems: list[str] = []
    if isinstance(node, ast.ClassDef):
        missing = [a for a in fact.attributes if a not in _class_attributes(node)]
        if missing:
            problems.append(f"{fact.target}: attributes {missing} no longer defined")
        return problems
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    params = [a.arg for a in node.args.posonlyargs + node.args.args]
    if tuple(params[: len(fact.params)]) != fact.params:
        problems.append(f"{fact.target}: parameters are now {params}, the plugin expects {list(fact.params)} first")
    if fact.is_async is not None and isinstance(node, ast.AsyncFunctionDef) != fact.is_async:
        problems.append(f"{fact.target}: expected {'an async' if fact.is_async else 'a plain'} function")
    body = ast.get_source_segment(source, node) or ""
    for snippet in fact.contains:
        if snippet not in body:
            problems.append(f"{fact.target}: its body no longer contains {snippet!r}")
    return problems


def check_compat(root: str | Path | None = None, *, probe: bool = False) -> str:
    """Check the installed (or given) sglang; returns its version or raises SGLangCompatError."""
    pkg = Path(root) if root is not None else locate_sglang()
    version = installed_version(pkg)
    if version not in SUPPORTED_SGLANG_VERSIONS:
        raise SGLangCompatError(
            f"sglang {version} at {pkg} is not supported by the eaglenest capture plugin "
            f"(supported: {', '.join(SUPPORTED_SGLANG_VERSIONS)}); install one of those, or check the hooks in "
            "eaglenest/engines/sglang_compat.py against the new source and add the version"
        )
    facts = HOOKED + RELIED_ON + ((PROBE_TARGET,) if probe else ())
    problems = [p for fact in facts for p in check_fact(pkg, fact)]
    if problems:
        raise SGLangCompatError(f"sglang {version} at {pkg} does not match what the capture plugin hooks:\n  - "
                                + "\n  - ".join(problems))
    return version
