"""Footprint planner: how much disk a store of a target's hidden states takes, before anything is captured.

Owns the arithmetic of ``eaglenest store plan``: bytes per token per encoding
(:func:`eaglenest.store.encoding.bytes_per_token`: token id, loss mask, k aux layers + the final state,
and fp8's scales) times tokens, plus about 1 KiB per sample (Arrow message header, alignment, index row;
measured 0.8-1.0 KiB). The target's shape comes from its config.json (a local Hugging Face folder, the
file itself, or ``default``), from a few well-known big targets listed here, or from explicit overrides.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from eaglenest.contract import check_aux_layer_ids, default_aux_layer_ids
from eaglenest.store.encoding import ENCODINGS, bytes_per_token

SAMPLE_OVERHEAD_BYTES = 1024
KNOWN_TARGETS: dict[str, tuple[int, int]] = {
    "kimi-k2": (7168, 61),
    "deepseek-v3": (7168, 61),
    "llama-3.1-70b": (8192, 80),
    "llama-3.1-8b": (4096, 32),
    "qwen2.5-7b": (3584, 28),
}
"""(hidden_size, num_hidden_layers) of public configs, for planning without the model at hand."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TargetShape:
    name: str
    hidden_size: int
    num_layers: int
    aux_layer_ids: tuple[int, ...]


def target_shape(model: str | None, *, hidden_size: int | None = None, num_layers: int | None = None,
                 aux_layer_ids: tuple[int, ...] | None = None) -> TargetShape:
    """The shape that decides a store's size. ``model``: 'default', a local HF folder, a config.json path, a
    name in :data:`KNOWN_TARGETS`, or None when ``hidden_size`` and ``num_layers`` are both given."""
    name, cfg = "custom", {}
    if model is not None:
        key = str(model).lower()
        path = Path(model).expanduser()
        if key in KNOWN_TARGETS:
            name, (h, n) = key, KNOWN_TARGETS[key]
            cfg = {"hidden_size": h, "num_hidden_layers": n}
        elif path.is_file():
            name, cfg = str(path), json.loads(path.read_text())
        else:
            from eaglenest.models import ModelError, load_config, resolve_model

            try:
                folder = resolve_model(model)
            except ModelError as e:
                raise ValueError(f"{e}; or name a known target ({', '.join(KNOWN_TARGETS)}), or give "
                                 "--hidden-size and --num-layers") from None
            name, cfg = str(folder), load_config(folder)
        cfg = cfg.get("text_config", cfg)  # multimodal configs nest the language model's
    h = hidden_size or cfg.get("hidden_size")
    n = num_layers or cfg.get("num_hidden_layers")
    if not h or not n:
        raise ValueError(f"{name}: no hidden_size / num_hidden_layers; give --hidden-size and --num-layers")
    ids = check_aux_layer_ids(aux_layer_ids, int(n)) if aux_layer_ids else default_aux_layer_ids(int(n))
    return TargetShape(name=name, hidden_size=int(h), num_layers=int(n), aux_layer_ids=ids)


def footprint(shape: TargetShape, *, samples: int, mean_tokens: float) -> dict:
    """Bytes per token and total store bytes, per encoding (and fp8's share of bf16)."""
    if samples < 1 or mean_tokens <= 0:
        raise ValueError(f"need samples >= 1 and mean_tokens > 0, got {samples} and {mean_tokens}")
    tokens = samples * mean_tokens
    out = {"target": shape.name, "hidden_size": shape.hidden_size, "num_layers": shape.num_layers,
           "aux_layer_ids": list(shape.aux_layer_ids), "samples": samples, "mean_tokens": mean_tokens,
           "tokens": int(tokens)}
    for enc in ENCODINGS:
        bpt = bytes_per_token(enc, shape.hidden_size, len(shape.aux_layer_ids))
        out[enc] = {"bytes_per_token": bpt, "bytes": int(tokens * bpt + samples * SAMPLE_OVERHEAD_BYTES)}
    out["fp8_vs_bf16"] = round(out["fp8"]["bytes"] / out["bf16"]["bytes"], 3)
    return out
