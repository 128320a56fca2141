"""Shard validation and quarantine: a sample is done only when its shard passes every check here.

Owns the checks between "the server answered" and "the ledger records the sample":

1. the shard exists (waiting a bounded ``shard_wait_s``: SGLang may publish it just after answering);
2. it parses as schema v1 (known version, tensors present, dtypes/shapes consistent);
3. its sample id and provenance equal the run's (engine, model/tokenizer/template hashes, dtype,
   aux layers, convention, ...);
4. ``input_ids`` equal the request exactly (so T equals the prompt length);
5. aux width = len(aux_layer_ids) * H and final width = H of the run;
6. every value finite;
7. per-layer mean token norms (aux layers and final), flagged as outliers against the batch median;
8. for regenerated samples: argmax of the target LM head over final_hidden[t] vs token[t + 1] on
   assistant spans, reported as an agreement rate (optionally a floor).

Invariants: an invalid shard is moved to ``<extraction>/quarantine/`` with ``<name>.reason.json``
and never stays under its capture name; a missing shard and a provenance mismatch are terminal
(systematic: re-sending cannot help); other invalid shards may be re-queued once by the caller.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from eaglenest import contract
from eaglenest.atomic import atomic_write_bytes
from eaglenest.data.samples import Sample
from eaglenest.extraction.checking import check_pool
from eaglenest.extraction.ledger import LedgerEntry
from eaglenest.extraction.lm_head import ARGMAX_GROUP_ROWS, answer_rows, argmax_agreement, argmax_hits

QUARANTINE = "quarantine"


@dataclass(frozen=True, kw_only=True, slots=True)
class Expectation:
    """What every shard of the run must carry. ``provenance`` None = not known yet (SGLang without a
    capture block): the listed fields are checked and the first valid shard pins the rest."""

    aux_layer_ids: tuple[int, ...]
    hidden_size: int
    num_layers: int
    model_hash: str
    tokenizer_hash: str
    chat_template_hash: str
    provenance: contract.Provenance | None = None

    def mismatches(self, p: contract.Provenance) -> list[str]:
        if self.provenance is not None:
            return [f"{n}: {getattr(p, n)!r} != {getattr(self.provenance, n)!r}"
                    for n in self.provenance.mismatches(p)]
        want = {"aux_layer_ids": tuple(self.aux_layer_ids), "hidden_size": self.hidden_size,
                "num_layers": self.num_layers, "model_hash": self.model_hash, "tokenizer_hash": self.tokenizer_hash,
                "chat_template_hash": self.chat_template_hash, "convention": contract.CONVENTION,
                "schema_version": contract.SCHEMA_VERSION}
        return [f"{k}: {getattr(p, k)!r} != {v!r}" for k, v in want.items() if getattr(p, k) != v]

    def pinned(self, p: contract.Provenance) -> Expectation:
        from dataclasses import replace

        return replace(self, provenance=p)


@dataclass(frozen=True, kw_only=True, slots=True)
class ValidateConfig:
    shard_wait_s: float = 30.0
    """How long a shard may take to appear after its answer before 'capture missing' (terminal)."""
    poll_s: float = 0.05
    outlier_factor: float = 4.0
    """A layer's mean norm more than this factor above/below the batch median is flagged (not rejected)."""
    min_argmax_agreement: float | None = None
    """For regenerated samples: reject below this LM-head argmax agreement (None = report only)."""
    workers: int = min(8, os.cpu_count() or 1)
    """Shards read and checked in parallel (numpy, hashlib and file reads release the GIL)."""
    processes: int = 0
    """Check shards in this many worker processes instead of ``workers`` threads (0 = threads). Beside a busy
    request loop each numpy or hashlib call of a thread waits for the GIL again; a process never does
    (:func:`eaglenest.extraction.checking.default_check_processes`)."""
    process_batch: int = 16
    """Shards per task sent to a check process (``chunksize`` of its map). Each task's submission, pickling and
    result pass through the run's process, whose threads wait for the GIL while the request loop holds it: one
    task per shard made that per-shard (scripts/bench_validate.py --pools). A chunk of fewer than
    ``2 * processes * process_batch`` shards is cut finer, two tasks per process."""


class InvalidShard(Exception):
    def __init__(self, reason: str, kind: str, *, requeue: bool = True) -> None:
        super().__init__(reason)
        self.reason, self.kind, self.requeue = reason, kind, requeue

    def __reduce__(self):  # a check process sends it back as a value
        return _invalid_shard, (self.reason, self.kind, self.requeue)


def _invalid_shard(reason: str, kind: str, requeue: bool) -> InvalidShard:
    return InvalidShard(reason, kind, requeue=requeue)


@dataclass(frozen=True, slots=True)
class Invalid:
    sample_id: str
    kind: str
    """missing | unreadable | provenance | tokens | shape | nonfinite | argmax."""
    reason: str
    requeue: bool
    quarantined: str | None = None


