"""Command line for the drafter: ``eaglenest train ...``, ``export ...``, ``trim-vocab ...`` and ``average ...``.

Thin: options are generated from :class:`~eaglenest.drafter.config.TrainConfig` (or read from
``--params FILE``; ``--set FIELD=VALUE`` sets any field too), then the library trains.
Multi-process: ``torchrun --nproc-per-node N -m eaglenest train ...`` (DDP; gloo on CPU, nccl on GPU).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from eaglenest.cli.errors import UsageError, one_line
from eaglenest.cli.options import model_command
from eaglenest.drafter.config import TrainConfig

app = typer.Typer(no_args_is_help=True)


class ExportFormat(StrEnum):
    sglang = "sglang"
    speculators = "speculators"


def _overrides(rest: dict) -> dict:
    """``--set FIELD=VALUE`` (VALUE read as JSON when it parses, else as a string)."""
    out = {}
    for pair in rest.pop("set_") or []:
        key, sep, value = pair.partition("=")
        if not sep:
            raise UsageError(f"--set expects FIELD=VALUE, got {pair!r}")
        if key.strip() not in TrainConfig.model_fields:
            raise UsageError(f"--set {pair}: {key.strip()!r} is not a TrainConfig field (known: "
                             f"{', '.join(TrainConfig.model_fields)})")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


@app.command("train")
@model_command(TrainConfig, names={"out_dir": "--out", "draft_vocab_size": "--draft-vocab", "eval_sets": "--eval-set"},
               extra=_overrides)
def train_command(
    params: TrainConfig,
    set_: Annotated[list[str] | None, typer.Option("--set", help="a TrainConfig field as FIELD=VALUE")] = None,
) -> None:
    """Train an EAGLE-3 drafter on a store (resumes the run in --out if it has checkpoints)."""
    from eaglenest.drafter.train import train

    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    result = train(params)
    if rank == 0:
        summary = {k: v for k, v in result.to_dict().items() if k != "history"}
        typer.echo(json.dumps(summary, indent=1))
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        _exit_worker()


def _exit_worker() -> None:
    """End a torchrun worker whose run is complete (checkpoint, result and logs written) without the
    interpreter's C++ teardown: a rank that finished before its peer aborted there after its last Python line
    ('terminate called without an active exception', no Python frame; 1 resume in 40-60 here, twice in CI, with the
    process group already destroyed), and torchrun then failed the whole run."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


@app.command("export")
@one_line
def export_command(
    run: Annotated[Path, typer.Argument(help="run folder (its latest checkpoint) or a checkpoint folder")],
    out: Annotated[Path, typer.Argument(help="export folder to create")],
    format: Annotated[ExportFormat, typer.Option(help="sglang | speculators (vLLM)")] = ExportFormat.sglang,
    dtype: Annotated[str, typer.Option(help="weight dtype")] = "bfloat16",
    speculative_tokens: Annotated[int, typer.Option(help="speculators: proposal length")] = 3,
    target: Annotated[str | None, typer.Option(help="check the export against this target folder")] = None,
    overwrite: Annotated[bool, typer.Option(help="replace an existing export")] = False,
) -> None:
    """Export a trained drafter for SGLang (EAGLE3) or vLLM (speculators)."""
    from eaglenest.drafter.export import export_drafter, load_drafter
    from eaglenest.models import resolve_model

    path = export_drafter(run, out, fmt=format.value, dtype=dtype, speculative_tokens=speculative_tokens,
                          overwrite=overwrite)
    if target is not None:
        load_drafter(path, target_dir=resolve_model(target))
    typer.echo(str(path))


@app.command("trim-vocab")
@one_line
def trim_vocab_command(
    src: Annotated[Path, typer.Argument(help="an eaglenest export (sglang or speculators)")],
    out: Annotated[Path, typer.Argument(help="export folder to create")],
    size: Annotated[int, typer.Option(help="draft tokens to keep (fewer than the export has)")],
    counts_from: Annotated[str, typer.Option(help="what the drafter was trained on: a store URL or extraction "
                                                  "folder, or the target's answers (a JSON-lines file of output_ids)")],
    overwrite: Annotated[bool, typer.Option(help="replace an existing export")] = False,
) -> None:
    """Cut a drafter's draft vocabulary (its LM head) to the SIZE tokens most frequent in its training data: a
    cheaper draft step where the head's weights dominate (the embedded CPU decoder)."""
    from eaglenest.drafter.trim import trim_export

    report = trim_export(src, out, size=size, counts=counts_from, overwrite=overwrite)
    typer.echo(json.dumps(report.to_dict(), indent=1))


@app.command("average")
@one_line
def average_command(
    srcs: Annotated[list[Path], typer.Argument(help="two eaglenest exports or more, of one lineage (a drafter and "
                                                    "its continuations)")],
    out: Annotated[Path, typer.Option(help="export folder to create")],
    weight: Annotated[list[float] | None, typer.Option(help="one per export, in order (default: equal)")] = None,
    overwrite: Annotated[bool, typer.Option(help="replace an existing export")] = False,
) -> None:
    """Average drafters' weights into one export (a model soup): a drafter and its continuation on new data can
    generalize better averaged than either alone. Measure it (`eaglenest bench offline`) before serving it."""
    from eaglenest.drafter.average import average_exports

    typer.echo(str(average_exports(srcs, out, weights=weight or None, overwrite=overwrite)))
