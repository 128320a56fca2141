"""torchrun DDP (gloo, 2 CPU processes) computes what 1 process computes on the same global batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from eaglenest import contract
from eaglenest.drafter.checkpoint import CheckpointManager
from eaglenest.drafter.config import TrainConfig
from eaglenest.drafter.train import train
from eaglenest.engines.pool import free_port
from eaglenest.extraction.ledger import Ledger, LedgerEntry, mask_to_spans
from eaglenest.store import ExtractionStore


def write_extraction(store, root) -> None:
    """The in-memory store as an extraction folder (capture/ shards + ledger.jsonl)."""
    ledger = Ledger(root)
    entries = []
    for i in range(len(store)):
        s = store[i]
        shard = contract.Shard(s.sample_id, s.input_ids, s.aux_hidden, s.final_hidden, store.provenance)
        path = contract.write_shard(ledger.capture_dir, shard)
        data = path.read_bytes()
        entries.append(LedgerEntry(sample_id=s.sample_id, shard=path.name, sha256=contract.sha256_bytes(data),
                                   bytes=len(data), num_tokens=int(s.input_ids.numel()),
                                   loss_tokens=int(s.loss_mask.sum()), loss_spans=mask_to_spans(s.loss_mask.tolist())))
    ledger.append(entries)


COMMON = dict(draft_vocab_size=200, ttt_steps=3, max_steps=3, max_tokens=256, max_seq_len=128, warmup_steps=1,
              lr=2e-3, eval_fraction=0.15, eval_max_samples=6, eval_every=0, save_every=10, precision="fp32", seed=5,
              threads=1)


def torchrun_train(extraction, out, target, *, grad_accum: int, **over) -> subprocess.CompletedProcess:
    """`eaglenest train` under torchrun with 2 gloo processes (the options of COMMON, updated by ``over``)."""
    cfg = {**COMMON, **over}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "eaglenest", "train", "--store", str(extraction),
           "--out", str(out), "--target", str(target), "--grad-accum", str(grad_accum)]
    for key, value in cfg.items():
        cmd += ["--set", f"{key}={json.dumps(value)}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)


def train_events(run_dir) -> list[dict]:
    events = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [e for e in events if e["kind"] == "train"]


def assert_same_weights(a, b) -> None:
    wa, wb = CheckpointManager(a).load().model, CheckpointManager(b).load().model
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=1e-5, atol=1e-6, msg=name)


def test_two_gloo_processes_equal_one_process_on_the_same_global_batch(tmp_path, tiny_model_dir, drafter_store):
    extraction = tmp_path / "extraction"
    write_extraction(drafter_store, extraction)
    store = ExtractionStore(extraction)
    assert store.sample_ids == sorted(drafter_store.sample_ids) and store[3].loss_mask.any()
    one = train(TrainConfig(store=str(extraction), target=str(tiny_model_dir), out_dir=str(tmp_path / "one"),
                            grad_accum=2, **COMMON), store=store)
    proc = torchrun_train(extraction, tmp_path / "two", tiny_model_dir, grad_accum=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "result.json").read_text())
    steps, ref = train_events(tmp_path / "two"), train_events(tmp_path / "one")
    assert [e["batches"] for e in steps] == [e["batches"] for e in ref]  # same global micro-batches per step
    assert all(len(e["batches"]) == 2 for e in ref)
    for a, b in zip(ref, steps, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * max(1.0, abs(a["loss"])), (a["step"], a["loss"], b["loss"])
        assert a["lr"] == b["lr"] and a["tokens"] == b["tokens"]
    assert two["step"] == one.step == 3
    assert_same_weights(tmp_path / "one", tmp_path / "two")


def test_a_resume_on_another_number_of_processes_continues_the_same_run_or_is_refused(tmp_path, tiny_model_dir,
                                                                                      drafter_store):
    """1 process with grad_accum 2 killed at step 3 (step 2 saved), resumed by 2 processes with grad_accum 1 (the
    same global step): it ends where the uninterrupted 1-process run ends. With grad_accum 2 (twice the global
    step): refused before any step, naming the fix."""
    extraction = tmp_path / "extraction"
    write_extraction(drafter_store, extraction)
    store = ExtractionStore(extraction)
    base = dict(store=str(extraction), target=str(tiny_model_dir), grad_accum=2, **{**COMMON, "save_every": 2})
    train(TrainConfig(out_dir=str(tmp_path / "full"), **base), store=store)

    class Kill(BaseException):
        pass

    def kill_at_3(e):
        if e["kind"] == "train" and e["step"] == 3:
            raise Kill

    with pytest.raises(Kill):
        train(TrainConfig(out_dir=str(tmp_path / "cut"), **base), store=store, callback=kill_at_3)
    refused = torchrun_train(extraction, tmp_path / "cut", tiny_model_dir, grad_accum=2, save_every=2)
    assert refused.returncode != 0
    assert "took 2 micro-batches per step (grad_accum 2 x 1 process(es)); this run would take 4" in refused.stderr
    assert len(train_events(tmp_path / "cut")) == 3  # nothing was stepped
    resumed = torchrun_train(extraction, tmp_path / "cut", tiny_model_dir, grad_accum=1, save_every=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    last = {e["step"]: e for e in train_events(tmp_path / "cut")}  # step 3 was redone from the step-2 checkpoint
    ref = train_events(tmp_path / "full")
    assert [last[e["step"]]["batches"] for e in ref] == [e["batches"] for e in ref]
    assert abs(last[3]["loss"] - ref[-1]["loss"]) <= 1e-5 * max(1.0, abs(ref[-1]["loss"]))
    assert_same_weights(tmp_path / "full", tmp_path / "cut")
