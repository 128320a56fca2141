"""Prefect tasks for extraction: the step wrapper that makes each call of the library's one loop a task.

:func:`eaglenest.extraction.run.run_extraction` owns the loop; the flow passes :func:`step`, which runs
each of its calls as a Prefect task (named after the step, with the retries Prefect is for), plus the
progress artifact and the report's tables.

- Nothing is cached by Prefect: ``prepare`` reuses ``samples.parquet`` by its content key (it is its own
  cache), and the ledger (content-verified shards) plus the persisted answers are the idempotency record
  of the engine work. A sample in the ledger is never planned again, a present shard is validated
  instead of re-requested, a persisted answer is never asked for again, and a quarantined shard is
  requested again; a Prefect cache keyed on the inputs would skip that last case.
- Launching servers is retried once when the server was merely slow to start; the servers' process
  groups are stopped on every exit path by the loop, and the flow's on_failure/on_crashed hooks call
  :func:`teardown_servers` as a second line.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect import task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE

from eaglenest.engines.pool import LaunchError, end_recorded_servers
from eaglenest.extraction.run import Progress


def artifact_key(extraction_id: str, what: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", f"extract-{what}-{extraction_id}".lower()).strip("-")[:100]


def _launch_retryable(task, task_run, state) -> bool:
    try:
        state.result()
    except LaunchError as e:  # a port race or a slow first start; a bad command fails again fast
        return "not ready after" in str(e)
    except Exception:
        return False
    return False


_OPTIONS: dict[str, dict[str, Any]] = {
    "start_servers": {"name": "launch-servers", "retries": 1, "retry_delay_seconds": 5,
                      "retry_condition_fn": _launch_retryable},
    "open_extraction": {"name": "open-extraction"},
    "prepare": {"name": "prepare-samples"},
    "plan": {"name": "plan-samples"},
    "connect": {"name": "connect-servers"},
    "stream": {"name": "regenerate-capture-validate"},
    "stop_servers": {"name": "stop-servers"},
    "write_report": {"name": "extraction-report"},
    "capture_eval_prompts": {"name": "eval-capture"},
}
_tasks: dict[Callable[..., Any], Any] = {}
_tasks_lock = threading.Lock()


def step(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run one step of the extraction loop as a Prefect task (the loop's ``step`` wrapper)."""
    with _tasks_lock:
        tk = _tasks.get(fn)
        if tk is None:
            options = {"name": fn.__name__.replace("_", "-"), **_OPTIONS.get(fn.__name__, {})}
            tk = _tasks[fn] = task(fn, cache_policy=NO_CACHE, persist_result=False, **options)
    return tk(*args, **kwargs)


def teardown_servers(extraction_dir: str | Path) -> int:
    """End every server group recorded in ``servers.json`` (crash/failure hooks; idempotent)."""
    return end_recorded_servers(Path(extraction_dir) / "servers.json")


# ------------------------------------------------------------------------------ progress
def _rates_text(p: Progress) -> str:
    r = p.rates
    return (f"validated {p.validated} of {p.total} (done before this run: {p.done_before}); "
            f"regenerated {p.regenerated} ({p.generated_tokens:,} tokens, {r.get('generated_tok_per_s', 0):,.0f} "
            f"tok/s); captured {p.answered} ({p.tokens:,} tokens, {r.get('prefill_tok_per_s', 0):,.0f} tok/s, "
            f"{p.capturing} waiting); "
            f"validating {r.get('validated_per_s', 0):,.1f}/s; skipped {p.skipped}; failed {p.failed}; "
            f"{p.elapsed_s:,.0f} s")


class ProgressReporter:
    """A Prefect progress artifact for the run (validated share of the extraction) and a markdown artifact
    with each phase's count and rate, both updated from the loop's progress (throttled)."""

    def __init__(self, extraction_id: str, *, every_s: float = 2.0, rates_every_s: float = 15.0) -> None:
        self.extraction_id, self.every_s, self._last = extraction_id, every_s, 0.0
        self.rates_every_s, self._last_rates = rates_every_s, 0.0  # each markdown update is a new version
        self._lock = threading.Lock()
        self.id: UUID | None = None

    def __call__(self, p: Progress) -> None:
        now = time.monotonic()
        settled = p.validated + p.failed + p.skipped
        final = settled >= p.total
        with self._lock:
            if now - self._last < self.every_s and not final:
                return
            self._last = now
        with contextlib.suppress(Exception):  # progress must never fail the extraction
            share = min(100.0, 100.0 * settled / max(1, p.total))
            if self.id is None:
                self.id = create_progress_artifact(share, key=artifact_key(self.extraction_id, "progress"),
                                                   description=f"samples validated, skipped or failed "
                                                               f"(extraction {self.extraction_id})")
            else:
                update_progress_artifact(self.id, share)
            if final or now - self._last_rates >= self.rates_every_s:
                self._last_rates = now
                create_markdown_artifact(_rates_text(p), key=artifact_key(self.extraction_id, "rates"),
                                         description="extraction phases: counts and rates so far")


# ------------------------------------------------------------------------------ report
def publish_report(rep: dict) -> None:
    """The report's summary, phase times and rates, and the per-sample problems as table artifacts."""
    r, ext_id = rep["run"], rep["extraction_id"]
    rows = [
        ("status", rep["status"]), ("done (total)", rep["done"]), ("pending", rep["pending"]),
        ("validated this run", r["validated"]),
        ("skipped", rep["skipped_total"]), ("bad records", rep["bad_records"]), ("invalid", r["invalid"]),
        ("failed", r["failed"]), ("retried requests", r["retries"]), ("re-queued", r["requeued"]),
        ("requests", r["requests"]), ("tokens this run", r["tokens"]), ("tok/s", r["tok_per_s"]),
        ("regenerated", r["regenerated"]), ("generated tokens", r["generated_tokens"]),
        ("outliers flagged", r["outliers"]), ("server relaunches", r["relaunches"]),
    ]
    rows += [(f"phase seconds: {k}", v) for k, v in r["phases_s"].items()]
    rows += [(f"rate: {k}", v) for k, v in r["rates"].items()]
    rows += [(f"skipped: {k}", v) for k, v in sorted(rep["skipped"].items())]
    create_table_artifact([{"metric": k, "value": v} for k, v in rows], key=artifact_key(ext_id, "summary"),
                          description=f"Extraction {ext_id} ({rep['dir']})")
    if rep["problems"]:  # what was skipped or failed this run, per sample (first 200), with the reason
        create_table_artifact([{k: p.get(k) for k in ("sample_id", "stage", "kind", "message")}
                               for p in rep["problems"][:200]], key=artifact_key(ext_id, "problems"),
                              description=f"Extraction {ext_id}: samples skipped or failed this run "
                                          f"({len(rep['problems'])}; quarantined shards keep their reason)")