@dataclass(slots=True)
class BatchValidation:
    entries: list[LedgerEntry] = field(default_factory=list)
    invalid: list[Invalid] = field(default_factory=list)
    pinned: contract.Provenance | None = None
    """The provenance the batch pinned (only when the expectation had none)."""
    outliers: int = 0


# The numeric checks run on numpy views of the bf16 bit patterns: elementwise torch ops on the CPU pay
# thread-pool wake-ups per op (~10 ms each on a busy machine), which would steal time from the server. And each
# numpy call hands the GIL back and waits to take it again: beside a thread busy in Python (the request loop)
# that wait is up to the interpreter's switch interval, so the checks make as few calls as they can.
_SQUARES: list[np.ndarray] = []
"""Float32 buffers for one tensor's squares, taken by a check and given back (each batch has its own threads)."""
_SQUARES_LOCK = threading.Lock()


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)  # zero copy


def _block_sums(bits: np.ndarray, width: int) -> np.ndarray:
    """Sum of squares (float32) of each ``width`` consecutive values of bf16 bits [T, n * width] -> [T * n], in
    three numpy calls over a reused buffer (0.5 ms for a 615-token shard's aux states here)."""
    n = bits.size
    with _SQUARES_LOCK:
        buf = _SQUARES.pop() if _SQUARES else None
    if buf is None or buf.size < n:
        buf = np.empty(max(n, 1 << 21), dtype=np.uint32)
    try:
        f = np.left_shift(bits.reshape(-1), 16, out=buf[:n], dtype=np.uint32).view(np.float32)  # bf16 -> f32, exact
        np.multiply(f, f, out=f)
        return f.reshape(-1, width).sum(-1, dtype=np.float32)
    finally:
        with _SQUARES_LOCK:
            _SQUARES.append(buf)


def _nonfinite(bits: np.ndarray) -> tuple[int, int] | None:
    """First (row, col) whose bf16 exponent is all ones (Inf or NaN), else None."""
    bad = (bits & 0x7F80) == 0x7F80
    if not bad.any():
        return None
    r, c = np.argwhere(bad)[0]
    return int(r), int(c)


def _hidden_checks(shard: contract.Shard) -> list[float]:
    """The mean over tokens of each aux layer's and the final state's L2 norm; raises InvalidShard at the first
    non-finite value. A NaN or Inf makes its block's sum of squares non-finite, so only a shard with such a sum
    is scanned value by value; when that finds none, a finite value squared past float32 did it, and the norms
    are taken in float64."""
    k = len(shard.provenance.aux_layer_ids)
    out: list[float] = []
    for name, t, groups in (("aux_hidden", shard.aux_hidden, k), ("final_hidden", shard.final_hidden, 1)):
        bits = _bits(t)
        width = bits.shape[1] // groups
        sums = _block_sums(bits, width)  # [T * groups]
        if not np.isfinite(sums).all():
            bad = _nonfinite(bits)
            if bad is not None:
                raise InvalidShard(f"non-finite value in {name} at [token {bad[0]}, col {bad[1]}]", "nonfinite")
            f = np.left_shift(bits, 16, dtype=np.uint32).view(np.float32).astype(np.float64)
            sums = np.square(f).reshape(-1, width).sum(-1)
        out += np.sqrt(sums.reshape(bits.shape[0], groups)).mean(axis=0).tolist()
    return out


def check_shard(
    sample: Sample, data: bytes, expect: Expectation, *, where: str, lm_head: torch.Tensor | None = None,
    config: ValidateConfig | None = None,
) -> tuple[contract.Shard, dict]:
    """Every per-shard check; returns (shard, stats) or raises InvalidShard."""
    config = config or ValidateConfig()
    try:
        shard = contract.decode_shard(data, where=where)
    except contract.ContractError as e:
        raise InvalidShard(f"unreadable shard: {e}", "unreadable") from None
    if shard.sample_id != sample.sample_id:
        raise InvalidShard(f"shard holds sample {shard.sample_id!r}, expected {sample.sample_id!r}", "unreadable")
    diff = expect.mismatches(shard.provenance)
    if diff:
        raise InvalidShard("provenance differs from the run's: " + "; ".join(diff), "provenance", requeue=False)
    ids = shard.input_ids
    if ids.shape[0] != sample.num_tokens:
        raise InvalidShard(f"shard has T={ids.shape[0]} rows, the request had {sample.num_tokens} tokens", "tokens")
    differ = np.flatnonzero(ids.numpy() != sample.input_ids)
    if differ.size:
        raise InvalidShard(f"input_ids differ from the request at position {int(differ[0])}", "tokens")
    k, h = len(expect.aux_layer_ids), expect.hidden_size
    if shard.aux_hidden.shape[1] != k * h or shard.final_hidden.shape[1] != h:
        raise InvalidShard(f"aux_hidden width {shard.aux_hidden.shape[1]} / final width {shard.final_hidden.shape[1]}"
                           f", expected {k}*{h}={k * h} / {h}", "shape", requeue=False)
    stats: dict = {"norms": [round(x, 4) for x in _hidden_checks(shard)]}
    if sample.regenerated and lm_head is not None:
        _argmax_stats(stats, *argmax_agreement(shard.final_hidden, ids, sample.loss_spans, lm_head), config)
    return shard, stats


