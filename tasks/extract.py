"""Prefect tasks for extraction: thin shells over ``eaglenest.extraction.state`` / ``eaglenest.extraction.run``.

Each task wraps one library call and adds what Prefect is for: retries (only for retryable errors),
cache keys, progress and artifacts.

- ``prepare`` is cached on CONTENT: the source's content fingerprint, the tokenizer and chat-template
  hashes and the token limits (:func:`eaglenest.extraction.state.prepare_key`), with results stored inside the
  extraction folder (so a cache entry never outlives the files it describes).
- ``prefill`` / ``validate`` are deliberately not cached: the ledger (content-verified shards) is
  their idempotency record. A sample in the ledger is never planned again, a present shard is
  validated instead of re-requested, and a quarantined one is requested again; a Prefect cache
  keyed on the batch would skip that last case.
- ``serving`` launches the servers as a task and stops their process groups on every exit path;
  the flow's on_failure/on_crashed hooks call :func:`teardown_servers` as a second line.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from uuid import UUID

import httpx
from prefect import task
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE

from eaglenest.data.samples import Sample
from eaglenest.engines.launcher import LaunchError
from eaglenest.extraction import run as run
from eaglenest.extraction import state as lib
from eaglenest.extraction.config import ExtractParams
from eaglenest.extraction.prefill import PrefillProgress
from eaglenest.servers import ServerPool, end_recorded_servers

RESULTS_DIR = "prefect-results"


def _retryable(exc: BaseException | None) -> bool:
    return isinstance(exc, httpx.TransportError | TimeoutError | ConnectionError | BlockingIOError)


def _retry_if_retryable(task, task_run, state) -> bool:
    try:
        state.result()
    except Exception as e:
        return _retryable(e)
    return False


def artifact_key(ext: lib.Extraction, what: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", f"extract-{what}-{ext.id}".lower()).strip("-")[:100]


# ------------------------------------------------------------------------------ setup
@task(name="open-extraction", cache_policy=NO_CACHE, persist_result=False)
def open_extraction(params: ExtractParams) -> lib.Extraction:
    return lib.open_extraction(params)


@dataclass(frozen=True)
class PreparedSummary:
    key: str
    samples: int
    skipped: int
    bad_records: int


@task(name="prepare-samples", persist_result=True,
      cache_key_fn=lambda _ctx, args: "extract-prepare-" + lib.prepare_key(args["ext"]))
def prepare(ext: lib.Extraction) -> PreparedSummary:
    p = lib.prepare(ext)
    return PreparedSummary(p.key, len(p.samples), len(p.skipped), len(p.bad))


def results_storage(ext: lib.Extraction) -> Path:
    return ext.dir / RESULTS_DIR


@task(name="plan-batches", cache_policy=NO_CACHE, persist_result=False)
def plan(ext: lib.Extraction) -> tuple[lib.Prepared, list[list[Sample]]]:
    prepared = lib.prepare(ext)  # reuses samples.parquet (content key) instead of tokenizing again
    return prepared, lib.plan(ext, prepared)


# ------------------------------------------------------------------------------ servers
@task(name="launch-servers", cache_policy=NO_CACHE, persist_result=False, retries=1, retry_delay_seconds=5,
      retry_condition_fn=lambda t, r, s: _launch_retryable(s))
def launch_servers(ext: lib.Extraction) -> ServerPool:
    pool = run.make_pool(ext)
    pool.start()
    return pool


def _launch_retryable(state) -> bool:
    try:
        state.result()
    except LaunchError as e:  # a port race or a slow first start; a bad command fails again fast
        return "not ready after" in str(e)
    except Exception:
        return False
    return False


@task(name="stop-servers", cache_policy=NO_CACHE, persist_result=False)
def stop_servers(pool: ServerPool) -> None:
    pool.stop()


@contextlib.contextmanager
def serving(ext: lib.Extraction) -> Iterator[ServerPool]:
    """Servers for the duration of the block; their process groups end on every exit path.

    On an error, a cancellation or a termination signal the groups are ended WITHOUT Prefect calls (the run
    may be going down with its API connection) and nothing raised by that cleanup replaces the original
    exception: a SIGTERMed run must end Crashed, not Failed by a cleanup error (RELIABILITY row 26)."""
    pool: ServerPool | None = None
    try:
        pool = launch_servers(ext)
        yield pool
    except BaseException:
        if pool is not None:
            with contextlib.suppress(Exception):
                pool.stop()
        with contextlib.suppress(Exception):
            teardown_servers(ext.dir)
        raise
    else:
        stop_servers(pool)
        teardown_servers(ext.dir)


def teardown_servers(extraction_dir: str | Path) -> int:
    """End every server group recorded in ``servers.json`` (crash/failure hooks; idempotent)."""
    return end_recorded_servers(Path(extraction_dir) / "servers.json")


@task(name="connect-servers", cache_policy=NO_CACHE, persist_result=False)
def connect(ext: lib.Extraction, pool: ServerPool) -> run.RunContext:
    return run.connect(ext, pool)


# ------------------------------------------------------------------------------ progress
class ProgressReporter:
    """A Prefect progress artifact for the whole run, updated from prefill callbacks (throttled)."""

    def __init__(self, ext: lib.Extraction, total: int, *, every_s: float = 1.0) -> None:
        self.total, self.every_s, self.base, self._last = max(1, total), every_s, 0, 0.0
        self._lock = threading.Lock()
        self.id: UUID = create_progress_artifact(0.0, key=artifact_key(ext, "progress"),
                                                 description=f"samples answered of {total} (extraction {ext.id})")

    def __call__(self, p: PrefillProgress) -> None:
        now = time.monotonic()
        final = p.done + p.failed == p.total
        with self._lock:
            if now - self._last < self.every_s and not final:
                return
            self._last = now
        self._update(self.base + p.done + p.failed)

    def advance(self, n: int) -> None:
        self.base += n
        self._update(self.base)

    def _update(self, n: int) -> None:
        with contextlib.suppress(Exception):  # progress must never fail the extraction
            update_progress_artifact(self.id, min(100.0, 100.0 * n / self.total))


# ------------------------------------------------------------------------------ batch steps
@task(name="regenerate-batch", cache_policy=NO_CACHE, persist_result=False, retries=2, retry_delay_seconds=10,
      retry_condition_fn=_retry_if_retryable)
def regenerate_batch(ext: lib.Extraction, ctx: run.RunContext, batch: Sequence[Sample]
                     ) -> tuple[list[Sample], lib.Counts]:
    return run.regenerate_batch(ext, ctx, batch)


@task(name="prefill-batch", cache_policy=NO_CACHE, persist_result=False, retries=2, retry_delay_seconds=10,
      retry_condition_fn=_retry_if_retryable)
def prefill_batch(ext: lib.Extraction, ctx: run.RunContext, batch: Sequence[Sample],
                  progress: ProgressReporter | None = None) -> run.PrefillStep:
    return run.prefill_batch(ext, ctx, batch, on_progress=progress)


@task(name="validate-batch", cache_policy=NO_CACHE, persist_result=False, retries=1, retry_delay_seconds=2,
      retry_condition_fn=_retry_if_retryable)
def validate_batch(ext: lib.Extraction, ctx: run.RunContext, samples: Sequence[Sample],
                   allow_requeue: bool = True) -> run.ValidateStep:
    return run.validate_step(ext, ctx, samples, allow_requeue=allow_requeue)


# ------------------------------------------------------------------------------ report
@task(name="extraction-report", cache_policy=NO_CACHE, persist_result=False)
def report(ext: lib.Extraction, prepared: lib.Prepared, counts: lib.Counts, wall_s: float,
           relaunches: int = 0, servers_launched: int = 0) -> dict:
    rep = lib.write_report(ext, prepared, counts, wall_s=wall_s, relaunches=relaunches,
                           servers_launched=servers_launched)
    r = rep["run"]
    rows = [
        ("done (total)", rep["done"]), ("pending", rep["pending"]), ("validated this run", r["validated"]),
        ("skipped", rep["skipped_total"]), ("bad records", rep["bad_records"]), ("invalid", r["invalid"]),
        ("failed", r["failed"]), ("retried requests", r["retries"]), ("re-queued", r["requeued"]),
        ("requests", r["requests"]), ("tokens this run", r["tokens"]), ("tok/s", r["tok_per_s"]),
        ("outliers flagged", r["outliers"]), ("server relaunches", r["relaunches"]),
    ]
    rows += [(f"skipped: {k}", v) for k, v in sorted(rep["skipped"].items())]
    create_table_artifact([{"metric": k, "value": v} for k, v in rows], key=artifact_key(ext, "summary"),
                          description=f"Extraction {ext.id} ({rep['dir']})")
    if rep["problems"]:  # what failed validation or prefill this run, per sample (first 200), with the reason
        create_table_artifact([{k: p.get(k) for k in ("sample_id", "stage", "kind", "message")}
                               for p in rep["problems"][:200]], key=artifact_key(ext, "problems"),
                              description=f"Extraction {ext.id}: samples that failed validation or prefill "
                                          f"({len(rep['problems'])}; quarantined shards keep their reason)")
    return rep
