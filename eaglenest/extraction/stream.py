"""One round of the extraction loop as a pipeline: regenerate -> capture -> validate, streamed.

Owns :func:`stream` (what the module docstring of :mod:`eaglenest.extraction.run` describes as a round),
the validation thread (:class:`Validator`, :func:`validate_step`) and the phase clocks (:class:`Phases`)
that the report and the progress show.

Order of the work (priority queues, lower first): a sample's capture (:data:`CAPTURE`), then a
conversation's next turn (:data:`NEXT_TURN`), then new conversations (:data:`NEW_CONVERSATION`). Capture
first keeps it in step with regeneration, so few answered samples wait for it and the round ends soon after
the last answer; new conversations last keep the engine's decode batch full with whatever is left. While
regenerating, captures run in their own lane (``capture_concurrency`` in flight per server) so that captures
waiting for their shards never hold the generations' slots.

Invariants: an answer is persisted before it is used; a shard already present is validated, never
requested; an interrupted round leaves its answered-but-unvalidated samples in its result (the run validates
them after stopping its servers, within a bound; the next run validates what is left, without a request); the
validation thread is always stopped before :func:`stream` returns or raises, and the round's counts so far are
in its :class:`RoundResult` then (also when it raises).
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

from eaglenest import contract
from eaglenest.data.chat import Skipped
from eaglenest.data.samples import Sample
from eaglenest.extraction.aio import run_sync
from eaglenest.extraction.client import Answer, EngineClient, Failure, Job
from eaglenest.extraction.connect import RunContext, end_round, round_client
from eaglenest.extraction.prefill import CAPTURE_LANE, capture_request, check_capture_answer
from eaglenest.extraction.regenerate import AnswerError, Regenerator, TurnAnswer
from eaglenest.extraction.state import (
    ANSWERS,
    REGENERATED,
    Counts,
    Extraction,
    JsonlLog,
    load_answers,
    regenerated_row,
)
from eaglenest.extraction.validate import check_pool, quarantine, validate_batch

CAPTURE, NEXT_TURN, NEW_CONVERSATION = 0, 1, 2
"""Job priorities (lower is sent first). When every job had one priority, the captures queued behind every
new conversation not yet sent: on the H200 (10K prompts, 2 x 1024 in flight) regeneration had finished 8,978
samples while 3,560 were captured, and the capture's clock ran while its requests waited."""

log = logging.getLogger(__name__)