def _argmax_stats(stats: dict, hit: int, n: int, config: ValidateConfig) -> None:
    """Record the agreement in ``stats``; raise InvalidShard below ``config.min_argmax_agreement``."""
    rate = hit / n if n else 1.0
    stats["argmax_agreement"] = round(rate, 4)
    stats["argmax_positions"] = n
    if config.min_argmax_agreement is not None and rate < config.min_argmax_agreement:
        raise InvalidShard(f"LM-head argmax agrees with the regenerated tokens at {rate:.1%} < "
                           f"{config.min_argmax_agreement:.1%}", "argmax")


def quarantine(extraction_dir: str | Path, path: Path, sample_id: str, reason: str, kind: str) -> str:
    """Move an invalid shard out of the capture folder, next to a ``.reason.json``; returns its new name."""
    qdir = Path(extraction_dir) / QUARANTINE
    qdir.mkdir(parents=True, exist_ok=True)
    name, n = path.name, 0
    while (qdir / name).exists() or (qdir / f"{name}.reason.json").exists():
        n += 1
        name = f"{path.name}.{n}"
    os.replace(path, qdir / name)
    note = {"sample_id": sample_id, "kind": kind, "reason": reason, "shard": path.name, "time": time.time()}
    atomic_write_bytes(qdir / f"{name}.reason.json", json.dumps(note, indent=1).encode())
    return name


def _wait_for(paths: dict[str, list[Path]], config: ValidateConfig,
              clock: Callable[[], float], sleep: Callable[[float], None]) -> dict[str, Path | None]:
    found: dict[str, Path | None] = {}
    deadline = clock() + config.shard_wait_s
    while True:
        for sid, candidates in paths.items():
            if found.get(sid) is None:
                found[sid] = next((p for p in candidates if p.is_file()), None)
        if all(found.values()) or clock() >= deadline:
            return found
        sleep(config.poll_s)


def _provenance_error(expect: Expectation, provenance: contract.Provenance) -> InvalidShard | None:
    """Shards checked in parallel before the run's provenance was pinned are held to it afterwards."""
    diff = expect.mismatches(provenance)
    if diff:
        return InvalidShard("provenance differs from the run's: " + "; ".join(diff), "provenance", requeue=False)
    return None


@dataclass(frozen=True, slots=True)
class _Checked:
    """What a shard check sends back: small, so that a check process returns it cheaply."""

    provenance: contract.Provenance
    stats: dict
    sha256: str
    nbytes: int
    rows: tuple[np.ndarray, np.ndarray] | None
    """Regenerated samples: (final_hidden's bf16 bits at the predicting positions [P, H], the tokens they
    predict [P]) for the batched LM-head argmax check."""


def _check_file(sample: Sample, path: Path, *, expect: Expectation, config: ValidateConfig,
                keep_rows: bool) -> _Checked | InvalidShard:
    """Read and check one shard (in a check thread or process; the argmax check runs batched afterwards)."""
    data = path.read_bytes()
    try:
        shard, stats = check_shard(sample, data, expect, where=str(path), config=config)
    except InvalidShard as e:
        return e
    rows = None
    if keep_rows and sample.regenerated:
        x, y = answer_rows(shard.final_hidden, shard.input_ids, sample.loss_spans)
        rows = (_bits(x), y.numpy())
    return _Checked(shard.provenance, stats, contract.sha256_bytes(data), len(data), rows)


