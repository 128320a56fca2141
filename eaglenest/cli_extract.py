"""``eaglenest extract``: run an extraction from the command line (no Prefect), with rich progress.

Thin: parses options into :class:`~eaglenest.extraction.config.ExtractParams`, calls
:func:`~eaglenest.extraction.run.run_extraction`, shows progress and the summary. Exit code 0 when the
extraction is complete, 1 when samples remain pending (re-run the same command to resume), 2 on a
bad option. SIGTERM is turned into a normal exit so launched servers are stopped.
"""

from __future__ import annotations

import json
import signal
import sys
from typing import Annotated

import typer

app = typer.Typer(add_completion=False, help="Extract hidden states: prompts -> capture servers -> validated shards.")


def parse_ids(text: str | None) -> list[int] | None:
    """``--aux-layers 1,14,26`` -> [1, 14, 26] (None when empty); a bad list is a typer error naming it."""
    if not text:
        return None
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}") from None


@app.callback(invoke_without_command=True)
def extract(
    source: Annotated[str, typer.Option(help="'sharegpt' (built-in) or an fsspec URL of JSONL/Parquet/JSON")] = (
        "sharegpt"),
    source_format: Annotated[str, typer.Option("--format", help="auto | jsonl | json | parquet")] = "auto",
    recipe: Annotated[str, typer.Option(help=(
        "training data: regenerate (the target answers every turn in context; default) | capture (the "
        "source's given answers)"))] = "regenerate",
    limit: Annotated[int, typer.Option(help="most records read from the source (0 = all)")] = 1000,
    max_turns: Annotated[int | None, typer.Option(help="keep the first N assistant turns (0 = all; default: "
                                                       "the recipe's)")] = None,
    model: Annotated[str, typer.Option(help="'default' (SmolLM2-135M-Instruct) or a local HF folder")] = "default",
    engine: Annotated[str, typer.Option(help="embedded | sglang")] = "embedded",
    server_url: Annotated[list[str] | None, typer.Option(help="use this running server (repeatable)")] = None,
    num_servers: Annotated[int, typer.Option(help="servers to launch when no --server-url")] = 1,
    aux_layers: Annotated[str | None, typer.Option(help="aux layer ids, e.g. 1,14,26")] = None,
    dtype: Annotated[str, typer.Option(help="auto | bfloat16 | float16 | float32 (launched embedded)")] = "auto",
    batch_size: Annotated[int, typer.Option(help="most samples per validation chunk")] = 128,
    concurrency: Annotated[int, typer.Option(help=(
        "requests in flight per server; a GPU server needs 512-1024 to keep its decode batch full"))] = 8,
    max_tokens: Annotated[int | None, typer.Option(help=(
        "token cap per sample, longer ones skipped (0 = context length; default: the recipe's)"))] = None,
    regenerate: Annotated[bool | None, typer.Option(help=(
        "let the target answer every turn (default: the recipe's; --no-regenerate = capture given answers)"))] = None,
    regen_temperature: Annotated[float | None, typer.Option(help="regeneration temperature (0 = greedy)")] = None,
    regen_seed: Annotated[int | None, typer.Option(help="base seed of sampled regeneration")] = None,
    regen_max_new_tokens: Annotated[int | None, typer.Option(help="most tokens per regenerated answer")] = None,
    extraction_id: Annotated[str | None, typer.Option(help="folder name (default: hash of the request)")] = None,
    output_dir: Annotated[str, typer.Option(help="where <extraction_id>/ lives")] = "runs/extractions",
    request_timeout_s: Annotated[float, typer.Option(help="per-request timeout")] = 600.0,
    sglang_arg: Annotated[list[str] | None, typer.Option(help="extra sglang.launch_server argument (repeatable)")] = (
        None),
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Tokenize prompts with the target's chat template, prefill them on capture servers, validate every shard.

    Re-running the same command resumes the same extraction and does only the missing work.
    """
    from pydantic import ValidationError

    from eaglenest.extraction.config import ExtractParams
    from eaglenest.extraction.state import ExtractionError

    regen = {k: v for k, v in (("enabled", regenerate), ("temperature", regen_temperature), ("seed", regen_seed),
                               ("max_new_tokens", regen_max_new_tokens)) if v is not None}
    given = {k: (v or None) for k, v in (("max_turns", max_turns), ("max_tokens", max_tokens)) if v is not None}
    try:
        params = ExtractParams(
            recipe=recipe, source=source, source_format=source_format, limit=limit or None,
            model=model, engine=engine, server_urls=server_url or [], num_servers=num_servers,
            aux_layer_ids=parse_ids(aux_layers), dtype=dtype, batch_size=batch_size, concurrency=concurrency,
            extraction_id=extraction_id, output_dir=output_dir, request_timeout_s=request_timeout_s,
            sglang_args=sglang_arg or [], **given, **({"regeneration": regen} if regen else {}),
        )
    except ValidationError as e:
        raise typer.BadParameter(str(e)) from None
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: launched servers are stopped
    try:
        report = _run(params)
    except ExtractionError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
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
    with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task("extract", total=None, info="preparing samples")

        def on_progress(p) -> None:
            r = p.rates
            gen = (f"regen {p.regenerated} ({r.get('generated_tok_per_s', 0):,.0f} gen tok/s)  "
                   if p.generated_tokens or p.regenerated else "")
            info = (f"{gen}captured {p.answered} ({r.get('prefill_tok_per_s', 0):,.0f} tok/s)  "
                    f"validated {p.validated} ({r.get('validated_per_s', 0):,.1f}/s)  skipped {p.skipped}  "
                    f"failed {p.failed}")
            bar.update(task, total=p.total, completed=p.validated + p.skipped + p.failed, info=info)

        return run_extraction(params, on_progress=on_progress)


def _summary(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    r = report["run"]
    table = Table(title=f"extraction {report['extraction_id']}", show_header=False)
    for k, v in [("folder", report["dir"]), ("done / samples", f"{report['done']} / {report['samples']}"),
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
