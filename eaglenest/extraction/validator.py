"""The validation of a round: its thread (:class:`Validator`), one step of it into the ledger
(:func:`validate_step`), and what an interrupted run validates once its servers are stopped
(:func:`validate_left`). :mod:`eaglenest.extraction.stream` feeds the thread as capture answers arrive;
:mod:`eaglenest.extraction.validate` checks the shards.

Invariants: a chunk enters the ledger whole or not at all; the thread is always stopped by ``close``; samples put
and not validated when a round is abandoned are in ``left``, never dropped silently.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from eaglenest import contract
from eaglenest.atomic import atomic_write_bytes
from eaglenest.data.samples import Sample
from eaglenest.extraction.checking import check_pool
from eaglenest.extraction.report import Counts
from eaglenest.extraction.state import Extraction
from eaglenest.extraction.validate import validate_batch

if TYPE_CHECKING:
    from eaglenest.extraction.connect import RunContext
    from eaglenest.extraction.stream import Phase

log = logging.getLogger(__name__)


def problem(sample_id: str, stage: str, kind: str, message: str) -> dict:
    return {"sample_id": sample_id, "stage": stage, "kind": kind, "message": message}


# ------------------------------------------------------------------------------ validation thread
@dataclass
class ValidateStep:
    requeue: list[Sample] = field(default_factory=list)
    counts: Counts = field(default_factory=Counts)


def validate_step(ext: Extraction, ctx: RunContext, samples: Sequence[Sample], *,
                  allow_requeue: bool = True, pool: cf.Executor | None = None) -> ValidateStep:
    """Validate shards (checked by ``pool``: see validate_batch), append the valid ones to the ledger, quarantine
    the rest (re-queue once)."""
    step, t0 = ValidateStep(), time.perf_counter()
    if not samples:
        return step
    res = validate_batch(samples, extraction_dir=ext.dir, expect=ctx.expect, server_capture_dirs=ctx.capture_dirs,
                         config=ctx.validate_config, lm_head=ctx.lm_head, pool=pool)
    ext.ledger.append(res.entries)
    if res.pinned is not None:
        pinned = ext.path("provenance.json")
        if not pinned.is_file():
            atomic_write_bytes(pinned, res.pinned.to_json().encode())
        ctx.expect = ctx.expect.pinned(res.pinned)
    by_id = {s.sample_id: s for s in samples}
    c = step.counts
    c.validated, c.outliers = len(res.entries), res.outliers
    for e in res.entries:
        if "argmax_agreement" in e.stats:
            c.argmax_hits += e.stats["argmax_agreement"] * e.stats["argmax_positions"]
            c.argmax_positions += e.stats["argmax_positions"]
    for inv in res.invalid:
        if inv.requeue and allow_requeue:
            step.requeue.append(by_id[inv.sample_id])
        else:
            c.invalid += 1
            c.problems.append(problem(inv.sample_id, "validate", inv.kind, inv.reason))
    c.requeued = len(step.requeue)
    c.validate_s = time.perf_counter() - t0
    return step


def shard_path(ext: Extraction, ctx: RunContext, sample_id: str) -> Path | None:
    """Where a sample's shard was written: the extraction's capture folder or a server's (None: nowhere yet)."""
    name = contract.shard_filename(sample_id)
    return next((p for d in (ext.capture_dir, *map(Path, ctx.capture_dirs)) if (p := d / name).is_file()), None)


STOP_VALIDATE_CHUNK = 256
"""Samples per chunk when an interrupted run validates what it left (each chunk enters the ledger at once)."""


def validate_left(ext: Extraction, ctx: RunContext, samples: Sequence[Sample], counts: Counts, *, budget_s: float,
                  phase: Phase | None = None, chunk: int = STOP_VALIDATE_CHUNK,
                  clock: Callable[[], float] = time.monotonic) -> None:
    """After an interrupted run stopped its servers: validate its answered-but-unvalidated ``samples`` whose shards
    are present, chunk by chunk into the ledger, until ``budget_s`` has passed; counted into ``counts`` as each
    chunk is done (so a second interruption keeps what was counted). A shard that never came (its server stopped
    first) and an invalid one (counted, quarantined) leave their sample pending: the next run asks for it again. On the
    H100 (2026-12-05, 16 cores beside two SGLang servers) an extraction stopped by its time budget had captured
    14,669 samples and validated 8,920: the rest waited for a next run that the session had no time for."""
    present = [s for s in samples if shard_path(ext, ctx, s.sample_id) is not None]
    if not present or budget_s <= 0:
        return
    deadline = clock() + budget_s
    with check_pool(ctx.validate_config) as pool:
        for i in range(0, len(present), chunk):
            if clock() >= deadline:
                break
            if phase is not None:
                phase.begin()
            step = validate_step(ext, ctx, present[i : i + chunk], allow_requeue=False, pool=pool)
            step.counts.validated_after_stop = step.counts.validated
            counts.add(step.counts)
            if phase is not None:
                phase.mark(step.counts.validated)


