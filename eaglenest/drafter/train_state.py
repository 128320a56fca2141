"""What a drafter training run is made of and checked against (no loop here: see :mod:`.train`).

Owns the run's result record, its terminal errors, the distributed identity (device, precision, where
collectives live), the content checks a resume must pass (config drift, store fingerprint, target shape)
and that the store/eval sets were captured from the target, what a new run starts from (its draft
vocabulary, or an exported drafter's weights), the step-based schedule (total optimizer steps and the LR
factor), and the one-line description of an evaluation.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from eaglenest import contract
from eaglenest import models as model_lib
from eaglenest.atomic import atomic_write_bytes
from eaglenest.drafter.checkpoint import CheckpointError, config_drift, describe_drift
from eaglenest.drafter.config import RESUME_MUTABLE, TrainConfig
from eaglenest.drafter.report import HELDOUT  # the eval-set name of the training store's own held-out split
from eaglenest.drafter.vocab import DraftVocab, count_tokens, loss_tokens, widen_head
from eaglenest.store.extraction import open_samples as open_store

log = logging.getLogger(__name__)


class NonFiniteLoss(RuntimeError):
    """A non-finite loss or gradient: training stopped before the optimizer step. Terminal."""


class ResumeRefused(CheckpointError):
    """The run folder holds a checkpoint of a different run (config, data or target). Terminal."""


@dataclass(slots=True)
class TrainResult:
    status: str  # "done" | "time_budget" (the safety stop; ``note`` says so)
    step: int
    total_steps: int
    run_dir: str
    checkpoint: str
    train_tokens: int
    elapsed_s: float
    """Wall time of this call (a resumed run counts only its own part)."""
    tokens_per_s: float
    """Training tokens per second of this call's loop."""
    train_seconds: float = 0.0
    """Training-loop seconds over all sessions of the run."""
    eval: dict | None = None
    """Metrics on the training store's held-out split at the last evaluation."""
    eval_sets: dict[str, dict] = field(default_factory=dict)
    """The same on every extra eval set (``TrainConfig.eval_sets``), by name."""
    history: list[dict] = field(default_factory=list)
    note: str = ""
    """Why the run stopped: the schedule finished, or the time budget (a safety stop) cut it short."""
    time_split: dict[str, float] = field(default_factory=dict)
    """Where this call's loop time went, in seconds: ``data_wait`` (steps waiting for their micro-batches to be
    read and padded), ``device_wait`` (the host waiting for the device to finish a step's math: the step's one
    read-back), ``eval``, ``save`` and ``other`` (the rest: launching kernels, the optimizer, logging). A loop
    whose time is mostly ``data_wait`` is fed too slowly; mostly ``device_wait``, it is bound by the device."""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> Dist:
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                   int(os.environ.get("LOCAL_RANK", 0)))


def store_fingerprint(store) -> str:
    h = hashlib.sha256(store.provenance.to_json().encode())
    for sid, n in zip(store.sample_ids, store.num_tokens, strict=True):
        h.update(f"{sid}\0{int(n)}\n".encode())
    return h.hexdigest()


def check_store_target(provenance: contract.Provenance, target_dir: Path) -> None:
    """Refuse a target whose weights/shape differ from those that produced the store's states."""
    fp = model_lib.model_fingerprint(target_dir)
    cfg = model_lib.load_config(target_dir)
    diffs = [(n, a, b) for n, a, b in (("model_hash", provenance.model_hash, fp["model_hash"]),
                                       ("hidden_size", provenance.hidden_size, cfg.get("hidden_size")),
                                       ("num_layers", provenance.num_layers, cfg.get("num_hidden_layers"))) if a != b]
    if diffs:
        detail = ", ".join(f"{n}: store {a!r} != target {b!r}" for n, a, b in diffs)
        raise contract.ContractError(f"target {target_dir} is not the model the store was captured from ({detail})")


