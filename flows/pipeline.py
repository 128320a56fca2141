"""The ``pipeline`` flow: extract -> convert -> train -> export -> bench, and its fan-out over nodes.

Composition only: the stages are the ``extract`` and ``bench`` flows (as subflows, so each shows in the
UI with its own artifacts) and the store / train tasks; :class:`eaglenest.pipeline.StageBook` skips a
stage whose output for the same inputs exists and validates, so a re-run of a finished pipeline does no
engine work, and a Retry of a failed one resumes at the failed stage (which resumes its own work: the
extraction's ledger, the trainer's checkpoints).

``pipeline-fanout`` splits the extraction over N nodes: one ``extract`` deployment run per part
(``run_deployment``; each node launches its own servers), then converts every part into one store
version and trains / exports / benchmarks here. The parts' extraction folders must be readable from
where this flow runs (a shared mount such as NFS / Lustre / a bucket fuse mount).

``python -m flows.pipeline --demo`` runs the whole pipeline on the embedded default (``make demo``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from pydantic import BaseModel, ConfigDict, Field

from eaglenest.cli import errors
from eaglenest.extraction.config import ExtractParams
from eaglenest.forms import show_bounds
from eaglenest.packaged_data import sha256_file
from eaglenest.pipeline import (
    CPU_DEMO_NOTE,
    BenchOutput,
    ConvertOutput,
    ExportOutput,
    ExtractOutput,
    PipelineParams,
    PipelinePlan,
    PipelineSummary,
    Stage,
    StageBook,
    StageOutput,
    TrainOutput,
    bench_key,
    digest,
    extraction_key,
    fresh_run_tag,
    latest_checkpoint_sha,
    ledger_key,
    train_key,
)
from flows import allow_slow_first_start
from flows.bench import bench
from flows.extract import extract
from tasks.store import convert_or_cached
from tasks.train import export_or_cached, train_or_cached, training_report


def _run_tag() -> str | None:
    """This flow run's extraction id: its id and CREATION time (a Retry reschedules the run, so its scheduled
    start moves; the id and creation time do not, and the retry resumes the same extraction)."""
    from prefect.client.orchestration import get_client

    rid = flow_run.id
    if not rid:
        return None
    with get_client(sync_client=True) as client:
        created = client.read_flow_run(rid).created
    return fresh_run_tag(str(rid), created)


def _staged(book: StageBook, stage: Stage, key: str, log, why_skip: str, compute: Callable[[], StageOutput]):
    """The stage's recorded output when it was computed for ``key`` and still validates; else compute it,
    record it under ``key`` and return it. ``skipped`` says which; ``seconds`` how long this took."""
    t0 = time.perf_counter()
    if (out := book.done(stage, key)) is not None:
        log.info("%s: skipped (%s)", stage, why_skip)
        skipped = True
    else:
        out, skipped = compute(), False
        book.record(stage, key, out)
    return out.model_copy(update={"skipped": skipped, "seconds": round(time.perf_counter() - t0, 1)})


def _extract_stage(plan: PipelinePlan, book: StageBook, log) -> ExtractOutput:
    def compute() -> ExtractOutput:
        rep = extract(plan.extract)
        return ExtractOutput(dir=rep["dir"], done=rep["done"], tokens=rep["tokens_done"], run=rep["run"],
                             records=plan.extract.limit, skipped_samples=rep.get("skipped") or {},
                             bad_records=rep.get("bad_records", 0))

    return _staged(book, "extract", extraction_key(plan), log,
                   f"extraction {plan.extract.resolved_extraction_id()} is complete", compute)


def _convert_stage(plan: PipelinePlan, extraction_dirs: list[str], book: StageBook, log) -> ConvertOutput:
    def compute() -> ConvertOutput:
        summary: dict = {}
        for i, d in enumerate(extraction_dirs):  # parts of a fan-out are appended into one version each
            summary = convert_or_cached(d, plan.store_url, plan.store_target_file_mb << 20, append=i > 0)
        return ConvertOutput(url=plan.store_url, samples=summary["samples"], version=summary["version"],
                             tokens=summary["tokens"], bytes=summary["store_bytes"])

    key = digest([ledger_key(Path(d), plan.store_url, plan.store_target_file_mb) for d in extraction_dirs])
    return _staged(book, "convert", key, log, f"store {plan.store_url} holds the same samples", compute)


def _train_stage(plan: PipelinePlan, book: StageBook, log) -> TrainOutput:
    def compute() -> TrainOutput:
        result = train_or_cached(plan.train)
        png = training_report(plan.train.out_dir, result)
        evaluation = result["eval"] or {}
        return TrainOutput(run_dir=plan.train.out_dir, status=result["status"], step=result["step"],
                           train_tokens=result["train_tokens"], tokens_per_s=result["tokens_per_s"],
                           accept_length=evaluation.get("accept_length"), loss_curve=png,
                           checkpoint_sha256=latest_checkpoint_sha(plan.train.out_dir))

    return _staged(book, "train", train_key(plan.train), log,
                   f"{plan.train.out_dir} already trained on this store", compute)


def _export_stage(plan: PipelinePlan, book: StageBook, log) -> ExportOutput:
    def compute() -> ExportOutput:
        files = {}
        for fmt, d in plan.export_dirs.items():
            folder = export_or_cached(plan.train.out_dir, d, fmt, plan.export_dtype, plan.bench.chain_depth)
            files[folder] = sha256_file(Path(folder) / "model.safetensors")
        return ExportOutput(dirs=plan.export_dirs, files=files)

    key = digest({"ckpt": latest_checkpoint_sha(plan.train.out_dir), "dirs": plan.export_dirs,
                      "dtype": plan.export_dtype, "steps": plan.bench.chain_depth})
    return _staged(book, "export", key, log, f"{', '.join(plan.export_dirs.values())} up to date", compute)


def _bench_stage(plan: PipelinePlan, book: StageBook, log) -> BenchOutput:
    def compute() -> BenchOutput:
        res = bench(plan.bench)  # raises GateFailed (run Failed) after writing the report when the gate fails
        return BenchOutput(output_dir=plan.bench.output_dir, speedups=res["speedups"],
                           accept_length=res["accept_length"], gate=res["gate"])

    return _staged(book, "bench", bench_key(plan.bench), log,
                   f"report for this drafter and config in {plan.bench.output_dir}", compute)


def _after_extraction(plan: PipelinePlan, extraction_dirs: list[str], book: StageBook, log,
                      summary: PipelineSummary) -> dict:
    steps = [("convert", lambda: _convert_stage(plan, extraction_dirs, book, log)),
             ("train", lambda: _train_stage(plan, book, log)),
             ("export", lambda: _export_stage(plan, book, log)),
             ("bench", lambda: _bench_stage(plan, book, log))]
    for name, run in steps:
        if name not in plan.stages:
            break
        setattr(summary, name, run())
    result = summary.to_json()
    (plan.run_dir / "pipeline.json").write_text(json.dumps(result, indent=1))
    return result


@flow(name="pipeline", validate_parameters=True, log_prints=True)
def pipeline(params: PipelineParams = PipelineParams()) -> dict:
    """extract -> convert -> train -> export -> bench; stages already done for the same inputs are skipped."""
    log = get_run_logger()
    plan = params.plan(_run_tag() if params.fresh_extraction_id else None)
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    book = StageBook(plan.run_dir)
    extracted = _extract_stage(plan, book, log)
    summary = PipelineSummary(run_dir=str(plan.run_dir), extraction_id=plan.extract.resolved_extraction_id(),
                              extract=extracted)
    return _after_extraction(plan, [extracted.dir], book, log, summary)


class FanoutParams(BaseModel):
    """The pipeline with its extraction split over several nodes (each runs the ``extract`` deployment)."""

    model_config = ConfigDict(json_schema_extra=show_bounds)

    pipeline: PipelineParams = Field(default_factory=PipelineParams, description=(
        "The pipeline; extract.output_dir must be a folder every node and this flow can read (shared mount)."))
    nodes: int = Field(2, ge=1, le=256, description="Parts of the extraction, one extract run per part.")
    extract_deployment: str = Field("extract/extract-gpu-process", description=(
        "Deployment (flow/deployment name) that runs one part; its work pool decides where the parts run."))
    part_timeout_s: float | None = Field(None, gt=0, description="Give up waiting for a part after this long.")


@flow(name="pipeline-fanout", validate_parameters=True, log_prints=True)
def pipeline_fanout(params: FanoutParams = FanoutParams()) -> dict:
    """Partition extraction over N nodes with run_deployment, then convert all parts, train, export, bench."""
    from prefect.deployments import run_deployment

    log = get_run_logger()
    plan = params.pipeline.plan(_run_tag() if params.pipeline.fresh_extraction_id else None)
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    book = StageBook(plan.run_dir)
    base = plan.extract.resolved_extraction_id()
    parts = [ExtractParams.model_validate({**plan.extract.model_dump(), "partition_index": i,
                                           "partition_count": params.nodes,
                                           "extraction_id": f"{base}-p{i}of{params.nodes}"})
             for i in range(params.nodes)]

    def one(part: ExtractParams):
        return run_deployment(params.extract_deployment, parameters={"params": part.model_dump(mode="json")},
                              timeout=params.part_timeout_s, as_subflow=True,
                              flow_run_name=f"{base}-part-{part.partition_index}")

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=min(params.nodes, 32)) as pool:
        runs = list(pool.map(one, parts))
    failed = [(p.partition_index, r.state.type.value if r.state else "unknown")
              for p, r in zip(parts, runs, strict=True) if not (r.state and r.state.is_completed())]
    if failed:
        raise RuntimeError(f"extraction parts did not complete: {failed} (part, state); retry this run to resume "
                           "them (each part resumes its own ledger)")
    dirs = [str(Path(p.output_path).expanduser().resolve() / p.resolved_extraction_id()) for p in parts]
    fanned_out = {"seconds": round(time.perf_counter() - t0, 1), "runs": [str(r.id) for r in runs]}
    summary = PipelineSummary(run_dir=str(plan.run_dir), extraction_id=base, parts=dirs, extract=fanned_out)
    log.info("all %d parts complete; converting into %s", params.nodes, plan.store_url)
    return _after_extraction(plan, dirs, book, log, summary)


# ------------------------------------------------------------------------------ make demo
DEMO_PROMPTS = 40
DEMO_TRAIN_STEPS = 96
"""The demo's training is fixed work (sizes and steps), so a busy machine runs the same drafter, only slower."""


