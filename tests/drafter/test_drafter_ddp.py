"""torchrun DDP (gloo, 2 CPU processes) computes what 1 process computes on the same global batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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


def test_two_gloo_processes_equal_one_process_on_the_same_global_batch(tmp_path, tiny_model_dir, drafter_store):
    extraction = tmp_path / "extraction"
    write_extraction(drafter_store, extraction)
    store = ExtractionStore(extraction)
    assert store.sample_ids == sorted(drafter_store.sample_ids) and store[3].loss_mask.any()
    common = dict(store=str(extraction), target=str(tiny_model_dir), draft_vocab_size=200, ttt_steps=3, max_steps=3,
                  max_tokens=256, max_seq_len=128, warmup_steps=1, lr=2e-3, eval_fraction=0.15, eval_max_samples=6,
                  eval_every=0, save_every=10, precision="fp32", seed=5, threads=1)
    one = train(TrainConfig(out_dir=str(tmp_path / "one"), grad_accum=2, **common), store=store)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "eaglenest", "train", "--store", str(extraction),
           "--out", str(tmp_path / "two"), "--target", str(tiny_model_dir), "--grad-accum", "1"]
    for key in ("draft_vocab_size", "ttt_steps", "max_steps", "max_tokens", "max_seq_len", "warmup_steps", "lr",
                "eval_fraction", "eval_max_samples", "eval_every", "save_every", "precision", "seed", "threads"):
        cmd += ["--set", f"{key}={json.dumps(common[key])}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "result.json").read_text())
    steps = [json.loads(ln) for ln in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    steps = [e for e in steps if e["kind"] == "train"]
    ref = [json.loads(ln) for ln in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    ref = [e for e in ref if e["kind"] == "train"]
    assert [e["batches"] for e in steps] == [e["batches"] for e in ref]  # same global micro-batches per step
    assert all(len(e["batches"]) == 2 for e in ref)
    for a, b in zip(ref, steps, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * max(1.0, abs(a["loss"])), (a["step"], a["loss"], b["loss"])
        assert a["lr"] == b["lr"] and a["tokens"] == b["tokens"]
    assert two["step"] == one.step == 3
    wa = CheckpointManager(tmp_path / "one").load().model
    wb = CheckpointManager(tmp_path / "two").load().model
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=1e-5, atol=1e-6, msg=name)
