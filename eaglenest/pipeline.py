"""The whole pipeline's configuration and its stage book (library side; the flow is ``flows/pipeline.py``).

:class:`PipelineParams` is ONE pydantic model for extract -> convert -> train -> export -> bench: the UI
renders it as a form and the deployment enforces its schema. Everything a stage needs that an earlier
stage produces (the store URL, the target, the drafter folder) is derived here, in one place, by
:meth:`PipelineParams.plan`, so a user sets each thing once.

:class:`StageBook` decides whether a stage may be skipped: each finished stage is recorded in
``<run_dir>/stages.json`` with a CONTENT key of its inputs (ledger content, store version, training
config + store fingerprint + target hash, checkpoint weights, bench config + drafter weights) and its
output; a stage is skipped only when its key is unchanged AND its output still validates (the store
opens, the checkpoint and export files exist with the recorded hashes, the report is there). Anything
else runs the stage again, and the stages resume their own partial work (ledger, checkpoints). Stages hand
each other typed outputs (:class:`ExtractOutput` ... :class:`BenchOutput`), and the pipeline's result is a
:class:`PipelineSummary`.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

from eaglenest.atomic import atomic_write_bytes
from eaglenest.drafter.config import RESUME_MUTABLE, TrainConfig
from eaglenest.extraction.config import ExtractParams
from eaglenest.forms import show_bounds
from eaglenest.packaged_data import sha256_file
from eaglenest.speculative.bench import BenchConfig

CPU_DEMO_NOTE = (
    "a drafter trained for a few minutes on a CPU is not expected to pay off: speedups below 1x are normal here "
    "(the demo shows the pipeline, not the product). The GPU recipe (prompts the target wrote itself, ShareGPT "
    "first turns and coding prompts, all answered by the target; a 4x-wide draft MLP continued over several GPU "
    "windows) accepts 2.45-2.61 live on MT-Bench in SGLang at 3 draft steps (results/2026-12-06h-h100), and its "
    "drafters served as SGLang's default 6x10x64 tree accept 4.4 per cycle at 1.44x plain decoding in "
    "alternating rounds on an H100, measured 2026-12-07 (results/2026-12-07f-h100); from "
    "nothing in one GPU window it accepts 2.43 (results/2026-12-06c-h100).")
"""What the demo's headline says plainly about its numbers (the measured GPU recipe, for scale)."""

Stage = Literal["extract", "convert", "train", "export", "bench"]
STAGES: tuple[Stage, ...] = ("extract", "convert", "train", "export", "bench")


# The pipeline's stage settings: an empty text field means "what the pipeline produced" (a form shows an empty
# text box for it, where an Optional field would show a None switch and 'Property is type "None"').
class PipelineExtractParams(ExtractParams):
    """Extraction settings; the store it converts into is the pipeline's (set once, at the top level)."""

    output_dir: str = Field("", description=(
        "Local folder (or file:// URL) that holds one subfolder per extraction id; empty: the extractions "
        "folder inside the run folder."))
    store_url: SkipJsonSchema[str | None] = Field(None, exclude=True)  # the pipeline's store_url converts
    store_target_file_mb: SkipJsonSchema[int] = Field(256, exclude=True)


class PipelineTrainParams(TrainConfig):
    """Training settings; ``store``, ``out_dir`` and ``target`` default to what the pipeline produced."""

    store: str = Field("", description="Store URL; empty: the pipeline's store.")
    out_dir: str = Field("", description="Training run folder; empty: the train folder inside the run folder.")
    target: str = Field("", description="Target model; empty: the extraction's model.")
    max_minutes: float | None = Field(30.0, gt=0, description=(
        "Wall-clock budget of the training stage in minutes (None: run the whole schedule)."))


