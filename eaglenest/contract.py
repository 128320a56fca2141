"""The capture contract: conventions, provenance and shard format v1.

Owns what every stage agrees on and nothing else (no torch model code, no HTTP):

- Conventions. ``aux_layer_ids`` name decoder layers whose OUTPUT (the residual stream after the
  layer) is captured: HF ``output_hidden_states[id + 1]``, SGLang's llama capture at ``id + 1``.
  ``final_hidden`` is the final-norm output (what the LM head reads). Capture happens in prefill,
  every token of the request computed in that prefill (no prefix reuse, no split prefill).
- Provenance: who computed the states (engine, model, tokenizer, numerics). Written into every shard
  and store; two artifacts mix only when their provenance matches.
- Shard v1: one safetensors file per request id with ``input_ids`` int32 [T], ``aux_hidden`` bf16
  [T, k*H], ``final_hidden`` bf16 [T, H] and string metadata (schema version, sample id, provenance).

Invariants: a shard exists under its final name only if it was completely written (written and published
through :mod:`eaglenest.atomic`: tmp + fsync + rename + directory fsync); readers ignore ``*.tmp``; shards are
write-once (:func:`publish_shard`); readers refuse schema versions they do not know; a sample id becomes a file
name only through :func:`shard_filename` (never escapes its folder).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from eaglenest.atomic import atomic_write_bytes, publish_once

SCHEMA_VERSION = 1
CONVENTION = (
    "eaglenest-capture/v1: aux=output of decoder layer id (hf hidden_states[id+1]); "
    "final=final-norm output; prefill only; every prompt token computed in one request prefill"
)
SHARD_SUFFIX = ".safetensors"
NO_CAPTURE_RID_PREFIX = "nocapture:"
"""Requests whose rid starts with this prefix are served without capture (regeneration, benchmarks)."""

_SAFE_CHARS = re.compile(r"[^A-Za-z0-9._-]")
_MAX_NAME = 120


class ContractError(ValueError):
    """An artifact breaks the capture contract. Terminal: retrying cannot fix it."""


class UnknownSchemaVersion(ContractError):
    """An artifact was written under a schema version this code does not know."""


class ShardConflict(ContractError):
    """A request id already has a shard holding other token ids (or other provenance). Servers answer 409:
    resending cannot change the stored file, and replacing it could swap data already validated."""


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default aux layers for an L-layer target: outputs of layers 1, L//2 - 1 and L - 4."""
    if num_layers < 8:
        raise ContractError(
            f"default aux layers need a target with at least 8 decoder layers, got {num_layers}; "
            "pass aux_layer_ids explicitly"
        )
    return (1, num_layers // 2 - 1, num_layers - 4)


def check_aux_layer_ids(aux_layer_ids: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """Validate aux ids against the target depth: distinct, increasing, each in [0, L-2].

    The last layer (L-1) is excluded because engines only expose its output after the final norm.
    """
    ids = tuple(int(i) for i in aux_layer_ids)
    if not ids:
        raise ContractError("aux_layer_ids is empty; give at least one decoder layer id")
    if list(ids) != sorted(set(ids)):
        raise ContractError(f"aux_layer_ids must be distinct and increasing, got {list(ids)}")
    if ids[0] < 0 or ids[-1] > num_layers - 2:
        raise ContractError(
            f"aux_layer_ids {list(ids)} out of range for a {num_layers}-layer target (allowed 0..{num_layers - 2})"
        )
    return ids


@dataclass(frozen=True, kw_only=True, slots=True)
class Provenance:
    """Who computed the hidden states. Equal provenance is what lets shards share a store."""

    engine: str
    """Engine name: ``embedded`` or ``sglang``."""
    engine_version: str
    model_path: str
    """Where the model was loaded from (informational: machines differ; compare ``model_hash``)."""
    model_hash: str
    """sha256 over the model's config.json and its weights index (tensor names, dtypes, shapes)."""
    tokenizer_hash: str
    chat_template_hash: str
    dtype: str
    """Numerics of the forward pass, e.g. ``bfloat16``."""
    tp_size: int = 1
    attention_backend: str = "sdpa"
    aux_layer_ids: tuple[int, ...]
    hidden_size: int
    num_layers: int
    convention: str = CONVENTION
    schema_version: int = SCHEMA_VERSION
    store_encoding: str = "bf16"
    """How a store holds the states: ``bf16`` (bit exact, as captured; shards are always bf16) or ``fp8``
    (e4m3 with per-token block scales, see :mod:`eaglenest.store.encoding`). Left out of the JSON when bf16,
    so provenance written before stores had encodings reads and hashes as it did."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        if data["store_encoding"] == "bf16":
            del data["store_encoding"]
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | dict) -> Provenance:
        data = json.loads(text) if isinstance(text, str) else dict(text)
        version = int(data.get("schema_version", -1))
        if version != SCHEMA_VERSION:
            raise UnknownSchemaVersion(
                f"provenance schema_version {version} is not supported (this eaglenest reads {SCHEMA_VERSION})"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ContractError(f"provenance has unknown fields {unknown}")
        return cls(**data)

    def mismatches(self, other: Provenance, *, ignore: Sequence[str] = ("model_path",)) -> list[str]:
        """Names of fields that differ (``model_path`` ignored by default: it is machine-local)."""
        return [
            f.name
            for f in dataclasses.fields(self)
            if f.name not in ignore and getattr(self, f.name) != getattr(other, f.name)
        ]

    def require_match(self, other: Provenance, *, what: str = "artifact") -> None:
        diff = self.mismatches(other)
        if diff:
            detail = ", ".join(f"{n}: {getattr(self, n)!r} != {getattr(other, n)!r}" for n in diff)
            raise ContractError(f"{what} provenance differs in {detail}")


@dataclass(frozen=True, slots=True)
class Shard:
    """One captured request: token ids and the hidden states of every prompt token."""

    sample_id: str
    input_ids: torch.Tensor  # [T] int32
    aux_hidden: torch.Tensor  # [T, k*H] bf16
    final_hidden: torch.Tensor  # [T, H] bf16
    provenance: Provenance
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def check(self) -> None:
        """Shapes and dtypes per the contract; raises ContractError naming the tensor."""
        p = self.provenance
        t = self.num_tokens
        k, h = len(p.aux_layer_ids), p.hidden_size
        expect = {
            "input_ids": ((t,), torch.int32, self.input_ids),
            "aux_hidden": ((t, k * h), torch.bfloat16, self.aux_hidden),
            "final_hidden": ((t, h), torch.bfloat16, self.final_hidden),
        }
        if self.input_ids.dim() != 1 or t == 0:
            raise ContractError(f"shard {self.sample_id!r}: input_ids must be a non-empty 1-D tensor")
        if p.store_encoding != "bf16":
            raise ContractError(f"shard {self.sample_id!r}: provenance says store_encoding {p.store_encoding!r}; "
                                "shards hold the captured bf16 states (an encoding is chosen at conversion)")
        for name, (shape, dtype, tensor) in expect.items():
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise ContractError(
                    f"shard {self.sample_id!r}: {name} is {tensor.dtype}{list(tensor.shape)}, "
                    f"expected {dtype}{list(shape)} (T={t}, {k} aux layers, H={h})"
                )


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def shard_filename(sample_id: str) -> str:
    """File name for a sample id: safe characters only, never a path, unique per id.

    Ids made only of ``[A-Za-z0-9._-]`` (not starting with a dot, at most 120 chars) keep their
    name; any other id is cleaned, cut, and suffixed with ``~`` + a hash of the raw id (``~`` never
    appears in a clean name, so two ids cannot map to one file).
    """
    if not isinstance(sample_id, str) or not sample_id:
        raise ContractError("sample id must be a non-empty string")
    clean = _SAFE_CHARS.sub("_", sample_id)
    if clean == sample_id and len(clean) <= _MAX_NAME and not clean.startswith("."):
        return clean + SHARD_SUFFIX
    digest = hashlib.sha256(sample_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{clean.lstrip('.')[:80]}~{digest}{SHARD_SUFFIX}"


def publish_shard(path: str | Path, data: bytes) -> dict[str, Any]:
    """Publish an encoded shard once and return the receipt of the file now under ``path``.

    The receipt (shard name, token count, tensor shapes, bytes, sha256) is read from the stored file's
    own bytes, so it never describes a capture that was not kept. When the id already has a shard (a
    client's retry after a timeout, a re-sent request), the answer is idempotent only if that file holds
    the same input_ids and provenance (``existing`` is then true); otherwise :class:`ShardConflict` names
    the id and nothing is written.
    """
    path, kept = publish_once(path, data)
    existing = kept is not data
    if existing:
        _require_same_request(path, kept, data)
    header = _read_header(kept, str(path))
    return {"shard": path.name, "num_tokens": header["input_ids"]["shape"][0],
            "aux_hidden": header["aux_hidden"]["shape"], "final_hidden": header["final_hidden"]["shape"],
            "bytes": len(kept), "sha256": sha256_bytes(kept), "existing": existing}


def _require_same_request(path: Path, stored: bytes, new: bytes) -> None:
    sent = decode_shard(new, where=f"new capture for {path.name}")
    rid = sent.sample_id
    try:
        have = decode_shard(stored, where=str(path))
    except ContractError as e:
        raise ShardConflict(f"rid {rid!r} already has a shard {path.name} that cannot be read ({e}); the new "
                            "capture was not stored: move the old shard away, then resend") from None
    diff = have.provenance.mismatches(sent.provenance)
    if not torch.equal(have.input_ids, sent.input_ids) or diff:
        what = (f"other input_ids ({have.num_tokens} tokens stored, {sent.num_tokens} sent)" if not diff
                else f"other provenance ({', '.join(diff)})")
        raise ShardConflict(f"rid {rid!r} already has a shard {path.name} with {what}; the new capture was not "
                            "stored: send it under a new rid, or move the old shard away first")


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or +-inf in ``t``. min/max propagate NaN, so two reductions decide it: ~10x faster than
    ``isfinite(t).all()`` for bf16 on the CPU (where the capture writer checks every shard)."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def encode_shard(shard: Shard) -> bytes:
    shard.check()
    bad = [n for n, t in (("aux_hidden", shard.aux_hidden), ("final_hidden", shard.final_hidden))
           if not all_finite(t)]
    if bad:
        raise ContractError(f"shard {shard.sample_id!r}: non-finite values in {', '.join(bad)}; not written")
    meta = dict(shard.extra)
    meta.update(
        schema_version=str(SCHEMA_VERSION),
        sample_id=shard.sample_id,
        provenance=shard.provenance.to_json(),
    )
    tensors = {
        "input_ids": shard.input_ids.contiguous(),
        "aux_hidden": shard.aux_hidden.contiguous(),
        "final_hidden": shard.final_hidden.contiguous(),
    }
    return st_save(tensors, metadata=meta)


def write_shard(directory: str | Path, shard: Shard) -> Path:
    """Atomically write one shard into ``directory``; returns its final path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return atomic_write_bytes(directory / shard_filename(shard.sample_id), encode_shard(shard))


def _read_header(data: bytes, where: str) -> dict[str, Any]:
    if len(data) < 8:
        raise ContractError(f"{where}: truncated (size {len(data)} bytes)")
    header_len = int.from_bytes(data[:8], "little")
    if header_len <= 0 or 8 + header_len > len(data):
        raise ContractError(f"{where}: truncated or garbage header (header length {header_len})")
    try:
        header = json.loads(data[8 : 8 + header_len])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ContractError(f"{where}: garbage header ({e})") from None
    if not isinstance(header, dict):
        raise ContractError(f"{where}: garbage header (not a JSON object)")
    return header


def _read_metadata(data: bytes, where: str) -> dict[str, str]:
    return _read_header(data, where).get("__metadata__") or {}


def decode_shard(data: bytes, *, where: str = "shard") -> Shard:
    """Parse shard bytes; refuses unknown schema versions and contract violations."""
    meta = _read_metadata(data, where)
    version = meta.get("schema_version")
    if version != str(SCHEMA_VERSION):
        raise UnknownSchemaVersion(
            f"{where}: schema_version {version!r} is not supported (this eaglenest reads {SCHEMA_VERSION})"
        )
    try:
        tensors = st_load(data)
    except (SafetensorError, ValueError) as e:
        raise ContractError(f"{where}: unreadable tensors ({e})") from None
    missing = {"input_ids", "aux_hidden", "final_hidden"} - set(tensors)
    if missing:
        raise ContractError(f"{where}: missing tensors {sorted(missing)}")
    extra = {k: v for k, v in meta.items() if k not in ("schema_version", "sample_id", "provenance")}
    shard = Shard(
        sample_id=meta.get("sample_id", ""),
        input_ids=tensors["input_ids"],
        aux_hidden=tensors["aux_hidden"],
        final_hidden=tensors["final_hidden"],
        provenance=Provenance.from_json(meta.get("provenance", "{}")),
        extra=extra,
    )
    shard.check()
    return shard


def read_shard(path: str | Path) -> Shard:
    path = Path(path)
    return decode_shard(path.read_bytes(), where=str(path))


def iter_shard_paths(directory: str | Path) -> Iterator[Path]:
    """Final shard files in a capture folder, sorted; temporaries are never listed."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    for p in sorted(directory.iterdir()):
        if p.name.endswith(SHARD_SUFFIX) and p.is_file():
            yield p

