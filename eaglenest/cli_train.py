"""Command line for the drafter: ``eaglenest train ...`` and ``eaglenest export ...``.

Thin: parses arguments into :class:`~eaglenest.drafter.config.TrainConfig` and calls the library.
Multi-process: ``torchrun --nproc-per-node N -m eaglenest train ...`` (DDP; gloo on CPU, nccl on GPU).
"""

from __future__ import annotations

import json
import logging
import os
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from eaglenest.drafter.config import TrainConfig

app = typer.Typer(no_args_is_help=True)


def _d(field: str):
    """The TrainConfig default: the CLI never restates a default."""
    return TrainConfig.model_fields[field].default


class Precision(StrEnum):
    auto = "auto"
    bf16 = "bf16"
    fp32 = "fp32"


class ExportFormat(StrEnum):
    sglang = "sglang"
    speculators = "speculators"


def _overrides(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise typer.BadParameter(f"--set expects FIELD=VALUE, got {pair!r}")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


@app.command("train")
def train_command(
    store: Annotated[str, typer.Option(help="store URL (Arrow store) or an extraction folder with ledger.jsonl")],
    out: Annotated[Path, typer.Option(help="run folder (checkpoints, metrics.jsonl, result.json); resumes if present")],
    target: Annotated[str, typer.Option(help="target model folder or 'default' (SmolLM2)")] = _d("target"),
    check_store_sha256: Annotated[bool, typer.Option(
        help="sha256-check each store data file on first read (off: only for a store you trust)")] = _d(
        "check_store_sha256"),
    draft_vocab: Annotated[int | None, typer.Option(help="draft vocabulary (unset: 8192 CPU, 32000 GPU)")] = _d(
        "draft_vocab_size"),
    ttt_steps: Annotated[int, typer.Option(help="TTT unroll length k")] = _d("ttt_steps"),
    epochs: Annotated[float, typer.Option(help="passes over the training split")] = _d("epochs"),
    max_steps: Annotated[int | None, typer.Option(help="optimizer steps (overrides --epochs)")] = _d("max_steps"),
    max_tokens: Annotated[int, typer.Option(help="padded tokens per micro-batch")] = _d("max_tokens"),
    grad_accum: Annotated[int, typer.Option(help="micro-batches per optimizer step and process")] = _d("grad_accum"),
    max_seq_len: Annotated[int, typer.Option(help="cut samples to this many tokens")] = _d("max_seq_len"),
    lr: Annotated[float, typer.Option(help="peak learning rate")] = _d("lr"),
    warmup_steps: Annotated[int, typer.Option(help="linear warm-up steps")] = _d("warmup_steps"),
    precision: Annotated[Precision, typer.Option(help="auto: bf16 where the hardware has it")] = Precision(
        _d("precision")),
    device: Annotated[str, typer.Option(help="auto | cpu | cuda")] = _d("device"),
    eval_fraction: Annotated[float, typer.Option(help="share of sample ids held out")] = _d("eval_fraction"),
    eval_max_samples: Annotated[int, typer.Option(help="cap on held-out samples")] = _d("eval_max_samples"),
    eval_every: Annotated[int, typer.Option(help="evaluate every N steps (0: at the end only)")] = _d("eval_every"),
    save_every: Annotated[int, typer.Option(help="checkpoint every N steps")] = _d("save_every"),
    max_minutes: Annotated[float | None, typer.Option(help="time budget; checkpoint and stop (resumable)")] = _d(
        "max_minutes"),
    threads: Annotated[int | None, typer.Option(help="torch CPU threads")] = _d("threads"),
    seed: Annotated[int, typer.Option(help="seed")] = _d("seed"),
    log_every: Annotated[int, typer.Option(help="log every N steps")] = _d("log_every"),
    set_: Annotated[list[str] | None, typer.Option("--set", help="any other TrainConfig field: FIELD=VALUE")] = None,
) -> None:
    """Train an EAGLE-3 drafter on a store (resumes the run in --out if it has checkpoints)."""
    from eaglenest.drafter.train import train

    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    fields = dict(store=store, out_dir=str(out), target=target, check_store_sha256=check_store_sha256,
                  draft_vocab_size=draft_vocab, ttt_steps=ttt_steps,
                  epochs=epochs, max_steps=max_steps, max_tokens=max_tokens, grad_accum=grad_accum,
                  max_seq_len=max_seq_len, lr=lr, warmup_steps=warmup_steps, precision=precision.value, device=device,
                  eval_fraction=eval_fraction, eval_max_samples=eval_max_samples, eval_every=eval_every,
                  save_every=save_every, max_minutes=max_minutes, threads=threads, seed=seed, log_every=log_every)
    fields.update(_overrides(set_ or []))
    result = train(TrainConfig(**fields))
    if rank == 0:
        summary = {k: v for k, v in result.to_dict().items() if k != "history"}
        typer.echo(json.dumps(summary, indent=1))


@app.command("export")
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