RECHECK_PIECE = 64
"""Samples per piece when a broken process pool's chunk is checked again in threads."""

VALIDATE_THREAD = "extract-validate"
"""The validation thread's name (the PROFILE diagnostics sample it by name)."""


class Validator:
    """Validates answered samples in a thread, in chunks of up to ``chunk`` (whatever has arrived after
    ``linger_s``), so shard checks and ledger appends overlap the engine's work."""

    def __init__(self, ext: Extraction, ctx: RunContext, phase: Phase, *, chunk: int, allow_requeue: bool,
                 linger_s: float = 0.25) -> None:
        self.ext, self.ctx, self.phase, self.chunk = ext, ctx, phase, max(4, chunk)
        self.allow_requeue, self.linger_s = allow_requeue, linger_s
        self.counts, self.requeue = Counts(), []
        self.left: list[Sample] = []
        """Samples put and not validated when the thread stopped without draining (``close(drain=False)``)."""
        self._q: queue.Queue[Sample | None] = queue.Queue()
        self._error: BaseException | None = None
        self._abandon = False
        self._pool: cf.Executor | None = None
        """Checks the shards, threads or processes (ValidateConfig.processes), for the whole round."""
        self._thread = threading.Thread(target=self._loop, name=VALIDATE_THREAD, daemon=True)
        self._thread.start()

    def put(self, sample: Sample) -> None:
        self._q.put(sample)

    def close(self, *, drain: bool = True) -> None:
        """Validate what is queued (``drain``; else leave it in :attr:`left`, after the chunk in progress), stop
        the thread, raise what it raised."""
        self._abandon = not drain
        self._q.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error

    def _loop(self) -> None:
        try:
            self._chunks()
        finally:
            if self._pool is not None:
                self._pool.shutdown(cancel_futures=True)

    def _validate(self, batch: list[Sample]) -> ValidateStep:
        """One chunk through the round's check pool (started with the first chunk). A check process that died
        (killed for memory, say) breaks a process pool before anything of the chunk is recorded: the chunk is
        checked again in threads, which serve the rest of the round (not when the round is being abandoned: the
        chunk joins :attr:`left`)."""
        if self._pool is None:
            self._pool = check_pool(self.ctx.validate_config)
        try:
            return validate_step(self.ext, self.ctx, batch, allow_requeue=self.allow_requeue, pool=self._pool)
        except cf.process.BrokenProcessPool as e:
            if self._abandon:  # the round is ending: its chunk waits for the run's validation after the stop
                self.left += batch
                return ValidateStep()
            log.warning("validation: a check process died (%s); checking in threads from here", e)
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = check_pool(dataclasses.replace(self.ctx.validate_config, processes=0))
            return self._in_pieces(batch)

    def _in_pieces(self, batch: list[Sample]) -> ValidateStep:
        """A broken process pool's chunk, checked again in threads piece by piece: when the round is abandoned
        meanwhile (a check process killed by the same signal that stops the run), the rest joins :attr:`left` at
        once instead of keeping the stopping run waiting for the whole chunk."""
        out = ValidateStep()
        for i in range(0, len(batch), RECHECK_PIECE):
            if self._abandon:
                self.left += batch[i:]
                break
            step = validate_step(self.ext, self.ctx, batch[i : i + RECHECK_PIECE], allow_requeue=self.allow_requeue,
                                 pool=self._pool)
            out.counts.add(step.counts)
            out.requeue += step.requeue
        return out

    def _chunks(self) -> None:
        end = False
        while not end:
            item = self._q.get()
            batch = [] if item is None else [item]
            end = item is None
            deadline = time.monotonic() + self.linger_s
            while not end and len(batch) < self.chunk:
                try:
                    item = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if item is None:
                    end = True
                else:
                    batch.append(item)
            if not batch:
                continue
            if self._error is not None:
                continue
            if self._abandon:
                self.left += batch
                continue
            try:
                self.phase.begin()
                v = self._validate(batch)
            except BaseException as e:  # surfaced by close(); the loop keeps draining so close() returns
                self._error = e
                continue
            self.counts.add(v.counts)
            self.requeue += v.requeue
            self.phase.mark(v.counts.validated)
