"""On a GPU, a training step reads nothing back from the device until its end: every count and size comes
from the host copy of the batch (its row plan), so the host keeps queueing kernels while the device computes
(a read in the middle of a step, such as a boolean-mask index, serialises host and device time)."""

from __future__ import annotations

import warnings

import pytest
import torch

from eaglenest.drafter.config import TrainConfig
from eaglenest.drafter.train import Trainer

pytestmark = [pytest.mark.device,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_a_training_step_reads_the_device_back_once(tmp_path, tiny_model_dir, drafter_store):
    cfg = TrainConfig(store="memory", out_dir=str(tmp_path / "run"), target=str(tiny_model_dir), draft_vocab_size=150,
                      ttt_steps=4, max_steps=4, max_tokens=512, max_seq_len=128, warmup_steps=1, eval_fraction=0.0,
                      eval_every=0, device="cuda", prefetch=False)
    t = Trainer.setup(cfg, store=drafter_store)
    t.step()  # the first step warms up the kernels and the allocator
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            event = t.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in seen if "synchroniz" in str(w.message).lower()]
    assert len(syncs) == 1, syncs  # the step's statistics, read once before the optimizer step
    assert event["step"] == 2 and event["tokens"] > 0 and 0.0 <= event["step_acc"][0] <= 1.0