def demo_params(out: str = "runs/demo", prompts: int = DEMO_PROMPTS) -> PipelineParams:
    """The whole pipeline on the embedded default (SmolLM2-135M-Instruct, real ShareGPT) sized for 2 CPU cores.

    The data is the default recipe (the target answers the prompts itself) at its small size: first turns
    only, answers of at most 96 tokens (a longer answer is cut and its sample skipped), 384 tokens a sample:
    the CPU decodes one answer at a time at a few dozen tokens per second. Training is fixed work (sizes and
    steps; the training stage's time budget stays a far-off safety stop)."""
    return PipelineParams.model_validate({
        "run_dir": out,
        "extract": {"recipe": "regenerate", "source": "sharegpt", "limit": prompts, "max_turns": 1,
                    "max_tokens": 384, "regeneration": {"max_new_tokens": 96}, "batch_size": 16,
                    "concurrency": 4, "embedded_max_batch_size": 4, "extraction_id": f"demo-{prompts}"},
        "train": {"max_tokens": 2048, "max_seq_len": 384, "max_steps": DEMO_TRAIN_STEPS, "ttt_steps": 3,
                  "draft_vocab_size": 4096, "eval_every": 0, "save_every": 50, "eval_max_samples": 6,
                  "eval_fraction": 0.1, "lr": 2e-3, "init": "target"},
        "export_formats": ["sglang"],
        "bench": {"num_prompts": 6, "max_new_tokens": 48, "concurrencies": [1], "target_concurrency": 1,
                  "min_speedup": 0.0},
    })


