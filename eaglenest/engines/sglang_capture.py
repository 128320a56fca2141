"""GPU-free core of the SGLang capture plugin: configuration, per-request splitting, coalescing, writing.

Owns everything the plugin does that needs no GPU and no sglang import, so CI covers it:

- :class:`CaptureConfig`: what the launcher puts in the environment (capture dir, receipt dir, aux
  ids, bounds); absent ``EAGLENEST_CAPTURE_DIR`` means the plugin is inert.
- :func:`plan_segments`: SGLang flattens a prefill batch into ``sum(extend_len)`` rows; this maps
  rows back to requests and says which rows to copy off the device.
- :class:`Coalescer`: chunked prefill computes a long prompt in several forwards; chunks are joined
  per request id and a shard exists only when rows ``[0, prompt_len)`` were all computed in this
  request's own prefill. Anything else (a prefix served from a cache, a lost chunk, rows beyond the
  prompt) fails the sample terminally.
- :class:`CaptureWriter`: one dispatcher thread (waits for the device copy, splits, coalesces,
  encodes) and a small pool writing shards with ``contract.publish_shard`` (write-once). A *receipt*
  is written after each shard is durable (or naming the failure); the HTTP side waits for it before
  answering (:mod:`sglang_receipts`). A rid that already has a shard gets that file's receipt when its
  token ids and provenance match, else a 409 ``rid_conflict`` failure. Bounded: the caller's
  host-buffer slots bound batches in flight, a semaphore bounds encoded shards waiting for the disk.

Invariants: a receipt saying ok exists only after its shard was fsynced and renamed, and it describes
the file under that name (read from its bytes); nothing with a non-finite value is written; a failure
is reported, never swallowed.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import logging
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eaglenest import contract
from eaglenest.engines.sglang_receipts import report_failure, write_receipt

log = logging.getLogger("eaglenest.sglang")

ENV_CAPTURE_DIR = "EAGLENEST_CAPTURE_DIR"
ENV_RECEIPT_DIR = "EAGLENEST_RECEIPT_DIR"
ENV_AUX_LAYERS = "EAGLENEST_AUX_LAYERS"
ENV_MAX_INFLIGHT = "EAGLENEST_MAX_INFLIGHT"
ENV_WRITER_THREADS = "EAGLENEST_WRITER_THREADS"
ENV_RECEIPT_TIMEOUT = "EAGLENEST_RECEIPT_TIMEOUT_S"
ENV_WRITER = "EAGLENEST_CAPTURE_WRITER"
PROVENANCE_FILE = "provenance.json"


class CaptureError(RuntimeError):
    """A batch or request cannot be captured as the contract requires."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CaptureConfig:
    """Plugin settings, passed from the launcher to every sglang process through the environment."""

    capture_dir: Path
    """Shards land here (``contract.shard_filename(rid)``)."""
    receipt_dir: Path
    """Small per-request receipts from the writer rank to the HTTP process (ephemeral)."""
    aux_layer_ids: tuple[int, ...] | None = None
    """Decoder layers whose OUTPUT is captured; None = contract default for the model's depth."""
    max_inflight: int = 4
    """Prefill batches whose device-to-host copy may be in flight before the scheduler waits."""
    writer_threads: int = 4
    writer: str = "process"
    """``process``: shards are written by a child process (default); ``thread``: inside the scheduler."""
    receipt_timeout_s: float = 300.0
    """How long an answer waits for its shard to become durable before failing (504)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> CaptureConfig | None:
        env = os.environ if environ is None else environ
        capture = env.get(ENV_CAPTURE_DIR)
        if not capture:
            return None
        capture_dir = Path(capture).expanduser().resolve()
        receipts = env.get(ENV_RECEIPT_DIR)
        ids = env.get(ENV_AUX_LAYERS, "").replace(" ", "")
        try:
            aux = tuple(int(x) for x in ids.split(",") if x) or None
            return cls(
                capture_dir=capture_dir,
                receipt_dir=Path(receipts).resolve() if receipts else capture_dir / ".receipts",
                aux_layer_ids=aux,
                max_inflight=max(1, int(env.get(ENV_MAX_INFLIGHT, "4"))),
                writer_threads=max(1, int(env.get(ENV_WRITER_THREADS, "4"))),
                writer=_writer_kind(env.get(ENV_WRITER, "process")),
                receipt_timeout_s=float(env.get(ENV_RECEIPT_TIMEOUT, "300")),
            )
        except ValueError as e:
            raise CaptureError(f"bad eaglenest capture setting in the environment: {e}") from None

    def to_env(self) -> dict[str, str]:
        env = {
            ENV_CAPTURE_DIR: str(self.capture_dir),
            ENV_RECEIPT_DIR: str(self.receipt_dir),
            ENV_MAX_INFLIGHT: str(self.max_inflight),
            ENV_WRITER_THREADS: str(self.writer_threads),
            ENV_WRITER: self.writer,
            ENV_RECEIPT_TIMEOUT: str(self.receipt_timeout_s),
        }
        if self.aux_layer_ids:
            env[ENV_AUX_LAYERS] = ",".join(str(i) for i in self.aux_layer_ids)
        return env


def _writer_kind(value: str) -> str:
    if value not in ("process", "thread"):
        raise ValueError(f"{ENV_WRITER}={value!r}: expected 'process' or 'thread'")
    return value


def wants_capture(rid: object) -> bool:
    return isinstance(rid, str) and bool(rid) and not rid.startswith(contract.NO_CAPTURE_RID_PREFIX)


# ------------------------------------------------------------------ batch layout
@dataclass(frozen=True, slots=True)
class ReqView:
    """One request's part of a prefill forward, read from SGLang's batch metadata."""

    rid: str
    prefix_len: int
    """Prompt tokens already in the KV cache before this forward (own earlier chunks, or reuse)."""
    extend_len: int
    """Rows this request occupies in the flattened batch."""
    prompt_len: int
    capture: bool
    input_ids: Sequence[int] | None = None
    """The prompt (only kept when captured)."""
    skip_reason: str | None = None
    """Why a request that should be captured cannot be (reported to its client)."""


@dataclass(frozen=True, slots=True)
class Segment:
    view: ReqView
    row_start: int
    """First row in the flattened batch."""
    host_start: int
    """First row in the compacted host copy (only captured rows are copied)."""

    @property
    def rows(self) -> int:
        return self.view.extend_len


def plan_segments(views: Sequence[ReqView], num_rows: int) -> tuple[list[Segment], list[tuple[int, int]]]:
    """Map the flattened batch to captured requests; returns (segments, merged row ranges to copy).

    Raises CaptureError when the rows do not add up (padding or sequence sharding the plugin does not
    understand): capturing then would attribute rows to the wrong request.
    """
    total = sum(v.extend_len for v in views)
    if total != num_rows:
        raise CaptureError(
            f"prefill batch has {num_rows} hidden-state rows but its requests extend {total} tokens "
            "(padded or sequence-sharded prefill is not supported by the capture plugin)"
        )
    segments: list[Segment] = []
    ranges: list[tuple[int, int]] = []
    row = host = 0
    for v in views:
        if v.capture and v.extend_len > 0:
            segments.append(Segment(v, row, host))
            if ranges and ranges[-1][1] == row:
                ranges[-1] = (ranges[-1][0], row + v.extend_len)
            else:
                ranges.append((row, row + v.extend_len))
            host += v.extend_len
        row += v.extend_len
    return segments, ranges


# ------------------------------------------------------------------ coalescing chunks
@dataclass(frozen=True, slots=True)
class Complete:
    rid: str
    input_ids: Sequence[int]
    aux_hidden: torch.Tensor  # [T, k*H]
    final_hidden: torch.Tensor  # [T, H]


@dataclass(frozen=True, slots=True)
class Failed:
    rid: str
    message: str
    status: int = 422
    kind: str = "capture_invalid"


@dataclass(slots=True)
class _Partial:
    next_pos: int
    parts: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


class Coalescer:
    """Joins prefill chunks per request id; yields a Complete only for rows [0, prompt_len)."""

    def __init__(self, max_pending: int = 1024) -> None:
        self.max_pending = max_pending
        self._pending: OrderedDict[str, _Partial] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, view: ReqView, aux: torch.Tensor, final: torch.Tensor) -> Complete | Failed | None:
        """Feed one request's rows from one forward. ``aux``/``final`` may be views of a reused buffer:
        they are cloned when kept past this call."""
        start, end = view.prefix_len, view.prefix_len + view.extend_len
        if end > view.prompt_len:
            self._pending.pop(view.rid, None)
            return Failed(view.rid, f"prefill of {view.rid!r} covers positions [{start}, {end}) beyond its prompt of "
                                    f"{view.prompt_len} tokens; captured length would not equal the prompt length")
        if start == 0:
            self._pending.pop(view.rid, None)  # a (re)started prefill replaces any stale partial
            if end == view.prompt_len:
                return Complete(view.rid, view.input_ids or (), aux, final)
            self._keep(view.rid, _Partial(end, [(aux.clone(), final.clone())]))
            return None
        partial = self._pending.get(view.rid)
        if partial is None or partial.next_pos != start:
            self._pending.pop(view.rid, None)
            have = 0 if partial is None else partial.next_pos
            return Failed(view.rid, f"prompt positions [{have}, {start}) of {view.rid!r} were not computed in this "
                                    "request's prefill (prefix reuse from a cache, or a lost chunk); captured length "
                                    f"would not equal the prompt length {view.prompt_len}. Launch sglang with "
                                    "--disable-radix-cache")
        partial.parts.append((aux.clone(), final.clone()))
        partial.next_pos = end
        if end < view.prompt_len:
            return None
        del self._pending[view.rid]
        return Complete(view.rid, view.input_ids or (), torch.cat([a for a, _ in partial.parts]),
                        torch.cat([f for _, f in partial.parts]))

    def _keep(self, rid: str, partial: _Partial) -> None:
        self._pending[rid] = partial
        while len(self._pending) > self.max_pending:
            old, _ = self._pending.popitem(last=False)
            log.warning("eaglenest capture: dropped the partial prefill of %r (more than %d pending)",
                        old, self.max_pending)


# ------------------------------------------------------------------ writing
@dataclass(slots=True)
class HostBatch:
    """A prefill batch's captured rows on the host, as the device copier hands them over."""

    segments: list[Segment]
    aux_hidden: torch.Tensor  # [n, k*H] bf16, rows = captured rows only (Segment.host_start)
    final_hidden: torch.Tensor  # [n, H] bf16
    ready: Callable[[], None] = lambda: None
    """Blocks until the host tensors hold the data (a CUDA event's synchronize)."""
    release: Callable[[], None] = lambda: None
    """Returns the host buffers to their pool (called once the rows were encoded or copied)."""
    where: tuple[int, str] | None = None
    """(slot, path) of the shared host buffer holding the rows, when another process may map it."""


