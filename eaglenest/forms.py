"""How eaglenest's pydantic parameter models read as forms (the Prefect UI renders their JSON schema).

Owns one schema hook, :func:`show_bounds`, that every parameter model sets as its
``json_schema_extra``: it appends each field's bounds to its description ("Range: 1 to 64."), because the
UI shows descriptions but never a field's minimum or maximum (a violated bound only surfaces as a toast
after Submit). Descriptions themselves must render as written: the UI drops anything that looks like an
HTML tag, so they never contain ``<name>`` placeholders (a test checks every model's schema).

Invariant: only descriptions change; types, defaults, required fields and validation stay pydantic's.
"""

from __future__ import annotations

from typing import Any

_NUMERIC = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")


def _fmt(x: Any) -> str:
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    if isinstance(x, int) and x >= 1 << 16 and (x & (x - 1)) == 0:
        return f"2^{x.bit_length() - 1}"
    return str(x)


def bounds_text(prop: dict) -> str:
    """'Range: 1 to 64.', 'At least 1.', 'Above 0.', '1 to 8 items.' for one schema property ('' if unbounded)."""
    branches = [prop, *prop.get("anyOf", [])]
    found: dict[str, Any] = {}
    for b in branches:
        for k in (*_NUMERIC, "minItems", "maxItems", "minLength", "maxLength"):
            if k in b:
                found.setdefault(k, b[k])
    lo = ("at least", found["minimum"]) if "minimum" in found else (
        ("above", found["exclusiveMinimum"]) if "exclusiveMinimum" in found else None)
    hi = ("at most", found["maximum"]) if "maximum" in found else (
        ("below", found["exclusiveMaximum"]) if "exclusiveMaximum" in found else None)
    parts = []
    if lo and hi and lo[0] == "at least" and hi[0] == "at most":
        parts.append(f"Range: {_fmt(lo[1])} to {_fmt(hi[1])}.")
    elif lo or hi:
        words = [f"{b[0]} {_fmt(b[1])}" for b in (lo, hi) if b]
        text = " and ".join(words)
        parts.append(f"{text[0].upper()}{text[1:]}.")
    for kind, lo_k, hi_k in (("items", "minItems", "maxItems"), ("characters", "minLength", "maxLength")):
        if lo_k in found and hi_k in found:
            parts.append(f"{found[lo_k]} to {found[hi_k]} {kind}.")
        elif lo_k in found and found[lo_k] > 0:
            parts.append(f"At least {found[lo_k]} {kind[:-1] if found[lo_k] == 1 else kind}.")
        elif hi_k in found:
            parts.append(f"At most {found[hi_k]} {kind}.")
    return " ".join(parts)


def show_bounds(schema: dict[str, Any], cls: type | None = None) -> None:
    """pydantic ``json_schema_extra`` hook: append every property's bounds to its description."""
    for prop in schema.get("properties", {}).values():
        text = bounds_text(prop)
        if text and text not in prop.get("description", ""):
            desc = prop.get("description", "").rstrip()
            prop["description"] = f"{desc} {text}".strip() if desc else text