def _headline(summary: PipelineSummary) -> str:
    def took(stage: StageOutput) -> str:
        return "skipped: done before" if stage.skipped else f"{stage.seconds} s"

    lines = [f"run folder:  {summary.run_dir}"]
    if isinstance(ex := summary.extract, ExtractOutput):
        lines.append(f"extraction:  {ex.dir} ({took(ex)}): {samples_line(ex)}")
    if st := summary.convert:
        lines.append(f"store:       {st.url} (version {st.version}, {st.samples} samples, {took(st)})")
    if tr := summary.train:
        drafter = summary.export.dirs if summary.export else None
        lines.append(f"drafter:     {drafter} (trained {tr.step} steps, {took(tr)}; held-out accept length "
                     f"{tr.accept_length or {}})")
        if tr.status == "time_budget":
            lines.append("training:    stopped by its time budget (a safety stop) before the schedule finished")
    if be := summary.bench:
        lines.append(f"bench:       {be.output_dir}/report.md  speedups {be.speedups}  "
                     f"accept length {be.accept_length}")
    lines.append(f"note:        {CPU_DEMO_NOTE}")
    return "\n".join(lines)


def samples_line(ex: ExtractOutput) -> str:
    """'128 prompts read -> 67 samples (61 skipped: 58 too_long, 3 template; 0 bad records)'."""
    skipped = ex.skipped_samples
    why = ", ".join(f"{n} {k}" for k, n in sorted(skipped.items(), key=lambda kv: -kv[1]))
    head = f"{ex.records} prompts read -> " if ex.records else ""
    detail = f"{sum(skipped.values())} skipped: {why}; " if skipped else ""
    return f"{head}{ex.done} samples ({detail}{ex.bad_records} bad records)"


