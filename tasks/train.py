"""Prefect tasks over the drafter library: train (resumable), export, and the training report artifacts.

Thin shells: each calls one library function. Cache keys hash CONTENT: the training config (minus
pacing fields), the store's fingerprint (provenance + sample ids + lengths) and the target's model
hash; exports hash the checkpoint's weights. Retries only for retryable errors (I/O hiccups on
remote storage; training resumes from its last checkpoint, so a retry redoes at most save_every
steps); contract errors, NaN losses, refused resumes and out-of-memory are terminal.
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import (
    create_image_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.context import TaskRunContext

from eaglenest import pipeline as pipeline_lib
from eaglenest.drafter.config import TrainConfig
from eaglenest.drafter.export import export_drafter
from eaglenest.drafter.report import plot_loss_curve, summary_rows
from eaglenest.drafter.train import train

_RETRYABLE = (ConnectionError, TimeoutError)


def _retryable(task, task_run, state) -> bool:
    exc = state.result(raise_on_failure=False)
    return bool(getattr(exc, "retryable", False)) or isinstance(exc, _RETRYABLE)


def train_key(config: TrainConfig) -> str:
    return "train-drafter-" + pipeline_lib.train_key(config)


def _train_cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    return train_key(parameters["config"])


@task(name="train-drafter", cache_key_fn=_train_cache_key, persist_result=True, retries=2,
      retry_delay_seconds=10, retry_condition_fn=_retryable)
def train_drafter(config: TrainConfig) -> dict:
    """Train (or resume) the drafter; a progress artifact follows the optimizer steps."""
    artifact = create_progress_artifact(0.0, description=f"training drafter -> {config.out_dir}")
    logger = get_run_logger()
    last, logged = [0.0], [-10.0]

    def progress(event: dict) -> None:
        if event["kind"] == "train":
            total = max(1, event.get("total_steps") or 1)
            pct = 100.0 * event["step"] / total
            if pct - last[0] >= 1.0:
                update_progress_artifact(artifact, pct)
                last[0] = pct
            if pct - logged[0] >= 10.0:
                acc0 = (event.get("step_acc") or [float("nan")])[0]
                logger.info("step %d/%d loss %.3f step-0 acc %.3f", event["step"], total,
                            event.get("loss", float("nan")), acc0)
                logged[0] = pct
        elif event["kind"] == "eval":
            logger.info("held-out accept length %s", event.get("accept_length"))

    result = train(config, callback=progress).to_dict()
    update_progress_artifact(artifact, 100.0)
    result.pop("history", None)
    return result


@task(name="training-report")
def training_report(run_dir: str, result: dict) -> str:
    """Loss-curve PNG (file + image artifact) and a summary table artifact; returns the PNG path."""
    png = plot_loss_curve(run_dir)
    data_url = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
    create_image_artifact(image_url=data_url, key="drafter-loss-curve", description=f"loss curve of {run_dir}")
    create_table_artifact(summary_rows(result), key="drafter-training", description=f"drafter training {run_dir}")
    return str(png)


def _export_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    weights = pipeline_lib.latest_checkpoint_sha(parameters["run_dir"]) or "none"
    rest = json.dumps({k: parameters.get(k) for k in ("out_dir", "fmt", "dtype", "speculative_tokens")})
    return "export-drafter-" + hashlib.sha256((weights + rest).encode()).hexdigest()


@task(name="export-drafter", cache_key_fn=_export_key, persist_result=True)
def export_task(run_dir: str, out_dir: str, fmt: str = "sglang", dtype: str = "bfloat16",
                speculative_tokens: int = 3) -> str:
    """Export the run's latest checkpoint for an engine; returns the folder."""
    return str(export_drafter(run_dir, Path(out_dir), fmt=fmt, dtype=dtype, speculative_tokens=speculative_tokens,
                              overwrite=True))


def train_or_cached(config: TrainConfig) -> dict:
    """``train_drafter``, except that a run folder that lost its checkpoints (deleted, another disk)
    is trained again and re-cached, instead of a cache hit describing files that are gone."""
    gone = pipeline_lib.latest_checkpoint_sha(config.out_dir) is None
    return train_drafter.with_options(refresh_cache=gone)(config)


def export_or_cached(run_dir: str, out_dir: str, fmt: str = "sglang", dtype: str = "bfloat16",
                     speculative_tokens: int = 3) -> str:
    """``export_task``, re-exported (and re-cached) when the export folder's weights are gone."""
    gone = not (Path(out_dir) / "model.safetensors").is_file()
    return export_task.with_options(refresh_cache=gone)(run_dir, out_dir, fmt, dtype, speculative_tokens)
