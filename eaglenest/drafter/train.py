"""Drafter training loop: store -> TTT objective -> AdamW steps, checkpointed and resumable exactly.

Owns :func:`train`: builds (or restores) the draft vocabulary and the drafter, runs optimizer steps of
``grad_accum x world_size`` micro-batches from the global :class:`~eaglenest.drafter.data.BatchStream`
(rank r takes micro-batches ``r*ga .. r*ga+ga-1``), evaluates on the held-out split, checkpoints.

Invariants:
- Loss of a step = sum_i decay^i * (sum of KL at counted rows of step i) / (global count of step-i rows),
  the counts all-reduced BEFORE any backward, so 1 process with ``ga = N*g`` and N processes with
  ``ga = g`` compute the same gradient (up to float summation order).
- A non-finite loss or gradient norm on any rank stops every rank BEFORE the optimizer step
  (:class:`NonFiniteLoss`, terminal); the last checkpoint stays the last good state.
- Resume restores weights, optimizer, scheduler, data-stream position and RNG states and continues
  exactly; a config that differs outside :data:`~eaglenest.drafter.config.RESUME_MUTABLE`, another
  store content or another target model is refused naming the field.
- Only rank 0 writes (checkpoints, metrics.jsonl, result.json). Nothing here imports Prefect.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from eaglenest import contract
from eaglenest import models as model_lib
from eaglenest.drafter.checkpoint import CheckpointError, CheckpointManager, config_drift, describe_drift
from eaglenest.drafter.config import RESUME_MUTABLE, TrainConfig
from eaglenest.drafter.data import BatchStream, collate
from eaglenest.drafter.evaluate import evaluate
from eaglenest.drafter.model import DrafterConfig, Eagle3Drafter, load_target_tensors
from eaglenest.drafter.ttt import step_counts, target_rows, ttt_forward
from eaglenest.drafter.vocab import DraftVocab, build_draft_vocab
from eaglenest.store import split_indices
from eaglenest.store.extraction import open_samples as open_store

log = logging.getLogger(__name__)


class NonFiniteLoss(RuntimeError):
    """A non-finite loss or gradient: training stopped before the optimizer step. Terminal."""


class ResumeRefused(CheckpointError):
    """The run folder holds a checkpoint of a different run (config, data or target). Terminal."""


@dataclass(slots=True)
class TrainResult:
    status: str  # "done" | "time_budget"
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
    history: list[dict] = field(default_factory=list)

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


class TTTObjective(nn.Module):
    """The drafter behind one forward, so DDP sees every parameter use in ``forward``."""

    def __init__(self, drafter: Eagle3Drafter) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, batch, rows, k: int, scales: list[float]):
        results = ttt_forward(self.drafter, batch, rows, k)
        loss = sum(r.loss_sum * s for r, s in zip(results, scales, strict=True))
        return loss, results


def _resolve(config: TrainConfig, d: Dist) -> tuple[torch.device, bool]:
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and d.world > 1:
        device = f"cuda:{d.local_rank}"
    bf16 = config.precision == "bf16" or (
        config.precision == "auto" and model_lib.auto_dtype(device.split(":")[0]) == "bfloat16")
    return torch.device(device), bf16


def _build_vocab(config: TrainConfig, store, train_idx: list[int], vocab_size: int, device, d: Dist) -> DraftVocab:
    size = config.draft_vocab_size or min(32000 if device.type == "cuda" else 8192, vocab_size)
    if d.rank == 0:
        vocab = build_draft_vocab(((store[i].input_ids, store[i].loss_mask) for i in train_idx),
                                  vocab_size=vocab_size, size=size)
        ids = vocab.target_ids
    else:
        ids, vocab = torch.zeros(size, dtype=torch.int64), None
    if d.world > 1:
        comm = ids.to(_comm_device(device))
        dist.broadcast(comm, src=0)
        ids = comm.cpu()
    return vocab or DraftVocab(ids, vocab_size)


def _comm_device(device: torch.device) -> torch.device:
    """Where collective tensors live: the GPU for nccl, the CPU for gloo."""
    return device if device.type == "cuda" else torch.device("cpu")


def train(config: TrainConfig, *, store=None, callback: Callable[[dict], None] | None = None,
          clock: Callable[[], float] = time.monotonic) -> TrainResult:
    """Train (or resume) a drafter per ``config``; returns where the result is and its metrics.

    ``store`` overrides opening ``config.store`` (tests pass an in-memory store). ``callback`` gets
    every train/eval/checkpoint event dict on rank 0 (an exception from it aborts like a crash).
    """
    d = Dist.from_env()
    if d.world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() and config.device != "cpu" else "gloo")
    threads = torch.get_num_threads()
    if config.threads:
        torch.set_num_threads(config.threads)
    try:
        return _train(config, d, store, callback, clock)
    finally:
        torch.set_num_threads(threads)


def _train(config: TrainConfig, d: Dist, store, callback, clock) -> TrainResult:
    device, bf16 = _resolve(config, d)
    t_start = clock()
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    run_dir = Path(config.out_dir)
    store = store if store is not None else open_store(config.store, check_sha256=config.check_store_sha256)
    target_dir = model_lib.resolve_model(config.target)
    check_store_target(store.provenance, target_dir)
    train_idx, eval_idx = split_indices(store.sample_ids, config.eval_fraction, max_eval=config.eval_max_samples)
    fingerprint = store_fingerprint(store)
    tt = load_target_tensors(target_dir)
    ckpts = CheckpointManager(run_dir, keep=config.keep_checkpoints)
    if d.rank == 0:
        ckpts.clean_temporaries()
    resume = ckpts.load() if ckpts.latest() is not None else None
    if resume is not None:
        _check_resume(resume.state, config, fingerprint, tt.config)
        vocab = DraftVocab.from_d2t(resume.model["d2t"], int(tt.config["vocab_size"]))
    else:
        vocab = _build_vocab(config, store, train_idx, int(tt.config["vocab_size"]), device, d)
    dcfg = DrafterConfig.from_target(tt.config, aux_layer_ids=store.provenance.aux_layer_ids,
                                     draft_vocab_size=vocab.size)
    drafter = Eagle3Drafter(dcfg, embed_weight=tt.embed)
    drafter.load_vocab(vocab.d2t, vocab.t2d)
    if config.init == "target":
        drafter.init_from_target(tt)
    if resume is not None:
        drafter.load_state_dict(resume.model)
    drafter.to(device)
    objective = TTTObjective(drafter)
    if d.world > 1:
        objective = nn.parallel.DistributedDataParallel(objective, broadcast_buffers=False,
                                                        device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=config.lr, betas=(0.9, 0.95),
                                  weight_decay=config.weight_decay)
    lengths = [min(int(store.num_tokens[i]), config.max_seq_len) for i in train_idx]
    stream = BatchStream(lengths, max_tokens=config.max_tokens, seed=config.seed)
    per_step = config.grad_accum * d.world
    total = config.max_steps or max(1, math.ceil(config.epochs * stream.batches_per_epoch() / per_step))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(
        s, warmup=config.warmup_steps, total=total, min_ratio=config.min_lr_ratio))
    step, history, tokens_done, seconds_before = 0, [], 0, 0.0
    if resume is not None:
        step, history = resume.step, resume.state["history"]
        tokens_done, seconds_before = int(resume.state["train_tokens"]), float(resume.state.get("train_seconds", 0))
        if step >= total:  # already complete: nothing to compute (re-run of a finished run)
            return _finished(run_dir, d, resume, total)
        optimizer.load_state_dict(resume.optimizer)
        scheduler.load_state_dict(resume.trainer["scheduler"])
        stream.load_state_dict(resume.trainer["stream"])
        torch.set_rng_state(resume.trainer["rng_torch"])
        random.setstate(resume.trainer["rng_python"])
        log.info("resumed %s at step %d/%d", resume.path, step, total)
    head_dtype = torch.bfloat16 if bf16 else torch.float32
    head_full = tt.lm_head.to(device=device, dtype=head_dtype)  # [V, H] frozen target head
    draft_ids = vocab.target_ids.to(device)
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    k, decay = config.ttt_steps, config.step_decay
    weights = [decay**i for i in range(k)]
    state_base = {"config": config.drift_view(), "drafter_config": dcfg.to_dict(), "store_fingerprint": fingerprint,
                  "provenance": json.loads(store.provenance.to_json()), "target": tt.config,
                  "total_steps": total, "vocab_coverage": vocab.coverage, "eval_samples": len(eval_idx)}
    metrics_path = run_dir / "metrics.jsonl"

    def emit(event: dict) -> None:
        if d.rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            with open(metrics_path, "a") as f:
                f.write(json.dumps(event) + "\n")
            if callback is not None:
                callback(event)

    def run_eval() -> dict | None:
        if d.rank != 0 or not eval_idx:
            return None
        res = evaluate(drafter, store, eval_idx, head_full=head_full, k=k, max_tokens=config.max_tokens,
                       max_seq_len=config.max_seq_len, dtype=head_dtype, autocast=autocast()).to_dict()
        emit({"kind": "eval", "step": step, **res})
        log.info("eval step %d: accept length @3 %.3f @%d %.3f, step-0 acc %.3f", step,
                 res["accept_length"].get("3", float("nan")), k, res["accept_length"][str(k)], res["step_acc"][0])
        return res

    def save(last_eval: dict | None) -> Path | None:
        path = None
        if d.rank == 0:
            trainer_state = {"scheduler": scheduler.state_dict(), "stream": stream.state_dict(),
                             "rng_torch": torch.get_rng_state(), "rng_python": random.getstate()}
            state = dict(state_base, history=history, train_tokens=tokens_done, last_eval=last_eval,
                         vocab_size=vocab.size, train_seconds=seconds_before + clock() - t_loop)
            path = ckpts.save(step=step, model=drafter.state_dict(), optimizer=optimizer.state_dict(),
                              trainer=trainer_state, state=state)
            emit({"kind": "checkpoint", "step": step, "path": str(path)})
        if d.world > 1:
            dist.barrier()
        return path

    status, last_eval, last_eval_step, t_loop = "done", None, -1, clock()
    tokens_at_start = tokens_done
    while step < total:
        micro = stream.take(per_step)
        mine = micro[d.rank * config.grad_accum : (d.rank + 1) * config.grad_accum]
        batches = [collate([store[train_idx[j]] for j in mb], [train_idx[j] for j in mb],
                           max_seq_len=config.max_seq_len, dtype=head_dtype, device=device) for mb in mine]
        counts = sum(step_counts(b.loss_mask, k) for b in batches).to(torch.float64)  # [k]
        ntok = torch.tensor(float(sum(b.num_tokens for b in batches)), dtype=torch.float64)
        if d.world > 1:
            packed = torch.cat([counts.cpu(), ntok.view(1)]).to(_comm_device(device))
            dist.all_reduce(packed)
            packed = packed.cpu()
            counts, ntok = packed[:k], packed[k]
        scales = [w * d.world / max(float(c), 1.0) for w, c in zip(weights, counts.tolist(), strict=True)]
        lr_used = optimizer.param_groups[0]["lr"]
        total_loss, finite = 0.0, True
        step_loss, step_correct = [0.0] * k, [0] * k
        for a, batch in enumerate(batches):
            sync = a == len(batches) - 1 or d.world == 1
            ctx = contextlib.nullcontext() if sync else objective.no_sync()
            with ctx:
                with autocast():
                    rows = target_rows(batch, head_full, draft_ids, drafter.t2d)
                    loss, results = objective(batch, rows, k, scales)
                finite &= bool(torch.isfinite(loss.detach()))
                loss.backward()
            total_loss += float(loss.detach()) / d.world
            for i, r in enumerate(results):
                step_loss[i] += float(r.loss_sum.detach())
                step_correct[i] += r.correct
        grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), config.grad_clip)
        stats = torch.tensor([total_loss, float(not finite), *step_loss, *step_correct], dtype=torch.float64)
        if d.world > 1:
            stats = stats.to(_comm_device(device))
            dist.all_reduce(stats)
            stats = stats.cpu()
        if stats[1] > 0 or not bool(torch.isfinite(grad_norm)):
            ids = [store.sample_ids[i] for b in batches for i in b.indices]
            raise NonFiniteLoss(
                f"step {step + 1}: non-finite {'loss' if stats[1] > 0 else 'gradient norm'} on samples {ids[:8]}; "
                f"stopped before the optimizer step; the last good checkpoint is {ckpts.latest()}")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        step += 1
        tokens_done += int(ntok)
        c = counts.clamp(min=1).tolist()
        rec = {"step": step, "loss": float(stats[0]), "lr": lr_used, "grad_norm": float(grad_norm),
               "tokens": int(ntok)}
        history.append(rec)
        emit({"kind": "train", **rec, "total_steps": total, "epoch": stream.epoch, "batches": micro,
              "step_loss": [float(stats[2 + i]) / c[i] for i in range(k)],
              "step_acc": [float(stats[2 + k + i]) / c[i] for i in range(k)]})
        if step % config.log_every == 0 and d.rank == 0:
            rate = (tokens_done - tokens_at_start) / max(clock() - t_loop, 1e-9)
            log.info("step %d/%d loss %.4f lr %.2e acc0 %.3f %.0f tok/s", step, total, rec["loss"], lr_used,
                     float(stats[2 + k]) / c[0], rate)
        out_of_time = config.max_minutes is not None and (clock() - t_start) / 60.0 >= config.max_minutes
        if d.world > 1:
            flag = torch.tensor(float(out_of_time), device=_comm_device(device))
            dist.broadcast(flag, src=0)
            out_of_time = bool(flag.cpu())
        if config.eval_every and step % config.eval_every == 0 and step < total:
            last_eval, last_eval_step = run_eval(), step
        if out_of_time and step < total:
            status = "time_budget"
            break
        if step % config.save_every == 0 and step < total:
            save(last_eval)
    if last_eval is None or last_eval_step != step:
        last_eval = run_eval() or last_eval
    path = save(last_eval)
    elapsed = clock() - t_start
    result = TrainResult(status=status, step=step, total_steps=total, run_dir=str(run_dir),
                         checkpoint=str(path or ckpts.latest()), train_tokens=tokens_done, elapsed_s=elapsed,
                         tokens_per_s=(tokens_done - tokens_at_start) / max(clock() - t_loop, 1e-9),
                         train_seconds=seconds_before + clock() - t_loop, eval=last_eval, history=history)
    if d.rank == 0:
        contract.atomic_write_bytes(run_dir / "result.json", json.dumps(result.to_dict(), indent=1).encode())
    return result


def _finished(run_dir: Path, d: Dist, resume, total: int) -> TrainResult:
    st = resume.state
    seconds = float(st.get("train_seconds", 0.0))
    result = TrainResult(status="done", step=resume.step, total_steps=total, run_dir=str(run_dir),
                         checkpoint=str(resume.path), train_tokens=int(st["train_tokens"]), elapsed_s=seconds,
                         tokens_per_s=int(st["train_tokens"]) / max(seconds, 1e-9), train_seconds=seconds,
                         eval=st.get("last_eval"), history=st["history"])
    if d.rank == 0 and not (run_dir / "result.json").is_file():
        contract.atomic_write_bytes(run_dir / "result.json", json.dumps(result.to_dict(), indent=1).encode())
    return result


def _check_resume(state: dict, config: TrainConfig, fingerprint: str, target_config: dict) -> None:
    saved = state["config"]
    drift = config_drift(saved, config.drift_view(), mutable=RESUME_MUTABLE)
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
