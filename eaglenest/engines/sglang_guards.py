"""Correctness guards for capture inside SGLang: on the command line (launcher) and on the parsed
server arguments (plugin, in every scheduler process).

Capture is correct only when every prompt row is computed in its request's own prefill, by Python
code that runs at every forward:

- prefix reuse off (``--disable-radix-cache``; no hierarchical cache): reused rows are never computed;
- prefill CUDA graphs off (``--cuda-graph-backend-prefill disabled``): replayed graphs skip the
  plugin's Python code; decode graphs are fine (decode is never captured);
- chunked prefill is allowed: chunks are coalesced per request; mixed chunks (decode rows in a
  prefill batch) are refused;
- layouts the plugin does not split (pipeline parallel, DP attention, attention context
  parallel, PD disaggregation or multiplexing) and speculative algorithms other than EAGLE3 are refused.

Both functions return every problem at once, each naming the flag and the fix.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

REQUIRED_FLAGS: tuple[str, ...] = (
    "--disable-radix-cache",
    "--cuda-graph-backend-prefill", "disabled",
    "--skip-server-warmup",  # the warmup request has no rid of ours: it would be captured
)
RESERVED = {"--model-path": "--model", "--model": "--model", "--host": "--host", "--port": "--port"}
ALLOWED_SPECULATIVE = {"EAGLE3"}


class SGLangArgsError(ValueError):
    """User sglang arguments contradict the capture guards. Terminal: fix the command line."""


def split_flags(args: Sequence[str]) -> list[tuple[str, str | None]]:
    """(flag, value) pairs; value is the next token unless it is a flag, or the part after '='."""
    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(args):
        tok = str(args[i])
        if tok.startswith("--"):
            if "=" in tok:
                flag, value = tok.split("=", 1)
                out.append((flag, value))
            else:
                nxt = args[i + 1] if i + 1 < len(args) else None
                value = None if nxt is None or str(nxt).startswith("--") else str(nxt)
                out.append((tok, value))
                i += value is not None
        i += 1
    return out


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value ``flag`` is given on a command line (the last one, as argparse takes it), or None."""
    values = [v for f, v in split_flags(args) if f == flag]
    return values[-1] if values else None


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def check_user_args(args: Sequence[str]) -> list[str]:
    """Problems with user-supplied sglang arguments (empty when they are compatible with capture)."""
    problems: list[str] = []
    for flag, value in split_flags(args):
        if flag in RESERVED:
            problems.append(f"{flag} is set by eaglenest; use `eaglenest serve {RESERVED[flag]} ...` instead")
        elif flag == "--cuda-graph-backend-prefill" and value != "disabled":
            problems.append(f"--cuda-graph-backend-prefill {value}: prefill must run without CUDA graphs for "
                            "capture (replayed graphs skip the capture code); drop it (decode graphs stay on)")
        elif flag in ("--enable-breakable-cuda-graph", "--enforce-piecewise-cuda-graph"):
            problems.append(f"{flag} turns on prefill CUDA graphs, which skip the capture code; drop it")
        elif flag == "--cuda-graph-config":
            try:
                backend = ((json.loads(value or "{}") or {}).get("prefill") or {}).get("backend")
            except (json.JSONDecodeError, AttributeError):
                backend = None
            if backend not in (None, "disabled"):
                problems.append(f"--cuda-graph-config sets prefill backend {backend!r}; capture needs it 'disabled'")
        elif flag == "--enable-mixed-chunk":
            problems.append("--enable-mixed-chunk mixes decode rows into chunked prefill batches; drop it")
        elif flag == "--enable-hierarchical-cache":
            problems.append("--enable-hierarchical-cache reuses prefixes (rows never computed); drop it")
        elif flag in ("--pp-size", "--pipeline-parallel-size") and (_int(value) or 1) > 1:
            problems.append(f"{flag} {value}: pipeline parallel capture is not supported; use --tp-size")
        elif flag in ("--attn-cp-size", "--attention-context-parallel-size") and (_int(value) or 1) > 1:
            problems.append(f"{flag} {value}: attention context parallel splits prompt rows; not supported")
        elif flag == "--enable-dp-attention":
            problems.append("--enable-dp-attention is not supported by the capture plugin; use --tp-size/--dp-size")
        elif flag == "--disaggregation-mode" and value not in (None, "null"):
            problems.append(f"--disaggregation-mode {value} is not supported for capture; serve prefill and decode "
                            "in one server")
        elif flag == "--enable-pdmux":
            problems.append("--enable-pdmux splits prefill across forwards; not supported for capture")
        elif flag == "--tokenizer-worker-num" and (_int(value) or 1) > 1:
            problems.append(f"{flag} {value}: capture needs the tokenizer manager in the HTTP process; drop it")
        elif flag == "--speculative-algorithm" and (value or "").upper() not in ALLOWED_SPECULATIVE:
            problems.append(f"--speculative-algorithm {value}: capture supports plain serving or EAGLE3 only")
    return problems


def _get(obj: Any, *path: str) -> Any:
    for name in path:
        if obj is None:
            return None
        obj = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
    return obj


def check_server_args(args: Any) -> list[str]:
    """Problems with sglang's parsed ServerArgs (works on any object with those attributes)."""
    problems: list[str] = []
    if not _get(args, "disable_radix_cache"):
        problems.append("prefix reuse is on (radix cache): reused prompt rows are never computed in the request's "
                        "prefill; launch with --disable-radix-cache")
    if _get(args, "enable_hierarchical_cache"):
        problems.append("the hierarchical cache reuses prefixes; launch without --enable-hierarchical-cache")
    backend = _get(args, "cuda_graph_config", "prefill", "backend")
    if backend is None:
        if not (_get(args, "disable_cuda_graph") or _get(args, "disable_prefill_cuda_graph")):
            problems.append("cannot tell whether prefill runs under CUDA graphs; launch with "
                            "--cuda-graph-backend-prefill disabled")
    elif str(backend) != "disabled":
        problems.append(f"prefill runs under CUDA graphs (backend {backend!r}), which skip the capture code; "
                        "launch with --cuda-graph-backend-prefill disabled")
    if _get(args, "enable_mixed_chunk"):
        problems.append("mixed chunked prefill is on; launch without --enable-mixed-chunk")
    for name, what in (("pp_size", "pipeline parallel"), ("attn_cp_size", "attention context parallel")):
        if (_get(args, name) or 1) > 1:
            problems.append(f"{what} ({name}={_get(args, name)}) is not supported by the capture plugin")
    if _get(args, "enable_dp_attention"):
        problems.append("DP attention is not supported by the capture plugin")
    if _get(args, "enable_pdmux"):
        problems.append("PD multiplexing is not supported by the capture plugin")
    if str(_get(args, "disaggregation_mode") or "null") != "null":
        problems.append(f"PD disaggregation ({_get(args, 'disaggregation_mode')}) is not supported for capture")
    spec = _get(args, "speculative_algorithm")
    if spec is not None and str(spec).upper() not in ALLOWED_SPECULATIVE:
        problems.append(f"speculative algorithm {spec} is not supported for capture (plain or EAGLE3 only)")
    return problems