def _params(a: argparse.Namespace) -> PipelineParams:
    """``--params``: inline JSON, or a JSON file; neither given (and no --demo) is a usage error too."""
    if not a.params:
        raise errors.UsageError("give --demo or --params FILE")
    text = a.params.strip()
    if not text.startswith("{"):
        path = Path(a.params)
        if not path.is_file():
            raise errors.UsageError(f"--params {a.params}: no such file (give a PipelineParams JSON file, or the "
                                    "JSON itself)")
        text = path.read_text()
    return PipelineParams.model_validate_json(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demo", action="store_true", help="the embedded default at demo size (make demo)")
    ap.add_argument("--out", default="runs/demo", help="run folder for --demo")
    ap.add_argument("--prompts", type=int, default=DEMO_PROMPTS, help="ShareGPT prompts for --demo")
    ap.add_argument("--params", help="PipelineParams as JSON (a file path or the JSON itself)")
    ap.add_argument("--debug", action="store_true", help="print the traceback of any error")
    a = ap.parse_args(argv)
    allow_slow_first_start()
    try:
        t0 = time.perf_counter()
        summary = pipeline(_params(a) if a.params or not a.demo else demo_params(a.out, a.prompts))
    except Exception as e:
        code = errors.report(e, debug=errors.debug_requested(["--debug"] if a.debug else []), prog="flows.pipeline")
        if code is None:
            raise
        return code
    print("\n== eaglenest pipeline done in %.0f s" % (time.perf_counter() - t0))
    print(_headline(PipelineSummary.model_validate(summary)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
