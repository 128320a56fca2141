"""The ``extract`` flow: prompts -> tokenized samples -> batched prefill on capture servers -> validated ledger.

Composition only (every step is a task in ``tasks/extract.py`` over the library). The parameter is
:class:`eaglenest.extraction.config.ExtractParams` (rendered as a form in the UI). Re-running with the
same parameters resumes the same extraction and does only the missing work (zero requests and no
server launched when it is complete). The run ends Failed when samples remain pending after it
(failed requests or invalid shards: see report.json), so a Retry from the UI resumes it.
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.task_runners import ThreadPoolTaskRunner

from eaglenest.extraction.config import ExtractParams
from eaglenest.extraction.state import Counts
from tasks import extract as t
from tasks.store import convert_or_cached


class ExtractionIncomplete(RuntimeError):
    """Samples remain pending after the run; re-run (or Retry) to resume."""


def _teardown(flow_obj, flow_run, state) -> None:
    """on_failure / on_crashed: end the process groups of servers this run launched (idempotent)."""
    raw = (flow_run.parameters or {}).get("params") or {}
    params = raw if isinstance(raw, ExtractParams) else ExtractParams.model_validate(raw)
    t.teardown_servers(Path(params.output_path).expanduser().resolve() / params.resolved_extraction_id())


def store_step(extraction_dir: Path, report: dict, params: ExtractParams) -> dict | None:
    """Last step: the ledger's validated shards -> a version of the Arrow-indexed store at ``store_url``.

    Runs only for a complete extraction (nothing pending), so a store never holds a partial run; the task
    is cached on the ledger's content, so a re-run of a complete flow converts nothing again."""
    if not params.store_url or report["pending"]:
        return None
    return convert_or_cached(str(extraction_dir), params.store_url, params.store_target_file_mb << 20)


@flow(name="extract", on_failure=[_teardown], on_crashed=[_teardown],
      task_runner=ThreadPoolTaskRunner(max_workers=2), validate_parameters=True)
def extract(params: ExtractParams = ExtractParams()) -> dict:
    logger = get_run_logger()
    t0 = time.perf_counter()
    ext = t.open_extraction(params)
    t.prepare.with_options(result_storage=t.results_storage(ext))(ext)
    prepared, batches = t.plan(ext)
    counts, relaunches, launched = Counts(), 0, 0
    logger.info("extraction %s: %d samples, %d pending in %d batches", ext.id, len(prepared.samples),
                sum(map(len, batches)), len(batches))
    if batches:
        progress = t.ProgressReporter(ext, sum(map(len, batches)))
        with t.serving(ext) as pool:
            ctx = t.connect(ext, pool)
            requeue, running = [], None
            for batch in batches:
                if params.regeneration.enabled:
                    batch, c = t.regenerate_batch(ext, ctx, batch)
                    counts.add(c)
                step = t.prefill_batch(ext, ctx, batch, progress)
                counts.add(step.counts)
                if running is not None:  # validate batch i while batch i + 1 was prefilled
                    v = running.result()
                    counts.add(v.counts)
                    requeue += v.requeue
                running = t.validate_batch.submit(ext, ctx, step.to_validate)
                progress.advance(len(batch))
            if running is not None:
                v = running.result()
                counts.add(v.counts)
                requeue += v.requeue
            if requeue:
                step = t.prefill_batch(ext, ctx, requeue)
                counts.add(step.counts)
                counts.add(t.validate_batch(ext, ctx, step.to_validate, allow_requeue=False).counts)
            relaunches, launched = pool.relaunches, pool.launched
    rep = t.report(ext, prepared, counts, time.perf_counter() - t0, relaunches, launched)
    store = store_step(ext.dir, rep, params)
    if store is not None:
        rep = {**rep, "store": store}
    if rep["pending"]:
        raise ExtractionIncomplete(
            f"extraction {ext.id}: {rep['pending']} samples still pending ({rep['run']['failed']} failed, "
            f"{rep['run']['invalid']} invalid this run; reasons in {ext.dir / 'report.json'}); re-run to resume")
    return rep


if __name__ == "__main__":
    extract()