class CaptureWriter:
    """Turns host batches into shards + receipts off the scheduler thread."""

    def __init__(
        self, *, capture_dir: str | Path, receipt_dir: str | Path, provenance: contract.Provenance,
        threads: int = 4, max_pending_writes: int = 16, max_pending_chunks: int = 1024,
    ) -> None:
        self.capture_dir = Path(capture_dir)
        self.receipt_dir = Path(receipt_dir)
        self.capture_dir.mkdir(parents=True, exist_ok=True)
        self.receipt_dir.mkdir(parents=True, exist_ok=True)
        self.provenance = provenance
        self.coalescer = Coalescer(max_pending_chunks)
        self.stats = {"batches": 0, "rows": 0, "shards": 0, "shard_bytes": 0, "failures": 0}
        self._queue: queue.Queue[HostBatch | None] = queue.Queue()
        self._pool = cf.ThreadPoolExecutor(threads, thread_name_prefix="eaglenest-shard-writer")
        self._slots = threading.BoundedSemaphore(max_pending_writes)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="eaglenest-capture", daemon=True)
        self._thread.start()

    def submit(self, batch: HostBatch) -> None:
        self._queue.put(batch)

    def fail(self, rid: str, message: str, *, status: int = 422, kind: str = "capture_invalid") -> None:
        """Report a request that will not get a shard (terminal for that sample)."""
        self._count("failures")
        report_failure(self.receipt_dir, rid, message, status=status, kind=kind)

    def close(self, timeout_s: float = 60.0) -> None:
        """Drain: every submitted batch is written (or failed) before this returns."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        self._pool.shutdown(wait=True)

    # ---------------------------------------------------------------- internals
    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.stats[key] += n

    def _loop(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            try:
                self._dispatch(batch)
            except Exception as e:  # never let the dispatcher die: fail what this batch held
                log.exception("eaglenest capture: batch dispatch failed")
                for seg in batch.segments:
                    self.fail(seg.view.rid, f"capture of {seg.view.rid!r} failed: {e}", status=500,
                              kind="capture_error")

    def _dispatch(self, batch: HostBatch) -> None:
        try:
            batch.ready()
            self._count("batches")
            self._count("rows", int(batch.aux_hidden.shape[0]))
            for seg in batch.segments:
                a, b = seg.host_start, seg.host_start + seg.rows
                outcome = self.coalescer.add(seg.view, batch.aux_hidden[a:b], batch.final_hidden[a:b])
                if isinstance(outcome, Failed):
                    self.fail(outcome.rid, outcome.message, status=outcome.status, kind=outcome.kind)
                elif isinstance(outcome, Complete):
                    self._encode_and_queue(outcome)
        finally:
            batch.release()

    def _encode_and_queue(self, done: Complete) -> None:
        ids = list(done.input_ids)
        if len(ids) != int(done.aux_hidden.shape[0]):
            self.fail(done.rid, f"captured {done.aux_hidden.shape[0]} rows for {done.rid!r} but its prompt has "
                                f"{len(ids)} tokens")
            return
        shard = contract.Shard(
            sample_id=done.rid, input_ids=torch.tensor(ids, dtype=torch.int32),
            aux_hidden=done.aux_hidden, final_hidden=done.final_hidden, provenance=self.provenance,
        )
        try:
            data = contract.encode_shard(shard)  # copies out of the (reused) host buffer
        except contract.ContractError as e:
            self.fail(done.rid, str(e))
            return
        self._slots.acquire()  # back-pressure: bounded encoded shards waiting for the disk
        self._pool.submit(self._write, done.rid, data)

    def _write(self, rid: str, data: bytes) -> None:
        try:
            receipt = contract.publish_shard(self.capture_dir / contract.shard_filename(rid), data)
            if not receipt["existing"]:
                self._count("shards")
                self._count("shard_bytes", receipt["bytes"])
            write_receipt(self.receipt_dir, rid, {"ok": True, **receipt})
        except contract.ShardConflict as e:
            self.fail(rid, str(e), status=409, kind="rid_conflict")
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                self.fail(rid, f"capture disk full writing {rid!r}: {e}", status=507, kind="disk_full")
            else:
                self.fail(rid, f"capture write failed for {rid!r}: {e}", status=500, kind="write_failed")
        except Exception as e:
            self.fail(rid, f"capture write failed for {rid!r}: {e}", status=500, kind="write_failed")
        finally:
            self._slots.release()
