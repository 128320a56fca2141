"""``eaglenest extract``: run an extraction from the command line (no Prefect), with rich progress.

Thin: options are generated from :class:`~eaglenest.extraction.config.ExtractParams` (or read from
``--params FILE``), then :func:`~eaglenest.extraction.run.run_extraction` runs with progress and a summary.
Exit code 0 when the extraction is complete, 1 when samples remain pending (re-run the same command to
resume), 2 on a user error. SIGTERM is turned into a normal exit so launched servers are stopped.
"""

from __future__ import annotations

import json
import signal
import sys
from typing import Annotated

import typer

from eaglenest.cli.options import model_command
from eaglenest.extraction.config import ExtractParams

app = typer.Typer(add_completion=False, help="Extract hidden states: prompts -> capture servers -> validated shards.")


EXTRACT_FLAGS = {
    "source_format": "--format", "server_urls": "--server-url", "aux_layer_ids": "--aux-layers",
    "sglang_args": "--sglang-arg", "regeneration.enabled": "--regenerate",
    "regeneration.temperature": "--regen-temperature", "regeneration.top_p": "--regen-top-p",
    "regeneration.max_new_tokens": "--regen-max-new-tokens", "regeneration.seed": "--regen-seed",
    "regeneration.cut_answers": "--regen-cut-answers",
    "self_prompts.count": "--self-prompts", "self_prompts.seed": "--self-seed",
    "self_prompts.temperature": "--self-temperature", "self_prompts.top_p": "--self-top-p",
    "self_prompts.max_new_tokens": "--self-max-new-tokens", "self_prompts.starter_sets": "--self-starter-set",
    "self_prompts.exclude_prompt_sets": "--self-exclude-prompt-set", "self_prompts.exclude_file": "--self-exclude-file",
    "eval_capture.prompts": "--eval-prompts", "eval_capture.max_new_tokens": "--eval-max-new-tokens",
    "eval_capture.output_dir": "--eval-output-dir", "eval_capture.extraction_id": "--eval-extraction-id",
}
"""Option names that differ from the field names (shorter, or singular for repeatable options)."""


@app.callback(invoke_without_command=True)
@model_command(ExtractParams, names=EXTRACT_FLAGS)
def extract(
    params: ExtractParams,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Tokenize prompts with the target's chat template, prefill them on capture servers, validate every shard.

    Re-running the same command resumes the same extraction and does only the missing work.
    """
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: launched servers are stopped
    try:
        report = _run(params)
    except KeyboardInterrupt:
        typer.echo("\ninterrupted: what was validated is kept; re-run the same command to resume", err=True)
        raise typer.Exit(130) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    if as_json:
        typer.echo(json.dumps(report, indent=1))
    else:
        _summary(report)
    raise typer.Exit(0 if report["complete"] else 1)


def _run(params) -> dict:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from eaglenest.extraction.run import run_extraction

    columns = (TextColumn("[bold]extract[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
               TimeElapsedColumn())
    console = Console(stderr=True)
    log_every_s = None if console.is_terminal else 15.0  # a log file keeps no progress bar: a line now and then
    logged = [0.0]
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("extract", total=None, info="preparing samples")

        def on_progress(p) -> None:
            r = p.rates
            gen = (f"regen {p.regenerated} ({r.get('generated_tok_per_s', 0):,.0f} gen tok/s)  "
                   if p.generated_tokens or p.regenerated else "")
            info = (f"{gen}captured {p.answered} ({r.get('prefill_tok_per_s', 0):,.0f} tok/s, {p.capturing} waiting)  "
                    f"validated {p.validated} ({r.get('validated_per_s', 0):,.1f}/s)  skipped {p.skipped}  "
                    f"failed {p.failed}" + (f" (to retry {p.retrying})" if p.retrying else ""))
            bar.update(task, total=p.total, completed=p.validated + p.skipped + p.failed, info=info)
            if log_every_s is not None and p.elapsed_s - logged[0] >= log_every_s:
                logged[0] = p.elapsed_s
                console.print(f"extract {p.elapsed_s:,.0f} s: {info}", markup=False, highlight=False)

        def on_stage(name: str, seconds: float) -> None:
            console.print(f"extract: {name} took {seconds:,.1f} s", markup=False, highlight=False)

        return run_extraction(params, on_progress=on_progress, on_stage=on_stage)


def _summary(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    r = report["run"]
    table = Table(title=f"extraction {report['extraction_id']}", show_header=False)
    for k, v in [("folder", report["dir"]), ("status", report["status"]),
                 ("done / samples", f"{report['done']} / {report['samples']}"),
                 ("pending", report["pending"]), ("skipped", report["skipped"] or 0),
                 ("bad records", report["bad_records"]), ("this run: validated", r["validated"]),
                 ("invalid / failed", f"{r['invalid']} / {r['failed']}"),
                 ("requests / retries", f"{r['requests']} / {r['retries']}"),
                 ("tokens / tok/s", f"{r['tokens']:,} / {r['tok_per_s']:,}"),
                 ("generated tokens", f"{r['generated_tokens']:,}"),
                 ("phases (s)", ", ".join(f"{k} {v:g}" for k, v in r["phases_s"].items())),
                 ("rates", ", ".join(f"{k} {v:,}" for k, v in r["rates"].items())),
                 ("bytes done", f"{report['bytes_done']:,}")]:
        table.add_row(k, str(v))
    Console(stderr=True).print(table)
    for p in report["problems"][:10]:
        typer.echo(f"  {p['sample_id']}: {p['stage']} {p['kind']}: {p['message']}", err=True)
