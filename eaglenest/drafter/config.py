"""Training configuration: one pydantic model, validated when built, saved in every checkpoint.

Owns the knobs of ``eaglenest train`` (CLI), the ``train`` Prefect flow (the same model is its
parameter form) and :func:`eaglenest.drafter.train.train`. Invariants: impossible combinations are
refused at construction naming the field; fields in :data:`RESUME_MUTABLE` may change between an
interrupted run and its resume (they do not change what is computed), every other difference is
refused on resume (naming the field).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from eaglenest.forms import show_bounds

RESUME_MUTABLE = frozenset({
    "store", "target", "out_dir", "max_minutes", "log_every", "eval_every", "save_every", "keep_checkpoints",
    "threads", "device", "check_store_sha256", "eval_sets", "eval_steps", "prefetch", "prefetch_steps",
})
"""Locations (content is checked separately: store fingerprint, target model hash), pacing, and what is
evaluated besides training (eval sets are only scored, never trained on)."""


class TrainConfig(BaseModel):
    """EAGLE-3 drafter training from a store of engine-captured hidden states."""

    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=show_bounds)

    store: str = Field(description="Store URL (Arrow store), or an extraction folder with ledger.jsonl.")
    check_store_sha256: bool = Field(
        True, description="sha256-check each store data file against its manifest on first read, so a file "
        "changed on storage fails the run naming it; turn off only for a store you trust (saves one hash pass)."
    )
    out_dir: str = Field(description="Run folder: checkpoints/, metrics.jsonl, result.json.")
    target: str = Field("default", description="Target model folder, or 'default' (SmolLM2-135M-Instruct).")
    draft_vocab_size: int | None = Field(
        None, ge=1, description="Draft vocabulary size; default min(32000, V) on GPU, min(8192, V) on CPU "
        "(the draft LM head dominates the CPU cost). With init_from: unset keeps the drafter's own; a larger size "
        "widens it by the training split's most frequent tokens it lacks (their head rows start at zero)."
    )
    draft_intermediate_size: int | None = Field(
        None, ge=1, description="Width of the draft layer's MLP (default: the target's intermediate size). Wider adds "
        "capacity to the one draft layer; SGLang and vLLM read it from the export's config."
    )
    ttt_steps: int = Field(7, ge=1, le=16, description="TTT unroll length k.")
    step_decay: float = Field(0.8, gt=0.0, le=1.0, description="Loss weight of TTT step i is step_decay**i.")
    epochs: float = Field(1.0, gt=0.0, description="Passes over the training split (sets the schedule length).")
    max_steps: int | None = Field(None, ge=1, description="Optimizer steps; overrides epochs when set.")
    max_tokens: int = Field(4096, ge=16, description="Padded tokens per micro-batch (rows x longest row).")
    grad_accum: int = Field(1, ge=1, description="Micro-batches per optimizer step and process.")
    max_seq_len: int = Field(2048, ge=8, description="Longer samples are cut to their first max_seq_len tokens.")
    lr: float = Field(1e-3, gt=0.0, le=1.0, description="Peak learning rate (AdamW).")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="Cosine floor as a fraction of lr.")
    warmup_steps: int = Field(20, ge=0, description="Linear warm-up steps.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    grad_clip: float = Field(0.5, gt=0.0, description="Global gradient-norm clip.")
    precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="auto: bf16 autocast on GPUs and CPUs with native bf16, else fp32."
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description=(
        "auto: cuda when available, else cpu. Under torchrun each process takes the GPU of its local rank."))
    init: Literal["random", "target"] = Field(
        "random", description="random (SpecForge's choice); target: LM head/norm from the target and fc reading "
        "the deepest aux layer (starts at a higher KL; no better after 40 steps on SmolLM2)."
    )
    init_from: str | None = Field(None, description=(
        "An exported drafter folder (`eaglenest export`) to start from: its weights and draft vocabulary, on a new "
        "schedule (more passes, new data, or another engine's capture of the same target). It must fit the store's "
        "capture (target, aux layers, hidden size)."))
    seed: int = Field(0, description="Seed of initialisation and data order.")
    eval_fraction: float = Field(0.05, ge=0.0, lt=1.0, description="Share of sample ids held out.")
    eval_max_samples: int = Field(200, ge=0, description="Cap on held-out samples (the rest train).")
    eval_sets: dict[str, str] = Field(
        {}, description="Extra evaluation sets, never trained on: {name: store URL or extraction folder}, e.g. the "
        "MT-Bench / HumanEval captures of `bench offline --prompt-set` (the target's greedy answers); each is scored "
        "like the held-out split (first eval_max_samples samples) and logged per name in metrics.jsonl. A store "
        "holding several prompt sets (sample ids '<set>:<id>', as the calibration capture writes) contributes "
        "the samples of the set named like the key.")
    eval_every: int = Field(100, ge=0, description="Evaluate every N steps (0: only at the end).")
    eval_steps: int | None = Field(None, ge=1, le=16, description=(
        "Draft steps each evaluation unrolls (default: ttt_steps). Deeper than training shows what a deeper SGLang "
        "chain or tree would accept, e.g. 7 for a drafter trained with TTT 4 and served as a 7-step tree; only "
        "scored, training is unchanged."))
    save_every: int = Field(100, ge=1, description="Checkpoint every N steps (and at the end).")
    keep_checkpoints: int = Field(2, ge=2, description="Complete checkpoints kept (>= 2).")
    max_minutes: float | None = Field(
        None, gt=0.0, description="Time budget: checkpoint and stop (resumable) after this many minutes."
    )
    log_every: int = Field(10, ge=1, description="Log a line every N steps.")
    threads: int | None = Field(None, ge=1, description="torch CPU threads (default: torch's choice).")
    prefetch: bool | None = Field(None, description=(
        "Read and pad the next step's batches on a helper thread while this step computes (default: on GPUs, "
        "where reading would otherwise leave the device idle; off on CPUs, whose cores the step already uses). "
        "Changes nothing that is computed."))
    prefetch_steps: int = Field(1, ge=1, le=64, description=(
        "Steps read ahead when prefetching, each on a helper thread of its own. On the H200 the trainer ran at "
        "80K tokens/s where its step alone computes about 300K; more reading threads may feed it faster, or slow "
        "its launching thread through the GIL (not measured yet). Changes nothing that is computed."))

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.max_seq_len > self.max_tokens:
            raise ValueError(f"max_seq_len ({self.max_seq_len}) must be <= max_tokens ({self.max_tokens}): "
                             "a micro-batch must hold at least one full sample")
        if "heldout" in self.eval_sets:
            raise ValueError("eval_sets: 'heldout' names the training store's own held-out split; pick another name")
        if self.init_from is not None and self.init != "random":
            raise ValueError(f"init_from ({self.init_from}) and init={self.init!r} both set the starting weights; "
                             "pick one")
        if self.eval_fraction > 0 and self.eval_max_samples == 0:
            raise ValueError("eval_fraction > 0 needs eval_max_samples > 0 (or set eval_fraction=0)")
        return self

    def drift_view(self) -> dict:
        """The fields compared on resume."""
        return self.model_dump(mode="json")