def validate_batch(
    samples: Sequence[Sample], *, extraction_dir: str | Path, expect: Expectation,
    server_capture_dirs: Sequence[str | Path] = (), config: ValidateConfig | None = None,
    lm_head: torch.Tensor | None = None, clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep, pool: cf.Executor | None = None,
) -> BatchValidation:
    """Validate the shards of answered samples; valid ones become ledger entries (not yet appended).

    Shards are looked up in ``<extraction>/capture`` and then in ``server_capture_dirs``; a valid
    shard found elsewhere is moved into the extraction's capture folder. ``pool`` checks the shards (default:
    a :func:`~eaglenest.extraction.checking.check_pool` of ``config`` for this batch alone).
    """
    config = config or ValidateConfig()
    if pool is None:
        with check_pool(config) as own:
            return validate_batch(samples, extraction_dir=extraction_dir, expect=expect,
                                  server_capture_dirs=server_capture_dirs, config=config, lm_head=lm_head,
                                  clock=clock, sleep=sleep, pool=own)
    capture = Path(extraction_dir) / "capture"
    capture.mkdir(parents=True, exist_ok=True)
    dirs = [capture, *(Path(d) for d in server_capture_dirs if Path(d).resolve() != capture.resolve())]
    names = {s.sample_id: contract.shard_filename(s.sample_id) for s in samples}
    found = _wait_for({sid: [d / n for d in dirs] for sid, n in names.items()}, config, clock, sleep)
    out = BatchValidation()
    keep_rows = lm_head is not None
    todo = [s for s in samples if found[s.sample_id] is not None]
    check = functools.partial(_check_file, expect=expect, config=config, keep_rows=keep_rows)
    per_task = 1  # (threads: map ignores it) a few tasks per process at least, so that a small chunk is spread out
    if isinstance(pool, cf.ProcessPoolExecutor):
        per_task = max(1, min(config.process_batch, len(todo) // (2 * max(1, config.processes))))
    checks = pool.map(check, todo, [found[s.sample_id] for s in todo], chunksize=per_task)
    results: dict[str, _Checked | InvalidShard] = {}
    group: list[str] = []  # the argmax of each group of checked regenerated samples runs while the pool checks on
    rows = 0
    for s, res in zip(todo, checks, strict=True):
        results[s.sample_id] = res
        if isinstance(res, _Checked) and res.rows is not None:
            group.append(s.sample_id)
            rows += res.rows[1].shape[0]
            if rows >= ARGMAX_GROUP_ROWS:
                _check_argmax(results, group, lm_head, config)
                group, rows = [], 0
    if group:
        _check_argmax(results, group, lm_head, config)
    checked: list[tuple[Sample, Path, _Checked]] = []
    for s in samples:
        path = found[s.sample_id]
        if path is None:
            out.invalid.append(Invalid(s.sample_id, "missing", (
                f"capture missing: no shard {names[s.sample_id]} in {', '.join(map(str, dirs))} within "
                f"{config.shard_wait_s:g} s of the answer (is capture enabled on the server and its capture dir "
                "this extraction's?)"), requeue=False))
            continue
        res = results[s.sample_id]
        if isinstance(res, InvalidShard) or expect.provenance is not None:
            err = res if isinstance(res, InvalidShard) else _provenance_error(expect, res.provenance)
            if err is not None:
                q = quarantine(extraction_dir, path, s.sample_id, err.reason, err.kind)
                out.invalid.append(Invalid(s.sample_id, err.kind, err.reason, err.requeue, q))
                continue
        if expect.provenance is None:  # the first valid shard pins the run's full provenance
            expect = expect.pinned(res.provenance)
            out.pinned = res.provenance
        if path.parent != capture:
            atomic_write_bytes(capture / path.name, path.read_bytes())
            path.unlink()
        checked.append((s, capture / path.name, res))
    out.outliers = _flag_outliers([c.stats for _, _, c in checked], config.outlier_factor)
    for s, path, c in checked:
        out.entries.append(LedgerEntry(
            sample_id=s.sample_id, shard=path.name, sha256=c.sha256, bytes=c.nbytes,
            num_tokens=s.num_tokens, loss_tokens=s.loss_tokens, loss_spans=s.loss_spans,
            regenerated=s.regenerated, stats=c.stats,
        ))
    return out


def _check_argmax(results: dict[str, _Checked | InvalidShard], group: Sequence[str], lm_head: torch.Tensor,
                  config: ValidateConfig) -> None:
    """The LM-head argmax check of the checked regenerated samples ``group``, in one batched pass; a sample
    below the floor becomes an InvalidShard in ``results``."""
    items = []
    for sid in group:
        bits, nxt = results[sid].rows
        items.append((torch.from_numpy(bits).view(torch.bfloat16), torch.from_numpy(nxt)))
    for sid, (hit, n) in zip(group, argmax_hits(items, lm_head, 1024), strict=True):
        try:
            _argmax_stats(results[sid].stats, hit, n, config)
        except InvalidShard as e:
            results[sid] = e


def _flag_outliers(stats: list[dict], factor: float) -> int:
    """Mark ``stats['outliers']`` with the layer indices (last = final) far from the batch median."""
    if len(stats) < 4:
        return 0
    norms = np.asarray([s["norms"] for s in stats], dtype=np.float64)  # [N, k + 1]
    ratio = norms / np.maximum(np.median(norms, axis=0), 1e-12)  # [N, k + 1]
    flagged = 0
    for s, row in zip(stats, ratio.tolist(), strict=True):
        bad = [i for i, r in enumerate(row) if r > factor or r < 1 / factor]
        if bad:
            s["outliers"] = bad
            flagged += 1
    return flagged
