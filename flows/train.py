"""Flow: train a drafter on a store, report it, export it for SGLang and vLLM (composition only)."""

from __future__ import annotations

from typing import Literal

from prefect import flow
from pydantic import BaseModel, ConfigDict, Field

from eaglenest.drafter.config import TrainConfig
from eaglenest.forms import show_bounds
from tasks.train import export_or_cached, train_or_cached, training_report


class TrainFlowParams(BaseModel):
    """Parameters of the train flow (rendered as a form in the Prefect UI)."""

    model_config = ConfigDict(json_schema_extra=show_bounds)

    train: TrainConfig = Field(description="Training configuration (store, target, schedule, budget).")
    export_formats: list[Literal["sglang", "speculators"]] = Field(
        default_factory=lambda: ["sglang", "speculators"],
        description="sglang: --speculative-algorithm EAGLE3 folder; speculators: vLLM's layout.")
    export_dir: str = Field("", description=(
        "Where exports go, one subfolder per format; empty: the export folder inside the training run folder."))
    export_dtype: Literal["bfloat16", "float16", "float32"] = Field("bfloat16", description="Exported weight dtype.")
    speculative_tokens: int = Field(3, ge=1, le=16, description="Draft length written into the speculators config.")


@flow(name="train", log_prints=True)
def train_flow(params: TrainFlowParams) -> dict:
    """Store -> trained drafter (resumable) -> loss curve + table artifacts -> engine exports."""
    result = train_or_cached(params.train)
    png = training_report(params.train.out_dir, result)
    base = params.export_dir or f"{params.train.out_dir}/export"
    exports = {fmt: export_or_cached(params.train.out_dir, f"{base}/{fmt}", fmt, params.export_dtype,
                                params.speculative_tokens) for fmt in params.export_formats}
    return {"result": result, "loss_curve": png, "exports": exports}