class PipelineBenchParams(BenchConfig):
    """Benchmark settings; the target, drafter, engine, store and output default to the pipeline's."""

    draft: str = Field("", description="Drafter folder; empty: the pipeline's SGLang export.")
    model: str = Field("", description="Target; empty: the extraction's model.")
    engine: Literal["auto", "embedded", "sglang"] = Field(  # type: ignore[assignment]
        "auto", description="embedded (CPU) or sglang (GPU); auto: the extraction's engine.")
    output_dir: str = Field("", description="Report folder; empty: the bench folder inside the run folder.")
    store_url: str = Field("", description="Store for the offline accept length; empty: the pipeline's store.")


class PipelineParams(BaseModel):
    """extract -> convert -> train -> export -> bench, as one form."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=show_bounds)

    run_dir: str = Field("runs/pipeline", description=(
        "Local folder of this pipeline: extractions/, train/, export/, bench/, stages.json."))
    extract: PipelineExtractParams = Field(default_factory=PipelineExtractParams, description=(
        "Extraction: source, model, engine, servers, batching."))
    fresh_extraction_id: bool = Field(False, description=(
        "Give every flow run its own extraction id (scheduled re-extraction); a Retry of the run keeps its "
        "id and resumes it. Off: the id is a hash of the extraction's content, so a re-run resumes."))
    store_url: str = Field("", description=(
        "Where the extraction is converted to: a store URL (local path, file://, s3://, gs://, memory://); empty: "
        "the store folder inside the run folder. Credentials come from the environment or a Prefect block, "
        "never from here."))
    store_target_file_mb: int = Field(256, ge=1, le=1 << 20, description="Target size of each store data file (MiB).")
    train: PipelineTrainParams = Field(default_factory=PipelineTrainParams, description="Drafter training.")
    export_formats: list[Literal["sglang", "speculators"]] = Field(
        default_factory=lambda: ["sglang", "speculators"], min_length=1,
        description="sglang: --speculative-algorithm EAGLE3 folder (benchmarked); speculators: vLLM's layout.")
    export_dtype: Literal["bfloat16", "float16", "float32"] = Field("bfloat16", description="Exported weight dtype.")
    bench: PipelineBenchParams = Field(default_factory=PipelineBenchParams, description=(
        "Speculative-decoding benchmark (baseline vs EAGLE3) and its speedup gate."))
    stop_after: Stage = Field("bench", description="Last stage to run (e.g. 'export' on a machine without servers).")

    def plan(self, run_tag: str | None = None) -> PipelinePlan:
        """The concrete configuration of every stage. ``run_tag`` names this flow run's extraction when
        ``fresh_extraction_id`` is on (the flow passes one that survives a retry)."""
        root = Path(self.run_dir).expanduser().resolve()
        ext_updates: dict[str, Any] = {"store_url": None,
                                       "output_dir": self.extract.output_dir or str(root / "extractions")}
        if self.fresh_extraction_id:
            if not run_tag:
                raise ValueError("fresh_extraction_id: needs a run tag (the flow run's id and start time)")
            ext_updates["extraction_id"] = run_tag
        extract = ExtractParams.model_validate({**self.extract.model_dump(), **ext_updates})
        store_url = self.store_url or str(root / "store")
        t = self.train.model_dump(exclude={"store", "out_dir", "target"})
        train = TrainConfig(store=self.train.store or store_url, out_dir=self.train.out_dir or str(root / "train"),
                            target=self.train.target or extract.model, **t)
        export_dirs = {fmt: str(root / "export" / fmt) for fmt in self.export_formats}
        b = self.bench.model_dump(exclude={"draft", "model", "engine", "output_dir", "store_url"})
        # the offline accept length must be measured on the drafter's own held-out split
        if "heldout_fraction" not in self.bench.model_fields_set:
            b["heldout_fraction"] = max(train.eval_fraction, 1e-6)
        if "offline_max_samples" not in self.bench.model_fields_set:
            b["offline_max_samples"] = max(train.eval_max_samples, 1)
        engine = extract.engine if self.bench.engine == "auto" else self.bench.engine
        bench = BenchConfig(draft=self.bench.draft or export_dirs.get("sglang") or str(root / "export" / "sglang"),
                            model=self.bench.model or extract.model, engine=engine,
                            output_dir=self.bench.output_dir or str(root / "bench"),
                            store_url=self.bench.store_url or store_url, **b)
        stages = STAGES[: STAGES.index(self.stop_after) + 1]
        return PipelinePlan(root, extract, store_url, self.store_target_file_mb, train, export_dirs,
                            self.export_dtype, bench, stages)


@dataclass(frozen=True)
class PipelinePlan:
    run_dir: Path
    extract: ExtractParams
    store_url: str
    store_target_file_mb: int
    train: TrainConfig
    export_dirs: dict[str, str]
    export_dtype: str
    bench: BenchConfig
    stages: tuple[Stage, ...]

    @property
    def extraction_dir(self) -> Path:
        return Path(self.extract.output_path).expanduser().resolve() / self.extract.resolved_extraction_id()


def fresh_run_tag(flow_run_id: str, scheduled: datetime | None) -> str:
    """An extraction id for one flow run of a scheduled re-extraction (stable across the run's retries)."""
    when = (scheduled or datetime.now()).strftime("%Y%m%d-%H%M%S")
    return f"re-{when}-{flow_run_id.replace('-', '')[:8]}"


# ------------------------------------------------------------------------------ content keys
def digest(obj: Any) -> str:
    """sha256 of ``obj`` as canonical JSON (a content key)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def extraction_key(plan: PipelinePlan) -> str:
    return digest({"id": plan.extract.resolved_extraction_id(), "identity": plan.extract.identity()})


def ledger_key(extraction_dir: Path, store_url: str, target_file_mb: int) -> str:
    """The validated samples (ids, shard hashes, loss spans) and where they go."""
    from eaglenest.extraction.ledger import content_key

    return content_key(extraction_dir, [store_url, target_file_mb])


def train_key(config: TrainConfig) -> str:
    """What the drafter is computed from: the config (minus pacing fields), the store's content, the target."""
    from eaglenest import models as model_lib
    from eaglenest.drafter.train import store_fingerprint
    from eaglenest.store import open_samples

    view = {k: v for k, v in config.drift_view().items() if k not in RESUME_MUTABLE}
    return digest({"config": view, "out_dir": config.out_dir, "store": store_fingerprint(open_samples(config.store)),
                 "target": model_lib.model_fingerprint(model_lib.resolve_model(config.target))["model_hash"]})


def latest_checkpoint_sha(run_dir: str) -> str | None:
    from eaglenest.drafter.checkpoint import CheckpointManager

    ckpt = CheckpointManager(run_dir).latest()
    return sha256_file(ckpt / "model.safetensors") if ckpt is not None else None


def bench_key(config: BenchConfig) -> str:
    weights = Path(config.draft) / "model.safetensors"
    # the shape it runs: without shape flags that is the measured default of the day (cpu_shape.json, SGLANG_BEST)
    return digest({"config": config.model_dump(mode="json"), "shape": config.spec_shape.name,
                   "draft": sha256_file(weights) if weights.is_file() else None})


# ------------------------------------------------------------------------------ stage outputs
class StageOutput(BaseModel):
    """What one stage hands to the next and records in the book. ``skipped`` and ``seconds`` describe this
    flow run (an output reused from the book, how long the stage took) and are not recorded."""

    model_config = ConfigDict(extra="forbid")

    skipped: bool = False
    seconds: float | None = None

    def recorded(self) -> dict:
        return self.model_dump(mode="json", exclude={"skipped", "seconds"})


class ExtractOutput(StageOutput):
    dir: str
    done: int
    tokens: int | None = None
    run: dict[str, Any] | None = None
    """The extraction run's counters (requests, retries, tok/s ...), as its report gives them."""
    records: int | None = None
    """Source records asked for (the extraction's limit)."""
    skipped_samples: dict[str, int] = {}
    """Samples skipped, by reason (too_long, truncated, ...)."""
    bad_records: int = 0


class ConvertOutput(StageOutput):
    url: str
    samples: int
    version: str
    tokens: int | None = None
    bytes: int | None = None


class TrainOutput(StageOutput):
    run_dir: str
    status: str
    step: int
    train_tokens: int | None = None
    tokens_per_s: float | None = None
    accept_length: dict[str, float] | None = None
    """Held-out accept length per draft depth (depth as a string, as in result.json)."""
    loss_curve: str | None = None
    checkpoint_sha256: str | None = None


class ExportOutput(StageOutput):
    dirs: dict[str, str]
    files: dict[str, str]
    """Exported folder -> sha256 of its model.safetensors."""


class BenchOutput(StageOutput):
    output_dir: str
    speedups: dict[int, float]
    """EAGLE3 tok/s / baseline tok/s per concurrency."""
    accept_length: Any = None
    gate: Any = None


OUTPUTS: dict[Stage, type[StageOutput]] = {"extract": ExtractOutput, "convert": ConvertOutput, "train": TrainOutput,
                                           "export": ExportOutput, "bench": BenchOutput}


class PipelineSummary(BaseModel):
    """The pipeline's result (``pipeline.json``): every stage that ran, in order."""

    run_dir: str
    extraction_id: str
    parts: list[str] | None = None
    extract: ExtractOutput | dict[str, Any] | None = None
    """A fan-out's extract entry is its parts' timing and run ids, not one extraction."""
    convert: ConvertOutput | None = None
    train: TrainOutput | None = None
    export: ExportOutput | None = None
    bench: BenchOutput | None = None

    def to_json(self) -> dict[str, Any]:
        """JSON-ready, without the stages that did not run."""
        return {k: v for k, v in self.model_dump(mode="json").items() if v is not None}


# ------------------------------------------------------------------------------ the stage book
class StageBook:
    """``<run_dir>/stages.json``: per stage, the content key it was computed for and its output."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / "stages.json"

    def read(self) -> dict[str, dict]:
        if not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}  # unreadable book: every stage runs again (and resumes its own work)
        return data if isinstance(data, dict) else {}

    def done(self, stage: Stage, key: str) -> StageOutput | None:
        """The recorded output of ``stage`` when it was computed for ``key`` and still validates."""
        rec = self.read().get(stage)
        if not rec or rec.get("key") != key:
            return None
        try:
            out = OUTPUTS[stage].model_validate(rec.get("output") or {})
        except ValueError:  # recorded in another shape: run the stage again
            return None
        return out if output_valid(out) else None

    def record(self, stage: Stage, key: str, output: StageOutput) -> None:
        book = self.read()
        book[stage] = {"key": key, "output": output.recorded(), "at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.path, json.dumps(book, indent=1, sort_keys=True, default=str).encode())


def output_valid(out: StageOutput) -> bool:
    """Does a recorded stage output still exist and check out? Cheap checks, no full re-verification."""
    try:
        if isinstance(out, ExtractOutput):
            rep = json.loads((Path(out.dir) / "report.json").read_text())
            return bool(rep.get("complete")) and not rep.get("pending") and rep.get("done") == out.done
        if isinstance(out, ConvertOutput):
            from eaglenest.store import open_store

            return len(open_store(out.url)) == out.samples
        if isinstance(out, TrainOutput):
            return (Path(out.run_dir) / "result.json").is_file() and \
                latest_checkpoint_sha(out.run_dir) == out.checkpoint_sha256
        if isinstance(out, ExportOutput):
            return all(sha256_file(Path(d) / "model.safetensors") == sha for d, sha in out.files.items())
        if isinstance(out, BenchOutput):
            return (Path(out.output_dir) / "report.json").is_file()
    except (OSError, KeyError, ValueError, TypeError, RuntimeError):  # ContractError, StoreError included
        return False
    return False
