"""Command line for the store: ``eaglenest store convert | verify | info | plan``. Thin: parses, calls the library."""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, help="Arrow-indexed store of captured hidden states.")


class Encoding(StrEnum):  # the values of eaglenest.store.encoding.ENCODINGS (kept light: no torch at CLI start)
    bf16 = "bf16"
    fp8 = "fp8"


def _fail(e: Exception) -> None:
    typer.echo(f"error: {e}", err=True)
    raise typer.Exit(2)


@app.command()
def convert(
    extraction_dir: Annotated[Path, typer.Argument(help="extraction folder (ledger.jsonl + capture/)")],
    url: Annotated[str, typer.Argument(help="store URL: local path, file://, memory://, s3://, gs://")],
    target_file_mb: Annotated[int, typer.Option(min=1, help="target size of each data file (MiB)")] = 256,
    append: Annotated[bool, typer.Option(help="add the ledger's new samples to the store's latest version")] = False,
    rehash: Annotated[bool, typer.Option(help="sha256-check already committed files too (rebuild bad ones)")] = False,
    partial: Annotated[bool, typer.Option(help="convert although samples are still pending (refused otherwise)")
                       ] = False,
    encoding: Annotated[Encoding, typer.Option(
        help="bf16: the captured bits; fp8: e4m3 + per-token block scales, half the bytes (<= 6.6% per-row error)")
                        ] = Encoding.bf16,
    device: Annotated[str, typer.Option(help="where fp8 encoding runs: auto (a GPU if visible) | cpu | cuda")
                      ] = "auto",
) -> None:
    """Convert an extraction's validated shards into a new (or the same, if unchanged) store version."""
    from rich.progress import Progress

    from eaglenest.contract import ContractError
    from eaglenest.store import StoreError
    from eaglenest.store import convert as run

    with Progress(transient=True) as bar:
        task = bar.add_task("converting", total=None)
        try:
            summary = run(extraction_dir, url, target_file_bytes=target_file_mb << 20, append=append, rehash=rehash,
                          partial=partial, encoding=encoding.value, device=device,
                          progress=lambda done, total: bar.update(task, completed=done, total=total))
        except (StoreError, ContractError, ValueError) as e:
            _fail(e)
    s = summary
    speed = s.bytes_in / max(s.seconds, 1e-9) / 1e6
    typer.echo(f"store {url} version {s.version} ({s.encoding}): {s.samples} samples, {s.tokens} tokens, "
               f"{s.files_total} files "
               f"({s.files_written} written, {s.files_reused} reused, {s.files_quarantined} quarantined), "
               f"{s.bytes_in / 1e6:.1f} MB converted in {s.seconds:.1f} s ({speed:.0f} MB/s)")
    if s.pending:
        typer.echo(f"partial: {s.pending} pending samples of the extraction are not in this version", err=True)


@app.command()
def verify(
    url: Annotated[str, typer.Argument(help="store URL")],
    version: Annotated[str | None, typer.Option(help="version id (default: latest)")] = None,
) -> None:
    """Check sizes, sha256 and index <-> data consistency; exit 1 and name each bad file on problems.

    Exit 0: every file checks out. Exit 1: one `PROBLEM ...` line per damaged file (missing, truncated,
    changed bytes, index disagreeing). Exit 2: no store at the URL, or a store this eaglenest cannot read."""
    from eaglenest.contract import ContractError
    from eaglenest.store import StoreError, verify_store

    try:
        store, problems = verify_store(url, version=version)
    except (StoreError, ContractError) as e:
        _fail(e)
    for p in problems:
        typer.echo(f"PROBLEM {p}")
    if problems:
        raise typer.Exit(1)
    typer.echo(f"OK {url} version {store.manifest['version']}: {len(store)} samples, "
               f"{len(store.manifest['files'])} files, sha256 and index consistent")


@app.command()
def info(
    url: Annotated[str, typer.Argument(help="store URL")],
    version: Annotated[str | None, typer.Option(help="version id (default: latest)")] = None,
    versions: Annotated[bool, typer.Option("--versions", help="list every committed version")] = False,
) -> None:
    """Print the store's summary (JSON)."""
    from eaglenest.contract import ContractError
    from eaglenest.store import StoreError, list_versions, open_store

    try:
        if versions:
            out = [{k: m.get(k) for k in ("version", "parent", "created_at", "extraction", "num_samples",
                                          "num_tokens")} for m in list_versions(url)]
        else:
            out = open_store(url, version=version).info()
    except (StoreError, ContractError) as e:
        _fail(e)
    typer.echo(json.dumps(out, indent=1))


def _size(n: float) -> str:
    return f"{n / 1e12:.2f} TB" if n >= 1e12 else f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


@app.command()
def plan(
    model: Annotated[str | None, typer.Option(
        help="'default', a local HF folder, a config.json path, or a known target (kimi-k2, deepseek-v3, "
             "llama-3.1-70b, llama-3.1-8b, qwen2.5-7b)")] = None,
    samples: Annotated[int, typer.Option(min=1, help="number of samples")] = 10_000,
    mean_tokens: Annotated[float, typer.Option(min=1, help="mean tokens per sample (prompt + answer)")] = 500,
    encoding: Annotated[Encoding, typer.Option(help="the encoding you plan to convert with")] = Encoding.bf16,
    hidden_size: Annotated[int | None, typer.Option(min=1, help="override the config's hidden_size")] = None,
    num_layers: Annotated[int | None, typer.Option(min=1, help="override the config's num_hidden_layers")] = None,
    aux_layers: Annotated[str | None, typer.Option(help="aux layer ids, e.g. 1,14,26 (default [1, L//2-1, L-4])")
                          ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the plan as JSON")] = False,
) -> None:
    """Disk a store needs for a target, before capturing: bytes per token and total, bf16 and fp8."""
    from eaglenest.contract import ContractError
    from eaglenest.store.plan import footprint, target_shape

    if model is None and not (hidden_size and num_layers):
        _fail(ValueError("give --model, or --hidden-size and --num-layers"))
    try:
        ids = tuple(int(i) for i in aux_layers.split(",")) if aux_layers else None
        shape = target_shape(model, hidden_size=hidden_size, num_layers=num_layers, aux_layer_ids=ids)
        out = footprint(shape, samples=samples, mean_tokens=mean_tokens)
    except (ValueError, ContractError) as e:
        _fail(e)
    if as_json:
        typer.echo(json.dumps({**out, "encoding": encoding.value}, indent=1))
        return
    chosen = out[encoding.value]
    typer.echo(f"target {out['target']}: hidden {out['hidden_size']}, {out['num_layers']} layers, "
               f"aux layers {out['aux_layer_ids']}")
    typer.echo(f"{samples:,} samples x {mean_tokens:,.0f} tokens = {out['tokens'] / 1e6:,.1f}M tokens")
    for enc in Encoding:
        o = out[enc.value]
        mark = "  <- --encoding" if enc is encoding else ""
        typer.echo(f"  {enc.value:5s} {o['bytes_per_token']:>8,} B/token  {_size(o['bytes']):>10}{mark}")
    typer.echo(f"store size with {encoding.value}: {_size(chosen['bytes'])} ({chosen['bytes'] / 2**30:,.1f} GiB); "
               f"fp8 is {out['fp8_vs_bf16']:.3f}x of bf16")
