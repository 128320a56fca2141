"""The ``extract`` flow: prompts -> (regenerated) samples -> prefill with capture -> validated ledger.

Composition only: the library's one loop (:func:`eaglenest.extraction.run.run_extraction`) runs with
:func:`tasks.extract.step`, which makes each of its steps a Prefect task. The parameter is
:class:`eaglenest.extraction.config.ExtractParams` (rendered as a form in the UI). Re-running with the
same parameters resumes the same extraction and does only the missing work (zero requests and no
server launched when it is complete). The run ends Failed when samples remain pending after it
(failed requests or invalid shards: see report.json), so a Retry from the UI resumes it.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger
from prefect.task_runners import ThreadPoolTaskRunner

from eaglenest.extraction.config import ExtractParams
from eaglenest.extraction.run import run_extraction
from flows import allow_slow_first_start
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
    ext_id = params.resolved_extraction_id()
    rep = run_extraction(params, step=t.step, on_progress=t.ProgressReporter(ext_id))
    t.publish_report(rep)
    r = rep["run"]
    logger.info("extraction %s: %d of %d samples done; this run %d validated, phases %s, rates %s", ext_id,
                rep["done"], rep["samples"], r["validated"], r["phases_s"], r["rates"])
    store = store_step(Path(rep["dir"]), rep, params)
    if store is not None:
        rep = {**rep, "store": store}
    if rep["pending"]:
        raise ExtractionIncomplete(
            f"extraction {ext_id}: {rep['pending']} samples still pending ({r['failed']} failed, "
            f"{r['invalid']} invalid this run; reasons in {Path(rep['dir']) / 'report.json'}); re-run to resume")
    return rep


if __name__ == "__main__":
    allow_slow_first_start()
    extract()
