"""The ONE extraction loop: open -> prepare -> plan -> launch -> connect -> stream (rounds) -> report.

Owns the order of engine work for one run. :func:`run_extraction` is called as it is by the CLI and
by the Prefect flow, which passes a ``step`` wrapper that makes each call a task (so there is one loop,
not two). The engine work of a round is :func:`eaglenest.extraction.stream.stream`, a pipeline rather
than phase after phase:

- every pending sample enters at once; the client keeps ``concurrency`` requests in flight per server
  from one priority queue, so the engine's batch stays full until the last request;
- regeneration (optional): each answer is persisted (``answers.jsonl``) as it arrives, the
  conversation's next turn is queued ahead of new conversations, and a finished sample is persisted
  (``regenerated.jsonl``) and queued for capture at once;
- capture: a prefill request per sample (rid = sample id); its answer hands the sample to a validation
  thread that checks shards in chunks and appends them to the ledger while the engine keeps working.

Retryable failures (a dead server) end the round; the dead servers are relaunched and the round runs
again on what is left (bounded); invalid shards are re-queued once in a last round.

A run that ends by an exception (SIGTERM turned into SystemExit by the CLI, Prefect's termination signal,
Ctrl-C, a crash) stops its servers, then still writes ``report.json`` with ``status`` ``interrupted`` (a
BaseException that is not an Exception) or ``failed``, its phase times, rates and counts so far and what
stays pending, and re-raises the exception: the run's measurements are never lost with it.

Invariants: no request for a sample whose shard is already present (validation decides it), nor for
an answer already persisted; terminal failures are never resent within a run; every server this run
launched is stopped on every exit path; one process at a time runs an extraction (folder lock);
nothing here imports Prefect.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from eaglenest.data.samples import Sample
from eaglenest.engines import ENV_PROFILE_DIR
from eaglenest.engines.server_pool import ServerPool
from eaglenest.extraction.aio import CLIENT_THREAD
from eaglenest.extraction.checking import CHECK_THREADS
from eaglenest.extraction.connect import RunContext, after_revive, connect, make_pool
from eaglenest.extraction.report import Counts, write_report
from eaglenest.extraction.self_prompts import ask_for_extraction
from eaglenest.extraction.state import (
    SELF_PROMPTS,
    Extraction,
    Prepared,
    open_extraction,
    plan,
    prepare,
)
from eaglenest.extraction.stream import Phases, RoundResult, stream
from eaglenest.extraction.validator import VALIDATE_THREAD, problem, validate_left, validate_step

log = logging.getLogger(__name__)

Step = Callable[..., Any]
"""``step(fn, *args, **kwargs)`` runs one step of the loop; the flow's wrapper makes it a Prefect task."""


