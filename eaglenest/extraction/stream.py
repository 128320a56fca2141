"""One round of the extraction loop as a pipeline: regenerate -> capture -> validate, streamed.

Owns :func:`stream` (what the module docstring of :mod:`eaglenest.extraction.run` describes as a round) and
the phase clocks (:class:`Phases`) that the report and the progress show; the round's validation thread is
:class:`eaglenest.extraction.validator.Validator`.

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

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from eaglenest.data.chat import Skipped
from eaglenest.data.samples import Sample
from eaglenest.extraction.aio import run_sync
from eaglenest.extraction.client import Answer, EngineClient, Failure, Job
from eaglenest.extraction.connect import RunContext, end_round, round_client
from eaglenest.extraction.prefill import CAPTURE_LANE, capture_request, check_capture_answer
from eaglenest.extraction.regenerate import AnswerError, Regenerator, TurnAnswer
from eaglenest.extraction.report import Counts
from eaglenest.extraction.state import (
    ANSWERS,
    REGENERATED,
    Extraction,
    JsonlLog,
    load_answers,
    regenerated_row,
)
from eaglenest.extraction.validate import quarantine
from eaglenest.extraction.validator import Validator, problem, shard_path

CAPTURE, NEXT_TURN, NEW_CONVERSATION = 0, 1, 2
"""Job priorities (lower is sent first). When every job had one priority, the captures queued behind every
new conversation not yet sent: on the H200 (10K prompts, 2 x 1024 in flight) regeneration had finished 8,978
samples while 3,560 were captured, and the capture's clock ran while its requests waited."""

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
        if shard_path(ext, ctx, s.sample_id) is not None:
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
                path = shard_path(ext, ctx, sample.sample_id)
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
        c.retry_errors = dict(client.stats.retry_errors)
        c.streaks_survived, c.servers_taken_out = client.stats.streaks_survived, list(client.stats.down_reasons)
    if regenerator is not None:
        c.generated_tokens = regenerator.stats.generated_tokens
        c.replayed_answers = regenerator.stats.replayed
        c.turns_cut = regenerator.stats.turns_cut
        c.cut_kept = regenerator.stats.cut_kept
    c.prefill_s = phases.prefill.seconds
