"""Prefect task over :func:`eaglenest.store.convert`: content cache key, retries only when retryable, artifacts.

The cache key hashes the ledger's content (each validated sample's id, shard sha256 and loss spans) and the
conversion config (store URL, file size, append, encoding, partial) — never the extraction folder's path — so moving an
extraction keeps the cache, and a changed ledger (new samples, re-validated shard) misses it. A cache hit
returns the earlier summary without touching storage; ``convert`` itself is idempotent either way.
"""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.context import TaskRunContext

from eaglenest.extraction.ledger import content_key
from eaglenest.store import StoreError, convert, list_versions

_TRANSIENT = (ConnectionError, TimeoutError)


def _cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    config = {k: parameters.get(k) for k in ("url", "target_file_bytes", "append")}
    for k, default in (("encoding", "bf16"), ("partial", False)):  # keys of earlier runs stay valid for defaults
        if parameters.get(k, default) != default:
            config[k] = parameters[k]
    return "store-convert-" + content_key(parameters["extraction_dir"], config)


def _retryable(task, task_run, state) -> bool:
    exc = state.result(raise_on_failure=False)
    if isinstance(exc, StoreError):
        return exc.retryable
    return isinstance(exc, _TRANSIENT)  # remote storage hiccups; contract/disk-full errors are terminal


@task(name="convert-to-store", cache_key_fn=_cache_key, persist_result=True, retries=2, retry_delay_seconds=5,
      retry_condition_fn=_retryable)
def convert_to_store(extraction_dir: str, url: str, target_file_bytes: int = 256 << 20,
                     append: bool = False, encoding: str = "bf16", partial: bool = False) -> dict:
    """Convert validated shards into a store version; returns the conversion summary as a dict."""
    artifact = create_progress_artifact(0.0, description=f"converting {extraction_dir} -> {url}")
    last = [0.0]

    def progress(done: int, total: int) -> None:
        pct = 100.0 * done / max(total, 1)
        if pct - last[0] >= 5 or done == total:
            update_progress_artifact(artifact, pct)
            last[0] = pct

    summary = convert(extraction_dir, url, target_file_bytes=target_file_bytes, append=append, encoding=encoding,
                      partial=partial, progress=progress)
    s = summary.to_dict()
    rows = "\n".join(f"| {k} | {v} |" for k, v in s.items())
    create_markdown_artifact(f"### Store version `{summary.version}`\n\n| field | value |\n|---|---|\n{rows}\n",
                             key="store-convert", description="store conversion summary")
    return s


def convert_or_cached(extraction_dir: str, url: str, target_file_bytes: int = 256 << 20,
                      append: bool = False, *, encoding: str = "bf16", partial: bool = False) -> dict:
    """``convert_to_store``, converted again (and re-cached) when ``url`` holds no store any more."""
    try:
        gone = not list_versions(url)
    except (OSError, StoreError):
        gone = True
    return convert_to_store.with_options(refresh_cache=gone)(extraction_dir, url, target_file_bytes, append,
                                                             encoding, partial)
