"""Command line for the store: ``eaglenest store convert | verify | info``. Thin: parses, calls the library."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, help="Arrow-indexed store of captured hidden states.")


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
                          partial=partial, progress=lambda done, total: bar.update(task, completed=done, total=total))
        except (StoreError, ContractError) as e:
            _fail(e)
    s = summary
    speed = s.bytes_in / max(s.seconds, 1e-9) / 1e6
    typer.echo(f"store {url} version {s.version}: {s.samples} samples, {s.tokens} tokens, {s.files_total} files "
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
