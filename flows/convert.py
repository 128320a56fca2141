"""Flow: convert one extraction folder into a version of an Arrow-indexed store (composition only)."""

from __future__ import annotations

from typing import Literal

from prefect import flow
from pydantic import BaseModel, ConfigDict, Field

from eaglenest.forms import show_bounds
from tasks.store import convert_or_cached


class ConvertParams(BaseModel):
    """Parameters of the convert flow (rendered as a form in the Prefect UI)."""

    model_config = ConfigDict(json_schema_extra=show_bounds)

    extraction_dir: str = Field(description="Extraction folder holding ledger.jsonl and capture/ (validated shards).")
    store_url: str = Field(description="Store URL: local path, file://, memory://, s3:// or gs:// (credentials "
                                       "come from the environment or a Prefect block, never from here).")
    target_file_mb: int = Field(256, ge=1, le=1 << 20, description="Target size of each Arrow data file, in MiB.")
    append: bool = Field(False, description="Add this extraction's new samples to the store's latest version "
                                            "instead of making a version of exactly this extraction.")
    encoding: Literal["bf16", "fp8"] = Field(
        "bf16", description="bf16: the captured bits. fp8: e4m3 with a per-token scale per aux layer and for the final "
        "state, half the bytes, at most 6.6% relative error per row. One version holds one encoding.")
    partial: bool = Field(False, description="Convert although samples of the extraction are still pending "
                                             "(refused otherwise).")


@flow(name="convert", log_prints=True)
def convert_flow(params: ConvertParams) -> dict:
    """Validated shards -> Arrow IPC data files + index + manifest (written last)."""
    return convert_or_cached(params.extraction_dir, params.store_url, params.target_file_mb << 20, params.append,
                             encoding=params.encoding, partial=params.partial)