def direct(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


@dataclass(frozen=True, slots=True)
class Progress:
    total: int
    """Samples of the extraction (done before this run included)."""
    done_before: int
    """Samples settled before this run (validated, or skipped by an earlier regeneration)."""
    answered: int
    """Capture answers this run (shards written)."""
    failed: int
    skipped: int
    """Skipped this run (a regenerated answer cut or empty, a sample over the server's limit)."""
    validated: int
    """Settled before this run + validated this run (so a resumed run does not show 0)."""
    tokens: int
    """Prompt tokens prefilled with capture this run."""
    generated_tokens: int
    regenerated: int
    requests: int
    elapsed_s: float
    rates: dict[str, float] = field(default_factory=dict)
    """generated_tok_per_s, prefill_tok_per_s, validated_per_s (each over its phase's time so far)."""
    capturing: int = 0
    """Captures asked for and not answered yet (queued or in flight): when it grows, capture lags."""
    retrying: int = 0
    """Retryable failures of the round in progress (a server taken out): the next round tries them again."""

# ------------------------------------------------------------------------------ servers
def start_servers(pool: ServerPool) -> list[str]:
    return pool.start()


def stop_servers(pool: ServerPool) -> None:
    pool.stop()


# ------------------------------------------------------------------------------ end to end
class Stages(dict[str, float]):
    """Seconds each stage of a run took (the report's ``phases_s``); ``on_stage(name, seconds)`` hears each one as
    it ends (the CLI prints them: a log that outlives the report still shows where the time went)."""

    def __init__(self, on_stage: Callable[[str, float], None] | None = None) -> None:
        super().__init__()
        self.on_stage = on_stage

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Time the block as stage ``name``, also when it raises (a run that fails or is stopped reports the
        stage it ended in, up to then)."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self[name] = seconds = time.perf_counter() - t
            if self.on_stage is not None:
                with contextlib.suppress(Exception):  # a display never fails the run
                    self.on_stage(name, seconds)


def run_extraction(params, *, on_progress: Callable[[Progress], None] | None = None, pool: ServerPool | None = None,
                   transport: httpx.AsyncBaseTransport | None = None, step: Step = direct,
                   on_stage: Callable[[str, float], None] | None = None) -> dict:
    """Extract end to end; returns the report (also in report.json). ``step`` wraps each step's call; ``on_stage``
    hears each stage's seconds as it ends (:class:`Stages`)."""
    t0 = time.perf_counter()
    if os.environ.get(ENV_PROFILE_DIR):  # GPU diagnostics: the request loop and validation, beside SGLang's
        from eaglenest.testing import sglang_profiler

        sglang_profiler.maybe_start("client", thread_name=CLIENT_THREAD)
        sglang_profiler.maybe_start("validate", thread_name=VALIDATE_THREAD)
        sglang_profiler.maybe_start("check", thread_name=CHECK_THREADS + "*")
    evals = params.eval_capture.prompts
    if evals and not Path(evals.removeprefix("file://")).is_file():  # before any server starts
        raise FileNotFoundError(f"eval_capture.prompts: {evals} is not a file (`eaglenest bench prompts --format "
                                "messages` writes the prompt sets)")
    ext = step(open_extraction, params)
    with ext.lock(), quick_gil_handoff():
        stages = Stages(on_stage)
        early = params.self_prompts.count > 0 and not ext.path(SELF_PROMPTS).is_file()
        if early:
            pool = pool or make_pool(ext)  # the run's servers, started early: they stay for its rounds
        try:
            if early:
                with stages.timed("launch"):
                    step(start_servers, pool)
                with stages.timed("self_prompts"):
                    step(ask_self_prompts, ext, pool)
            with stages.timed("prepare"):
                prepared: Prepared = step(prepare, ext)
                pending = step(plan, ext, prepared)
        except BaseException:
            if early:  # (also when they failed to start: whatever did start is stopped)
                with contextlib.suppress(Exception):
                    pool.stop()
            raise
        return _run(ext, prepared, pending, t0=t0, stages=stages, on_progress=on_progress, pool=pool,
                    transport=transport, step=step)


EVAL_REQUEST_TIMEOUT_S = 120.0
"""The eval capture's per-request timeout: its few greedy answers go to servers idle but for it (the run's samples
wait), so a request that takes longer means a hung server, and the run's budget is not spent waiting on it."""


def capture_eval_prompts(ext: Extraction, pool: ServerPool) -> dict:
    """ExtractParams.eval_capture: the target answers a benchmark's prompts greedily on the run's servers and they
    are captured into an extraction of their own (:func:`eaglenest.speculative.calibration.capture_answers`,
    the one recipe of that capture, with the run's model as given: a later calibration of the same prompt file
    into the same folder resumes it instead of capturing again). Its summary for the run's report; a failure is
    reported there and the run goes on to its own samples (the eval capture is a side product)."""
    from eaglenest.speculative.calibration import CaptureSettings, capture_answers

    p, e = ext.params, ext.params.eval_capture
    settings = CaptureSettings(model=p.model, engine=p.engine, server_urls=pool.urls,
                               max_new_tokens=e.max_new_tokens, batch_size=p.batch_size,
                               concurrency=min(p.concurrency, 1024), dtype=p.dtype,
                               server_capture_dir=p.server_capture_dir, extraction_id=e.extraction_id,
                               request_timeout_s=min(p.request_timeout_s, EVAL_REQUEST_TIMEOUT_S))
    try:
        folder, report = capture_answers(e.prompts, settings, p.eval_output_path)
    except Exception as err:
        log.warning("the eval capture of %s failed (the run goes on): %s", e.prompts, err)
        return {"prompts": e.prompts, "error": f"{type(err).__name__}: {err}"}
    return {"prompts": e.prompts, "dir": str(folder), "samples": report["samples"], "done": report["done"],
            "pending": report["pending"], "skipped": report["skipped_total"]}


def ask_self_prompts(ext: Extraction, pool: ServerPool) -> dict:
    """The target writes the extraction's own prompts on the run's servers (ExtractParams.self_prompts)."""
    return ask_for_extraction(ext.dir, ext.model_dir, ext.params.self_prompts, pool.urls,
                              concurrency=ext.params.concurrency)


GIL_SWITCH_S = 0.001
"""The interpreter's switch interval while an extraction runs (Python's default: 5 ms)."""


@contextlib.contextmanager
def quick_gil_handoff(interval_s: float = GIL_SWITCH_S) -> Iterator[None]:
    """Every numpy or hashlib call of a shard check hands the GIL back and must wait for it again; beside the
    request loop busy in Python, that wait lasts up to the switch interval. Measured on 2 cores with a thread
    spinning in Python beside 2 check threads (``scripts/bench_validate.py``, results/2026-12-02-cpu): 25 shards/s
    at 5 ms, 80 at 1 ms, 128 at 0.5 ms, while the spinning thread lost 0-26% at 1 ms and 15-41% at 0.5 ms (on 2
    cores it also loses CPU time to the checks). 1 ms keeps most of the gain at a small cost to the request loop.
    Restored afterwards."""
    with _handoff_lock:
        if not _handoff["users"]:
            _handoff["before"] = sys.getswitchinterval()
            sys.setswitchinterval(min(_handoff["before"], interval_s))
        _handoff["users"] += 1
    try:
        yield
    finally:
        with _handoff_lock:
            _handoff["users"] -= 1
            if not _handoff["users"]:  # the last of overlapping extractions (threads of one process) restores it
                sys.setswitchinterval(_handoff["before"])


_handoff_lock = threading.Lock()
_handoff: dict[str, float] = {"users": 0, "before": 0.0}
"""Extractions running in this process, and the switch interval from before the first of them."""


def _run(ext: Extraction, prepared: Prepared, pending: list[Sample], *, t0: float, stages: Stages,
         on_progress: Callable[[Progress], None] | None, pool: ServerPool | None,
         transport: httpx.AsyncBaseTransport | None, step: Step) -> dict:
    """``stages``: what ran before (prepare; launch and self_prompts when the servers started early)."""
    params = ext.params
    counts, phases = Counts(), Phases()
    started = "launch" in stages
    relaunches = launched = 0
    servers: dict | None = None
    evals: dict | None = None  # ExtractParams.eval_capture's summary
    done_before = len(prepared.samples) - len(pending)
    if pending:
        base = {"answered": 0, "failed": 0, "tokens": 0, "regenerated": 0, "skipped": 0}
        last = [0.0]
        running: list[RoundResult] = []  # the round in progress: its counts reach the report also when it raises

        def progress(live: dict[str, int], *, force: bool = False) -> None:
            now = time.perf_counter()
            if on_progress is None or (now - last[0] < 0.5 and not force):
                return
            last[0] = now
            on_progress(Progress(
                total=len(prepared.samples), done_before=done_before,
                answered=base["answered"] + live["answered"], failed=base["failed"] + live["failed"],
                skipped=base["skipped"] + live["skipped"],
                validated=done_before + phases.validate.amount,
                tokens=base["tokens"] + live["tokens"],
                generated_tokens=phases.regenerate.amount, regenerated=base["regenerated"] + live["regenerated"],
                requests=counts.requests, elapsed_s=now - t0, rates=phases.rates(),
                capturing=live.get("capturing", 0), retrying=live.get("retry", 0)))

        def round_(todo: Sequence[Sample], **kwargs: Any) -> RoundResult:
            r = RoundResult()
            running[:] = [r]
            step(stream, ext, ctx, todo, phases=phases, on_progress=progress, result=r, **kwargs)
            running.clear()
            counts.add(r.counts)
            for k in base:
                base[k] += r.live[k]
            return r

        pool = pool or make_pool(ext)
        ctx: RunContext | None = None
        try:
            if not started:
                with stages.timed("launch"):
                    step(start_servers, pool)
            if params.eval_capture.prompts:
                evals = {"prompts": params.eval_capture.prompts, "ended": "before it finished"}  # (an interruption)
                with stages.timed("eval_capture"):
                    evals = step(capture_eval_prompts, ext, pool)
            with stages.timed("connect"):
                ctx = step(connect, ext, pool, transport=transport)
            with stages.timed("stream"):
                requeue, todo = [], pending
                for round_no in range(params.max_relaunch_rounds + 1):
                    r = round_(todo)
                    requeue += r.requeue
                    todo = r.retry
                    if not todo or round_no == params.max_relaunch_rounds or pool.revive() == 0:
                        break
                    after_revive(ctx)
                _give_up(counts, todo)
                if requeue:  # invalid shards, once more
                    _give_up(counts, round_(requeue, allow_requeue=False).retry)
            progress(dict.fromkeys(base, 0), force=True)
            relaunches, launched, servers = pool.relaunches, pool.launched, _servers(pool)
            with stages.timed("stop_servers"):
                step(stop_servers, pool)  # inside the try: a signal landing in this stop still ends every server
        except BaseException as e:
            # going down (an error, a signal): stop the servers directly, never through the step wrapper (its
            # Prefect API may be going down too), and let nothing raised here replace the original exception
            with stages.timed("stop_servers"), contextlib.suppress(Exception):
                pool.stop()
            _validate_left(ext, ctx, running, phases, stages)
            _report_ending(ext, prepared, counts, running, phases, stages, e, t0=t0, pool=pool, evals=evals)
            raise
    elif started:  # the servers wrote the prompts, and nothing is left to extract (every sample done before)
        with stages.timed("stop_servers"):
            step(stop_servers, pool)
    stages.update(_phase_seconds(phases))
    return step(write_report, ext, prepared, counts, wall_s=time.perf_counter() - t0, relaunches=relaunches,
                servers_launched=launched, phases=stages, rates=phases.rates(), servers=servers, eval_capture=evals)


def _servers(pool: ServerPool) -> dict | None:
    """When each launched server was ready (s from the launch), and those that failed after work began."""
    if not pool.ready_after_s and not pool.late_failures:
        return None
    return {"ready_after_s": dict(pool.ready_after_s), "launch_failures": list(pool.late_failures)}


def _phase_seconds(phases: Phases) -> dict[str, float]:
    return {"regenerate": phases.regenerate.seconds, "prefill": phases.prefill.seconds,
            "validate": phases.validate.seconds}


def _report_ending(ext: Extraction, prepared: Prepared, counts: Counts, running: Sequence[RoundResult],
                   phases: Phases, stages: Stages, error: BaseException, *, t0: float, pool: ServerPool,
                   evals: dict | None = None) -> None:
    """report.json of a run that an exception ends: what it did up to then (the round in progress included) and
    what stays pending. Written directly (not through the step wrapper) and never raising: the caller re-raises
    ``error``."""
    now = time.perf_counter()
    for r in running:  # its stream() settled these counts on the way out
        counts.add(r.counts)
    stages.update(_phase_seconds(phases))  # (the stage it ended in was timed up to the exception)
    status = "failed" if isinstance(error, Exception) else "interrupted"
    with contextlib.suppress(Exception):
        write_report(ext, prepared, counts, wall_s=now - t0, relaunches=pool.relaunches,
                     servers_launched=pool.launched, phases=stages, rates=phases.rates(), status=status,
                     ended_by=f"{type(error).__name__}: {error}".rstrip(": "), servers=_servers(pool),
                     eval_capture=evals)


def _validate_left(ext: Extraction, ctx: RunContext | None, running: Sequence[RoundResult], phases: Phases,
                   stages: Stages) -> None:
    """An interrupted round's answered-but-unvalidated samples, validated now that the servers are stopped (within
    ``stop_validate_s``; see :func:`~eaglenest.extraction.validator.validate_left`). Never raises: a second signal or
    a failing check ends it, and what reached the ledger stays."""
    left = [s for r in running for s in r.unvalidated]
    if ctx is None or not left or ext.params.stop_validate_s <= 0:
        return
    with stages.timed("stop_validate"):
        try:
            validate_left(ext, ctx, left, running[-1].counts, budget_s=ext.params.stop_validate_s,
                          phase=phases.validate)
        except BaseException as e:  # the run is ending by another exception, which the caller re-raises
            log.warning("validating the %d samples left after the stop ended early: %s", len(left), e)


def _give_up(counts: Counts, retry: Sequence[Sample]) -> None:
    """Samples still failing retryably after the last round: reported, left pending for a re-run."""
    counts.failed += len(retry)
    counts.problems += [problem(s.sample_id, "prefill", "server_unavailable",
                                 "servers failed and the relaunch rounds are spent; re-run to resume") for s in retry]


__all__ = ["Progress", "RunContext", "connect", "direct", "make_pool", "run_extraction", "stream", "validate_step"]
