"""Drafter training loop: store -> TTT objective -> AdamW steps, checkpointed and resumable exactly.

Owns :func:`train` and :class:`Trainer`, the run as named steps: ``setup`` builds (or restores) the
draft vocabulary and the drafter, the optimizer and the step-based schedule; ``resume`` restores a
checkpoint; ``step`` runs one optimizer step of ``grad_accum x world_size`` micro-batches from the global
:class:`~eaglenest.drafter.data.BatchStream` (rank r takes micro-batches ``r*ga .. r*ga+ga-1``);
``evaluate`` scores the held-out split and every extra eval set (never trained on); ``save`` checkpoints.
The schedule (total steps = epochs x micro-batches per epoch / per step, unless max_steps) always
finishes; the time budget is only a safety stop and the result says so.

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
import json
import logging
import math
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from eaglenest import models as model_lib
from eaglenest.atomic import atomic_write_bytes
from eaglenest.drafter.checkpoint import CheckpointManager
from eaglenest.drafter.config import TrainConfig
from eaglenest.drafter.data import BatchStream, Lookahead, stage
from eaglenest.drafter.evaluate import evaluate
from eaglenest.drafter.model import DrafterConfig, Eagle3Drafter
from eaglenest.drafter.target import load_target_tensors
from eaglenest.drafter.train_state import (
    HELDOUT,
    Dist,
    NonFiniteLoss,
    ResumeRefused,
    TrainResult,
    build_vocab,
    check_resume,
    check_store_target,
    comm_device,
    continued_start,
    describe_eval,
    finished_result,
    lr_factor,
    open_eval_sets,
    resolve_device,
    schedule_steps,
    starting_drafter,
    store_fingerprint,
)
from eaglenest.drafter.ttt import TTTObjective, step_counts, target_rows
from eaglenest.drafter.vocab import DraftVocab
from eaglenest.store import split_indices
from eaglenest.store.extraction import open_samples as open_store

__all__ = ["HELDOUT", "NonFiniteLoss", "ResumeRefused", "TrainResult", "Trainer", "lr_factor", "store_fingerprint",
           "train"]

log = logging.getLogger(__name__)


def train(config: TrainConfig, *, store=None, eval_stores: dict | None = None,
          callback: Callable[[dict], None] | None = None, clock: Callable[[], float] = time.monotonic) -> TrainResult:
    """Train (or resume) a drafter per ``config``; returns where the result is and its metrics.

    ``store`` / ``eval_stores`` override opening ``config.store`` / ``config.eval_sets`` (tests pass
    in-memory stores). ``callback`` gets
    every train/eval/checkpoint event dict on rank 0 (an exception from it aborts like a crash).
    """
    d = Dist.from_env()
    own_group = d.world > 1 and not dist.is_initialized()
    if own_group:
        dist.init_process_group("nccl" if torch.cuda.is_available() and config.device != "cpu" else "gloo")
    threads = torch.get_num_threads()
    if config.threads:
        torch.set_num_threads(config.threads)
    try:
        trainer = Trainer.setup(config, d, store=store, eval_stores=eval_stores, callback=callback, clock=clock)
        if trainer.resume():
            return finished_result(trainer.run_dir, d, trainer.checkpoint, trainer.total)
        return trainer.run()
    finally:
        torch.set_num_threads(threads)
        if own_group:  # the group this call made ends with it (a torchrun worker's C++ teardown could still abort
            # after this: the CLI's train ends its workers with os._exit, eaglenest/cli/train.py)
            dist.destroy_process_group()


class Trainer:
    """One training run as named steps: :meth:`setup` (data, target, vocabulary, drafter, optimizer,
    schedule), :meth:`resume` (restore a checkpoint exactly), :meth:`step` (one optimizer step over
    ``grad_accum x world`` micro-batches), :meth:`evaluate` and :meth:`save`; :meth:`run` loops them."""

    def __init__(self, *, config: TrainConfig, d: Dist, store, eval_stores: dict, callback, clock, device, bf16: bool,
                 train_idx: list[int], eval_idx: list[int], fingerprint: str, tt, ckpts: CheckpointManager,
                 checkpoint, vocab: DraftVocab, dcfg: DrafterConfig, drafter: Eagle3Drafter, objective: nn.Module,
                 optimizer, scheduler, stream: BatchStream, total: int, t_start: float) -> None:
        self.config, self.d, self.store, self.eval_stores = config, d, store, eval_stores
        self.callback, self.clock, self.device, self.bf16 = callback, clock, device, bf16
        self.train_idx, self.eval_idx, self.fingerprint, self.tt = train_idx, eval_idx, fingerprint, tt
        self.ckpts, self.checkpoint, self.vocab, self.dcfg = ckpts, checkpoint, vocab, dcfg
        self.drafter, self.objective, self.optimizer, self.scheduler = drafter, objective, optimizer, scheduler
        self.stream, self.total, self.t_start = stream, total, t_start
        self.run_dir = Path(config.out_dir)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.step_no, self.history, self.tokens_done, self.seconds_before = 0, [], 0, 0.0
        self.head_dtype = torch.bfloat16 if bf16 else torch.float32
        self.head_full = tt.lm_head.to(device=device, dtype=self.head_dtype)  # [V, H] frozen target head
        self.draft_ids = vocab.target_ids.to(device)
        k = config.ttt_steps
        self.weights = [config.step_decay**i for i in range(k)]
        self.t_loop = clock()
        self.tokens_at_start = 0
        self.split = dict.fromkeys(("data_wait", "device_wait", "eval", "save"), 0.0)  # see TrainResult.time_split
        ahead = config.prefetch if config.prefetch is not None else device.type == "cuda"
        self.batches = Lookahead(stream, config.grad_accum * d.world, self._stage_micro,
                                 ahead=config.prefetch_steps if ahead else 0)

    # ---- setup ----------------------------------------------------------------------------------
    @classmethod
    def setup(cls, config: TrainConfig, d: Dist | None = None, *, store=None, eval_stores: dict | None = None,
              callback=None, clock: Callable[[], float] = time.monotonic) -> Trainer:
        """Everything a step needs, from the config (and the latest checkpoint's vocabulary, if any)."""
        d = d or Dist()
        device, bf16 = resolve_device(config, d)
        t_start = clock()
        torch.manual_seed(config.seed)
        random.seed(config.seed)
        store = store if store is not None else open_store(config.store, check_sha256=config.check_store_sha256)
        target_dir = model_lib.resolve_model(config.target)
        check_store_target(store.provenance, target_dir)
        eval_stores = open_eval_sets(config.eval_sets, store.provenance, target_dir, given=eval_stores)
        train_idx, eval_idx = split_indices(store.sample_ids, config.eval_fraction, max_eval=config.eval_max_samples)
        tt = load_target_tensors(target_dir)
        ckpts = CheckpointManager(Path(config.out_dir), keep=config.keep_checkpoints)
        if d.rank == 0:
            ckpts.clean_temporaries()
        checkpoint = ckpts.load() if ckpts.latest() is not None else None
        fingerprint = store_fingerprint(store)
        start = None  # the drafter a new run starts from (init_from); a resumed run has its checkpoint's weights
        if checkpoint is not None:
            check_resume(checkpoint.state, config, fingerprint, tt.config, world=d.world)
            vocab = DraftVocab.from_d2t(checkpoint.model["d2t"], int(tt.config["vocab_size"]))
        elif config.init_from is not None:
            start = starting_drafter(config, target_dir, store.provenance)
            vocab, start = continued_start(config, start, store, train_idx, int(tt.config["vocab_size"]), device, d)
        else:
            vocab = build_vocab(config, store, train_idx, int(tt.config["vocab_size"]), device, d)
        weights = checkpoint.model if checkpoint is not None else start  # either keeps its own MLP width
        width = int(weights["midlayer.mlp.gate_proj.weight"].shape[0]) if weights else config.draft_intermediate_size
        dcfg = DrafterConfig.from_target(tt.config, aux_layer_ids=store.provenance.aux_layer_ids,
                                         draft_vocab_size=vocab.size, intermediate_size=width)
        drafter = Eagle3Drafter(dcfg, embed_weight=tt.embed)
        drafter.load_vocab(vocab.d2t, vocab.t2d)
        if start is not None:
            drafter.load_state_dict(start)
        if config.init == "target":
            drafter.init_from_target(tt)
        drafter.to(device)
        objective: nn.Module = TTTObjective(drafter)
        if d.world > 1:
            objective = nn.parallel.DistributedDataParallel(
                objective, broadcast_buffers=False, device_ids=[device.index] if device.type == "cuda" else None)
        # fused: the whole update is one kernel (per-parameter or foreach AdamW queues 8 ops or more, and reads
        # each step count back to the host); AdamW's math, equal to the unfused one to fp32 rounding
        optimizer = torch.optim.AdamW(drafter.parameters(), lr=config.lr, betas=(0.9, 0.95),
                                      weight_decay=config.weight_decay, fused=True)
        lengths = [min(int(store.num_tokens[i]), config.max_seq_len) for i in train_idx]
        stream = BatchStream(lengths, max_tokens=config.max_tokens, seed=config.seed)
        total = schedule_steps(config, stream.batches_per_epoch(), d.world)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(
            s, warmup=config.warmup_steps, total=total, min_ratio=config.min_lr_ratio))
        return cls(config=config, d=d, store=store, eval_stores=eval_stores, callback=callback, clock=clock,
                   device=device, bf16=bf16, train_idx=train_idx, eval_idx=eval_idx, fingerprint=fingerprint, tt=tt,
                   ckpts=ckpts, checkpoint=checkpoint, vocab=vocab, dcfg=dcfg, drafter=drafter, objective=objective,
                   optimizer=optimizer, scheduler=scheduler, stream=stream, total=total, t_start=t_start)

    # ---- resume ---------------------------------------------------------------------------------
    def resume(self) -> bool:
        """Restore weights, optimizer, schedule, data position and RNG from the latest checkpoint.
        Returns True when that checkpoint already finished the schedule (nothing left to compute)."""
        ck = self.checkpoint
        if ck is None:
            return False
        self.drafter.load_state_dict(ck.model)
        self.step_no, self.history = ck.step, ck.state["history"]
        self.tokens_done = self.tokens_at_start = int(ck.state["train_tokens"])
        self.seconds_before = float(ck.state.get("train_seconds", 0))
        if self.step_no >= self.total:
            return True
        # the implementation (fused or not) is this code's choice, not the checkpoint's: loading takes a saved
        # group's settings, and a fused AdamW keeps its step counts on the parameters' device
        mine = {key: self.optimizer.param_groups[0][key] for key in ("fused", "foreach")}
        self.optimizer.load_state_dict({**ck.optimizer,
                                        "param_groups": [{**g, **mine} for g in ck.optimizer["param_groups"]]})
        self.scheduler.load_state_dict(ck.trainer["scheduler"])
        self.stream.load_state_dict(ck.trainer["stream"])
        torch.set_rng_state(ck.trainer["rng_torch"])
        random.setstate(ck.trainer["rng_python"])
        log.info("resumed %s at step %d/%d", ck.path, self.step_no, self.total)
        return False

    # ---- step -----------------------------------------------------------------------------------
    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()

    def _stage_micro(self, micro: list[list[int]]) -> list:
        """This rank's micro-batches of one step, padded on the CPU (on the look-ahead thread when
        prefetching; page-locked for a GPU)."""
        cfg, r = self.config, self.d.rank
        out = []
        for mb in micro[r * cfg.grad_accum : (r + 1) * cfg.grad_accum]:
            idx = [self.train_idx[j] for j in mb]
            out.append(stage([self.store[i] for i in idx], idx, max_seq_len=cfg.max_seq_len, dtype=self.head_dtype,
                             pin_memory=self.device.type == "cuda"))
        return out

    def step(self) -> dict:
        """One optimizer step; returns its train event. Raises NonFiniteLoss before stepping on NaN/inf.

        Nothing is read back from the device until the step's losses and gradients are computed: counts and
        sizes come from the host copies of the batches (their row plans), and the step's statistics come back
        in one transfer, so the host keeps queueing kernels while the device computes."""
        cfg, d, k, store = self.config, self.d, self.config.ttt_steps, self.store
        t0 = time.perf_counter()
        micro, staged = self.batches.next(following=self.total - self.step_no - 1)
        self.split["data_wait"] += time.perf_counter() - t0
        counts = sum(step_counts(s.loss_mask, k) for s in staged).to(torch.float64)  # [k], on the host
        ntok = torch.tensor(float(sum(int(s.lengths.sum()) for s in staged)), dtype=torch.float64)
        batches = [s.to_batch(self.device) for s in staged]
        if d.world > 1:
            packed = self._all_reduce(torch.cat([counts, ntok.view(1)]))
            counts, ntok = packed[:k], packed[k]
        scales = torch.tensor([w * d.world / max(float(c), 1.0) for w, c in zip(self.weights, counts.tolist(),
                                                                                  strict=True)])
        scales = scales.to(self.device, non_blocking=True)  # [k] fp32 (as a Python float scale is applied)
        lr_used = self.optimizer.param_groups[0]["lr"]
        total_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        nonfinite = total_loss
        step_loss = step_correct = torch.zeros(k, dtype=torch.float64, device=self.device)
        for a, batch in enumerate(batches):
            sync = a == len(batches) - 1 or d.world == 1
            with contextlib.nullcontext() if sync else self.objective.no_sync():
                with self.autocast():
                    rows = target_rows(batch, self.head_full, self.draft_ids, self.drafter.t2d)
                    loss, results = self.objective(batch, rows, k, scales)
                loss.backward()
            done = loss.detach().double()
            total_loss = total_loss + done / d.world
            nonfinite = nonfinite + (~torch.isfinite(done)).double()
            step_loss = step_loss + results.loss_sum.detach().double()
            step_correct = step_correct + results.correct.double()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.grad_clip)
        values = torch.cat([torch.stack([total_loss, nonfinite]), step_loss, step_correct, grad_norm.double()[None]])
        t0 = time.perf_counter()
        values = values.cpu()  # the step's one read: the host waits here for the device's math
        self.split["device_wait"] += time.perf_counter() - t0
        stats, grad_norm = values[:-1], float(values[-1])
        if d.world > 1:
            stats = self._all_reduce(stats)
        if stats[1] > 0 or not math.isfinite(grad_norm):
            ids = [store.sample_ids[i] for b in batches for i in b.indices]
            raise NonFiniteLoss(
                f"step {self.step_no + 1}: non-finite {'loss' if stats[1] > 0 else 'gradient norm'} on samples "
                f"{ids[:8]}; stopped before the optimizer step; the last good checkpoint is {self.ckpts.latest()}")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step_no += 1
        self.tokens_done += int(ntok)
        c = counts.clamp(min=1).tolist()
        rec = {"step": self.step_no, "loss": float(stats[0]), "lr": lr_used, "grad_norm": grad_norm,
               "tokens": int(ntok)}
        self.history.append(rec)
        event = {"kind": "train", **rec, "total_steps": self.total, "epoch": self.batches.epoch, "batches": micro,
                 "step_loss": [float(stats[2 + i]) / c[i] for i in range(k)],
                 "step_acc": [float(stats[2 + k + i]) / c[i] for i in range(k)]}
        self.emit(event)
        if self.step_no % cfg.log_every == 0 and d.rank == 0:
            rate = (self.tokens_done - self.tokens_at_start) / max(self.clock() - self.t_loop, 1e-9)
            log.info("step %d/%d loss %.4f lr %.2e acc0 %.3f %.0f tok/s", self.step_no, self.total, rec["loss"],
                     lr_used, event["step_acc"][0], rate)
        return event

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        t = t.to(comm_device(self.device))
        dist.all_reduce(t)
        return t.cpu()

    # ---- evaluate and save ----------------------------------------------------------------------
    def emit(self, event: dict) -> None:
        if self.d.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(event) + "\n")
            if self.callback is not None:
                self.callback(event)

    def evaluate(self) -> dict | None:
        """Held-out split and every eval set (rank 0); logs one event per set. Returns {set: metrics}."""
        if self.d.rank != 0:
            return None
        cfg = self.config
        k = cfg.eval_steps or cfg.ttt_steps
        targets = [(HELDOUT, self.store, self.eval_idx)] + [
            (name, st, list(range(min(len(st), cfg.eval_max_samples or len(st)))))
            for name, st in self.eval_stores.items()]
        out, t0 = {}, time.perf_counter()
        for name, store, idx in targets:
            if not idx:
                continue
            res = evaluate(self.drafter, store, idx, head_full=self.head_full, k=k, max_tokens=cfg.max_tokens,
                           max_seq_len=cfg.max_seq_len, dtype=self.head_dtype, autocast=self.autocast()).to_dict()
            self.emit({"kind": "eval", "set": name, "step": self.step_no, "train_tokens": self.tokens_done, **res})
            log.info("eval %s step %d: %s", name, self.step_no, describe_eval(res, k))
            out[name] = res
        self.split["eval"] += time.perf_counter() - t0
        return out or None

    def save(self, last_eval: dict | None) -> Path | None:
        path, t0 = None, time.perf_counter()
        if self.d.rank == 0:
            trainer_state = {"scheduler": self.scheduler.state_dict(), "stream": self.batches.state_dict(),
                             "rng_torch": torch.get_rng_state(), "rng_python": random.getstate()}
            state = {"config": self.config.drift_view(), "drafter_config": self.dcfg.to_dict(),
                     "store_fingerprint": self.fingerprint, "provenance": json.loads(self.store.provenance.to_json()),
                     "target": self.tt.config, "total_steps": self.total, "vocab_coverage": self.vocab.coverage,
                     "eval_samples": len(self.eval_idx), "history": self.history, "train_tokens": self.tokens_done,
                     "last_eval": (last_eval or {}).get(HELDOUT), "last_eval_sets": last_eval,
                     "vocab_size": self.vocab.size, "train_seconds": self.seconds_before + self.clock() - self.t_loop,
                     "world_size": self.d.world}
            path = self.ckpts.save(step=self.step_no, model=self.drafter.state_dict(),
                                   optimizer=self.optimizer.state_dict(), trainer=trainer_state, state=state)
            self.emit({"kind": "checkpoint", "step": self.step_no, "path": str(path)})
        if self.d.world > 1:
            dist.barrier()
        self.split["save"] += time.perf_counter() - t0
        return path

    # ---- the loop -------------------------------------------------------------------------------
    def out_of_time(self) -> bool:
        late = self.config.max_minutes is not None and (self.clock() - self.t_start) / 60.0 >= self.config.max_minutes
        if self.d.world > 1:
            flag = torch.tensor(float(late), device=comm_device(self.device))
            dist.broadcast(flag, src=0)
            late = bool(flag.cpu())
        return late

    def run(self) -> TrainResult:
        cfg = self.config
        status, last_eval, last_eval_step = "done", None, -1
        self.t_loop, self.t_split = self.clock(), time.perf_counter()
        try:
            while self.step_no < self.total:
                self.step()
                late = self.out_of_time()
                if cfg.eval_every and self.step_no % cfg.eval_every == 0 and self.step_no < self.total:
                    last_eval, last_eval_step = self.evaluate(), self.step_no
                if late and self.step_no < self.total:
                    status = "time_budget"
                    break
                if self.step_no % cfg.save_every == 0 and self.step_no < self.total:
                    self.save(last_eval)
        finally:
            self.batches.close()
        if last_eval is None or last_eval_step != self.step_no:
            last_eval = self.evaluate() or last_eval
        path = self.save(last_eval)
        now = self.clock()
        split = {name: round(v, 2) for name, v in self.split.items()}
        split["other"] = round(max(time.perf_counter() - self.t_split - sum(self.split.values()), 0.0), 2)
        log.info("loop time split (s): %s", split)
        note = ("schedule finished" if status == "done" else
                f"stopped by the time budget (a safety stop, max_minutes={cfg.max_minutes}) at step "
                f"{self.step_no} of {self.total}: the schedule did NOT finish; run again to resume")
        result = TrainResult(
            status=status, step=self.step_no, total_steps=self.total, run_dir=str(self.run_dir),
            checkpoint=str(path or self.ckpts.latest()), train_tokens=self.tokens_done, elapsed_s=now - self.t_start,
            tokens_per_s=(self.tokens_done - self.tokens_at_start) / max(now - self.t_loop, 1e-9),
            train_seconds=self.seconds_before + now - self.t_loop, eval=(last_eval or {}).get(HELDOUT),
            eval_sets={k: v for k, v in (last_eval or {}).items() if k != HELDOUT}, history=self.history, note=note,
            time_split=split)
        if self.d.rank == 0:
            atomic_write_bytes(self.run_dir / "result.json", json.dumps(result.to_dict(), indent=1).encode())
        return result