def lr_factor(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the peak LR for optimizer step ``step`` (0-based): linear warm-up, cosine decay."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))



def schedule_steps(config: TrainConfig, batches_per_epoch: int, world: int) -> int:
    """Optimizer steps of the whole schedule: ``max_steps``, else epochs x micro-batches / per step."""
    return config.max_steps or max(1, math.ceil(config.epochs * batches_per_epoch / (config.grad_accum * world)))


def describe_eval(res: dict, k: int) -> str:
    """'accept length @1 a @3 b @7 c (per cycle @3 x), step-0 acc y' for the depths that exist."""
    depths = sorted({1, min(3, k), k})
    al = " ".join(f"@{d} {res['accept_length'][str(d)]:.3f}" for d in depths)
    cyc = res.get("accept_length_cycles") or {}
    d3 = str(min(3, k))
    per_cycle = f" (per cycle @{d3} {cyc[d3]:.3f})" if d3 in cyc else ""
    return f"accept length {al}{per_cycle}, step-0 acc {res['step_acc'][0]:.3f}"


def open_eval_sets(eval_sets: dict[str, str], provenance: contract.Provenance, target_dir: Path, *,
                   given: dict | None = None) -> dict:
    """Open every extra eval set (``given`` supplies opened stores by name); each must be captured from
    the training target with the same aux layers."""
    from eaglenest.drafter.data import prompt_set_view

    out = {}
    for name, url in eval_sets.items():
        st = prompt_set_view(given[name] if given and name in given else open_store(url), name)
        check_store_target(st.provenance, target_dir)
        if tuple(st.provenance.aux_layer_ids) != tuple(provenance.aux_layer_ids):
            raise contract.ContractError(
                f"eval set {name!r} ({url}) captured aux layers {list(st.provenance.aux_layer_ids)}, the training "
                f"store {list(provenance.aux_layer_ids)}: capture it with the training store's settings")
        if len(st) == 0:
            raise contract.ContractError(f"eval set {name!r} ({url}) holds no samples")
        out[name] = st
    return out


def finished_result(run_dir: Path, d: Dist, resume, total: int) -> TrainResult:
    st = resume.state
    seconds = float(st.get("train_seconds", 0.0))
    result = TrainResult(status="done", step=resume.step, total_steps=total, run_dir=str(run_dir),
                         checkpoint=str(resume.path), train_tokens=int(st["train_tokens"]), elapsed_s=seconds,
                         tokens_per_s=int(st["train_tokens"]) / max(seconds, 1e-9), train_seconds=seconds,
                         eval=st.get("last_eval"), history=st["history"], note="schedule finished",
                         eval_sets={k: v for k, v in (st.get("last_eval_sets") or {}).items() if k != HELDOUT})
    if d.rank == 0 and not (run_dir / "result.json").is_file():
        atomic_write_bytes(run_dir / "result.json", json.dumps(result.to_dict(), indent=1).encode())
    return result


def check_resume(state: dict, config: TrainConfig, fingerprint: str, target_config: dict, *, world: int = 1) -> None:
    """Refuse a resume that would not continue the same run, naming what differs.

    Another number of processes resumes only with the same global step: ``grad_accum x processes`` micro-batches
    (the global stream is the same, so such a resume continues exactly, up to the order of float sums in the
    all-reduce); ``grad_accum`` itself may change for that."""
    saved = state["config"]
    saved_world = int(state.get("world_size", 1))
    per_step, now = int(saved["grad_accum"]) * saved_world, config.grad_accum * world
    if per_step != now:
        raise ResumeRefused(
            f"resume refused: the checkpoint took {per_step} micro-batches per step (grad_accum "
            f"{saved['grad_accum']} x {saved_world} process(es)); this run would take {now} (grad_accum "
            f"{config.grad_accum} x {world}): set grad_accum so that grad_accum x processes = {per_step}, or use a "
            "new out_dir")
    drift = config_drift(saved, config.drift_view(), mutable=RESUME_MUTABLE | {"grad_accum"})
    if drift:
        detail = describe_drift(saved, config.drift_view(), drift)
        raise ResumeRefused(f"resume refused: config differs from the checkpoint's in {detail}; "
                            "restore the value(s) or use a new out_dir")
    if state["store_fingerprint"] != fingerprint:
        raise ResumeRefused("resume refused: the store's content (provenance, sample ids or lengths) differs from "
                            "the one this run was trained on; use a new out_dir")
    if state["target"].get("vocab_size") != target_config.get("vocab_size") or \
            state["target"].get("hidden_size") != target_config.get("hidden_size"):
        raise ResumeRefused("resume refused: the target model's vocab_size/hidden_size differ from the checkpoint's")


def starting_drafter(config: TrainConfig, target_dir: Path, provenance: contract.Provenance) -> dict[str, torch.Tensor]:
    """The weights of ``config.init_from`` (an export checked against the target and the store's capture)."""
    from eaglenest.drafter.export import load_drafter

    loaded = load_drafter(config.init_from, target_dir=target_dir, provenance=provenance)
    have = loaded.model.config
    for name, size, asked in (("draft_vocab_size", have.draft_vocab_size, config.draft_vocab_size),
                               ("draft_intermediate_size", have.intermediate_size, config.draft_intermediate_size)):
        if asked is not None and asked != size and not (name == "draft_vocab_size" and asked > size):
            wider = " (a larger draft vocabulary widens it)" if name == "draft_vocab_size" else ""
            raise contract.ContractError(
                f"init_from {config.init_from} has {name} {size}, the config asks for {asked}: leave {name} "
                f"unset (the drafter's own is kept){wider} or start afresh")
    return loaded.model.state_dict()


def resolve_device(config: TrainConfig, d: Dist) -> tuple[torch.device, bool]:
    """The run's device (a rank's own GPU under torchrun) and whether it computes in bf16."""
    device = model_lib.auto_device(config.device)
    if device == "cuda" and d.world > 1:
        device = f"cuda:{d.local_rank}"
    bf16 = config.precision == "bf16" or (
        config.precision == "auto" and model_lib.auto_dtype(device.split(":")[0]) == "bfloat16")
    return torch.device(device), bf16


def planned_vocab_size(asked: int | None, own: int | None, vocab_size: int, device_type: str) -> int:
    """The draft vocabulary size a run trains with, the one rule for the trainer and for whoever plans around it:
    a continued drafter's own (``own``) unless ``asked`` is larger (it is then widened to ``asked``); a fresh
    run's ``asked``, or, unset, min(32000 on a GPU, 8192 on a CPU, the target's ``vocab_size``)."""
    if own is not None and (asked or 0) <= own:
        return own
    return asked or min(32000 if device_type == "cuda" else 8192, vocab_size)


def build_vocab(config: TrainConfig, store, train_idx: list[int], vocab_size: int, device, d: Dist, *,
                own: DraftVocab | None = None) -> DraftVocab:
    """A new run's draft vocabulary from its training split (rank 0 counts, the others receive it); with ``own``
    (the vocabulary of the drafter it continues) that one, widened to a larger ``draft_vocab_size`` by the split's
    most frequent tokens it lacks (its head: :func:`continued_start`)."""
    size = planned_vocab_size(config.draft_vocab_size, own.size if own is not None else None, vocab_size,
                              device.type)
    if own is not None and size == own.size:
        return own
    if size > vocab_size:  # (on every rank: one that raised alone would leave the others in the broadcast)
        raise contract.ContractError(f"draft vocabulary size {size} must be in 1..{vocab_size}")
    if d.rank == 0:
        counts = count_tokens(loss_tokens(store, train_idx), vocab_size)
        vocab = own.widened(counts, size) if own is not None else DraftVocab.from_counts(counts, size)
        ids = vocab.target_ids
    else:
        ids, vocab = torch.zeros(size, dtype=torch.int64), None
    if d.world > 1:
        comm = ids.to(comm_device(device))
        dist.broadcast(comm, src=0)
        ids = comm.cpu()
    return vocab or DraftVocab(ids, vocab_size)


def continued_start(config: TrainConfig, start: dict[str, torch.Tensor], store, train_idx: list[int],
                    vocab_size: int, device, d: Dist) -> tuple[DraftVocab, dict[str, torch.Tensor]]:
    """The draft vocabulary and weights a continued drafter (``init_from``, weights ``start``) trains from: its own,
    or, for a larger ``draft_vocab_size``, its own widened (:func:`build_vocab`) with zero LM-head rows for the added
    tokens (:func:`~eaglenest.drafter.vocab.widen_head`) and the two maps anew."""
    own = DraftVocab.from_d2t(start["d2t"], vocab_size)
    vocab = build_vocab(config, store, train_idx, vocab_size, device, d, own=own)
    if vocab.size == own.size:
        return own, start
    if d.rank == 0:  # (the others received the ids, not the counts)
        log.info("draft vocabulary widened from %d to %d tokens (coverage of the training split %.4f)",
                 own.size, vocab.size, vocab.coverage)
    return vocab, {**start, "lm_head.weight": widen_head(start["lm_head.weight"], own, vocab),
                   "d2t": vocab.d2t.to(start["d2t"].device), "t2d": vocab.t2d.to(start["t2d"].device)}


def comm_device(device: torch.device) -> torch.device:
    """Where collective tensors live: the GPU for nccl, the CPU for gloo."""
    return device if device.type == "cuda" else torch.device("cpu")