class Phase:
    """When a phase ran (first start to last end, possibly overlapping others) and how much it did."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.end: float | None = None
        self.amount = 0

    def begin(self, at: float | None = None) -> None:
        """Start the clock now, or at ``at`` (a ``perf_counter`` time) when that is earlier."""
        if at is not None and self.start is not None:
            self.start = min(self.start, at)
        elif self.start is None:
            self.start = time.perf_counter() if at is None else at

    def mark(self, amount: int = 0) -> None:
        self.begin()
        self.end = time.perf_counter()
        self.amount += amount

    @property
    def seconds(self) -> float:
        return (self.end - self.start) if self.start is not None and self.end is not None else 0.0

    def rate(self) -> float:
        return self.amount / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Phases:
    regenerate: Phase = field(default_factory=Phase)
    """amount = generated tokens"""
    prefill: Phase = field(default_factory=Phase)
    """amount = prompt tokens captured; from the first capture request sent (not queued) to the last answer"""
    validate: Phase = field(default_factory=Phase)
    """amount = samples validated"""

    def rates(self) -> dict[str, float]:
        return {"generated_tok_per_s": self.regenerate.rate(), "prefill_tok_per_s": self.prefill.rate(),
                "validated_per_s": self.validate.rate()}


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
            contract.atomic_write_bytes(pinned, res.pinned.to_json().encode())
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
    dirs = [ext.capture_dir, *map(Path, ctx.capture_dirs)]
    present = [s for s in samples if any((d / contract.shard_filename(s.sample_id)).is_file() for d in dirs)]
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


# ------------------------------------------------------------------------------ one round
@dataclass
class RoundResult:
    counts: Counts = field(default_factory=Counts)
    retry: list[Sample] = field(default_factory=list)
    """Samples whose request failed retryably (server gone): the next round tries them again."""
    failures: dict[str, Failure] = field(default_factory=dict)
    requeue: list[Sample] = field(default_factory=list)
    unvalidated: list[Sample] = field(default_factory=list)
    """An interrupted round's answered samples whose shards were not validated (the run may validate them once
    its servers are stopped: ExtractParams.stop_validate_s)."""
    live: dict[str, int] = field(default_factory=dict)
    """answered / failed (terminal) / retry (retryable: the next round) / tokens / regenerated / skipped (summed
    over rounds in progress), and capturing: captures asked for and not answered yet (queued or in flight; a
    growing number means capture lags)."""


def stream(ext: Extraction, ctx: RunContext, samples: Sequence[Sample], *, phases: Phases | None = None,
           on_progress: Callable[[dict[str, int]], None] | None = None, allow_requeue: bool = True,
           result: RoundResult | None = None) -> RoundResult:
    """Regenerate (when asked), capture and validate ``samples`` as one pipeline; see the module docstring.
    ``result`` (filled in place and returned) lets a caller read what the round did when it raises."""
    phases = phases or Phases()
    res = result if result is not None else RoundResult()
    c = res.counts
    dirs = [ext.capture_dir, *map(Path, ctx.capture_dirs)]
    regen = ext.params.regeneration.enabled
    live = res.live = {"answered": 0, "failed": 0, "retry": 0, "tokens": 0, "regenerated": 0, "skipped": 0,
                       "capturing": 0}
    validator = Validator(ext, ctx, phases.validate, chunk=ext.params.batch_size, allow_requeue=allow_requeue)
    answers_log = JsonlLog(ext.path(ANSWERS)) if regen else None
    regen_log = JsonlLog(ext.path(REGENERATED)) if regen else None
    regenerator = client = None
    # set once the round ends, before its logs close: a terminated round waits a bounded time for the client to
    # unwind (under load it took longer: answers then came in after the logs were closed and were reported as
    # engine contract failures)
    stopped = threading.Event()
    # captures have their own lane while the target regenerates. On the H200 with one lane (1,024 in flight,
    # captures first) 300-500 captures were waiting at a time, mostly in flight on the generations' slots, and
    # generation ran at 10.2K tok/s; 18.3K when the captures had waited in the client
    capture_lane = CAPTURE_LANE if any(name == CAPTURE_LANE for name, _ in ctx.client_config.lanes) else None
    if regen:
        persisted = {k: TurnAnswer.from_json(d) for k, d in load_answers(ext).items()}
        regenerator = Regenerator(ctx.encoder, ctx.regen_config, ctx.max_prompt_tokens, answers=persisted,
                                  on_answer=lambda a: answers_log.write([a.to_json()]),
                                  priority=NEW_CONVERSATION, next_turn_priority=NEXT_TURN)

    asked: dict[str, Sample] = {}  # captures sent or queued, not answered yet (a shard may be written meanwhile)

    def capture(s: Sample) -> list[Job]:
        if s.num_tokens > ctx.max_prompt_tokens:
            c.skipped += 1
            live["skipped"] += 1
            c.problems.append(problem(s.sample_id, "prefill", "too_long",
                                       f"{s.num_tokens} tokens > server limit {ctx.max_prompt_tokens}"))
            return []
        name = contract.shard_filename(s.sample_id)
        if any((d / name).is_file() for d in dirs):
            c.reused_shards += 1  # answered before (e.g. a killed run): validation decides, no request
            validator.put(s)
            return []
        live["capturing"] += 1
        asked[s.sample_id] = s
        return [Job(s.sample_id, capture_request(s), payload=s, priority=CAPTURE, check=check_capture_answer,
                    lane=capture_lane)]

    def regenerated(out: Job | Sample | Skipped) -> list[Job]:
        if isinstance(out, Job):
            return [out]
        regen_log.write([regenerated_row(out)])
        if isinstance(out, Skipped):
            live["skipped"] += 1
            c.problems.append(problem(out.sample_id, "regenerate", out.kind, out.reason))
            return []
        c.regenerated += 1
        live["regenerated"] += 1
        return capture(out)

    def failed(sample: Sample, f: Failure, stage: str) -> None:
        if f.kind == "retryable":  # the next round tries it again
            live["retry"] += 1
            res.retry.append(sample)
        else:
            live["failed"] += 1
            res.failures[sample.sample_id] = f
            c.problems.append(problem(sample.sample_id, stage, f.reason, f.message))
            if stage == "prefill" and f.reason == "contract":  # its shard must not stay under the capture name
                path = next((d / contract.shard_filename(sample.sample_id) for d in dirs
                             if (d / contract.shard_filename(sample.sample_id)).is_file()), None)
                if path is not None:
                    quarantine(ext.dir, path, sample.sample_id, f.message, "contract")

    def on_outcome(o: Answer | Failure) -> list[Job]:
        if stopped.is_set():  # the round ended (a termination) and its logs are closed: an answer that arrives
            return []         # while the client unwinds is not used; its sample stays pending for the next run
        if isinstance(o.payload, Sample):  # a capture
            s = o.payload
            live["capturing"] -= 1
            asked.pop(s.sample_id, None)
            if isinstance(o, Failure):
                failed(s, o, "prefill")
            else:
                live["answered"] += 1
                live["tokens"] += s.num_tokens
                phases.prefill.begin(at=time.perf_counter() - o.latency_s)  # when it was sent
                phases.prefill.mark(s.num_tokens)
                validator.put(s)
            follow: list[Job] = []
        else:  # a regeneration turn
            st = o.payload
            if isinstance(o, Failure):
                failed(st.sample, o, "regenerate")
                follow = []
            else:
                before = regenerator.stats.generated_tokens
                try:
                    out = regenerator.answered(st, o.body)
                except AnswerError as e:
                    failed(st.sample, Failure(o.key, "terminal", "contract", str(e), o.server, o.attempts),
                           "regenerate")
                    out = None
                phases.regenerate.mark(regenerator.stats.generated_tokens - before)
                follow = regenerated(out) if out is not None else []
        if on_progress is not None:
            on_progress(live)
        return follow

    ok = False
    try:
        jobs: list[Job] = []
        for s in sorted(samples, key=lambda s: -s.num_tokens):  # long ones first: less tail latency
            if regen and not s.regenerated:
                out = regenerator.start(s)
                if isinstance(out, Job):
                    phases.regenerate.begin()
                jobs += regenerated(out)
            else:
                jobs += capture(s)
        if jobs:
            client = round_client(ctx)  # servers admitted meanwhile join it (connect.admit)
            try:
                run_sync(lambda: client.run(jobs, on_outcome=on_outcome))
            finally:
                end_round(ctx)
        ok = True
    finally:
        stopped.set()
        for log in (answers_log, regen_log):
            if log is not None:
                log.close()
        try:
            # interrupted: the samples answered and not validated go to res.unvalidated (the run validates them once
            # its servers are stopped; what is left, the next run, without a request)
            validator.close(drain=ok)
        finally:
            if not ok:  # what the run may validate once its servers are stopped (those whose shards are present)
                res.unvalidated = [*validator.left, *asked.values()]
            _settle(res, validator, regenerator, client, phases)
            if on_progress is not None:
                on_progress(live)
    return res


def _settle(res: RoundResult, validator: Validator, regenerator: Regenerator | None, client: EngineClient | None,
            phases: Phases) -> None:
    """The round's counts from its parts (after the validation thread stopped), also for an interrupted round."""
    c = res.counts
    c.add(validator.counts)
    res.requeue = validator.requeue
    c.tokens = res.live["tokens"]
    c.failed = len(res.failures)
    if client is not None:
        c.requests, c.retries = client.stats.requests, client.stats.retries
        c.streaks_survived, c.servers_taken_out = client.stats.streaks_survived, list(client.stats.down_reasons)
    if regenerator is not None:
        c.generated_tokens = regenerator.stats.generated_tokens
        c.replayed_answers = regenerator.stats.replayed
        c.turns_cut = regenerator.stats.turns_cut
        c.cut_kept = regenerator.stats.cut_kept
    c.prefill_s = phases.prefill.seconds
