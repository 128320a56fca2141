"""Training: resume is exact, NaN stops before the step, drift is refused, a torn save leaves a good latest."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from eaglenest.drafter import checkpoint as ckpt_mod
from eaglenest.drafter.checkpoint import CheckpointManager
from eaglenest.drafter.config import TrainConfig
from eaglenest.drafter.train import NonFiniteLoss, ResumeRefused, train
from eaglenest.store import StoreSample
from eaglenest.testing.fake_store import MemoryStore


class Crash(BaseException):
    """Stands for a kill: nothing after it runs (no final checkpoint)."""


def config(tmp_path, tiny_model_dir, **over) -> TrainConfig:
    base = dict(store="memory", out_dir=str(tmp_path / "run"), target=str(tiny_model_dir), draft_vocab_size=200,
                ttt_steps=3, max_steps=6, max_tokens=256, max_seq_len=128, grad_accum=2, warmup_steps=2, lr=2e-3,
                eval_fraction=0.15, eval_max_samples=6, eval_every=0, save_every=2, precision="fp32", seed=3, threads=1)
    base.update(over)
    return TrainConfig(**base)


def train_events(cfg, store, stop_at=None):
    events = []

    def on_event(e):
        events.append(e)
        if stop_at is not None and e["kind"] == "train" and e["step"] == stop_at:
            raise Crash

    try:
        result = train(cfg, store=store, callback=on_event)
    except Crash:
        result = None
    return result, [e for e in events if e["kind"] == "train"]


def weights(run_dir):
    return CheckpointManager(run_dir).load().model


def test_interrupted_then_resumed_equals_uninterrupted(tmp_path, tiny_model_dir, drafter_store):
    full_cfg = config(tmp_path / "a", tiny_model_dir)
    full, full_steps = train_events(full_cfg, drafter_store)
    assert full.status == "done" and full.step == 6
    cut_cfg = config(tmp_path / "b", tiny_model_dir)
    none, first = train_events(cut_cfg, drafter_store, stop_at=5)  # killed after step 5; last save at 4
    assert none is None and [e["step"] for e in first] == [1, 2, 3, 4, 5]
    resumed, second = train_events(cut_cfg, drafter_store)
    assert [e["step"] for e in second] == [5, 6]  # step 5 is redone from the step-4 checkpoint
    for a, b in zip(full_steps, first[:4] + second, strict=True):
        assert (a["step"], a["batches"], a["lr"]) == (b["step"], b["batches"], b["lr"])
        assert a["loss"] == b["loss"], (a["step"], a["loss"], b["loss"])
    assert [h["loss"] for h in full.history] == [h["loss"] for h in resumed.history]
    wa, wb = weights(full_cfg.out_dir), weights(cut_cfg.out_dir)
    assert all(torch.equal(wa[n], wb[n]) for n in wa)
    assert full.eval == resumed.eval and full.eval["anchors"] > 0


def test_a_checkpoint_of_an_unfused_optimizer_resumes_fused_and_exactly(tmp_path, tiny_model_dir, drafter_store):
    """A checkpoint written before the trainer's AdamW was fused (its groups say fused=None) resumes the same run,
    with the fused optimizer: the implementation is the code's choice, not the checkpoint's."""
    full_cfg = config(tmp_path / "a", tiny_model_dir, max_steps=4)
    full, _ = train_events(full_cfg, drafter_store)
    cut_cfg = config(tmp_path / "b", tiny_model_dir, max_steps=4)
    train_events(cut_cfg, drafter_store, stop_at=3)  # the last save at step 2
    latest = CheckpointManager(cut_cfg.out_dir).latest()
    opt = torch.load(latest / "optimizer.pt", weights_only=True)
    assert all(g["fused"] for g in opt["param_groups"])
    opt["param_groups"] = [{**g, "fused": None, "foreach": None} for g in opt["param_groups"]]
    torch.save(opt, latest / "optimizer.pt")
    resumed, second = train_events(cut_cfg, drafter_store)
    assert [e["step"] for e in second] == [3, 4]
    assert [h["loss"] for h in full.history] == [h["loss"] for h in resumed.history]
    wa, wb = weights(full_cfg.out_dir), weights(cut_cfg.out_dir)
    assert all(torch.equal(wa[n], wb[n]) for n in wa)
    opt = torch.load(CheckpointManager(cut_cfg.out_dir).latest() / "optimizer.pt", weights_only=True)
    assert all(g["fused"] for g in opt["param_groups"])


@pytest.mark.parametrize("steps", [1, 3])
def test_look_ahead_computes_the_same_run_and_resumes_exactly(tmp_path, tiny_model_dir, drafter_store, steps):
    """Batches staged on helper threads 1 or 3 steps ahead: the same batches, losses and weights as reading
    them in the step; a run cut after step 5 (its stream already advanced for step 6) resumes exactly."""
    plain, plain_steps = train_events(config(tmp_path / "a", tiny_model_dir, prefetch=False), drafter_store)
    ahead_cfg = config(tmp_path / "b", tiny_model_dir, prefetch=True, prefetch_steps=steps)
    ahead, ahead_steps = train_events(ahead_cfg, drafter_store)
    assert ahead.status == "done" and ahead.step == 6
    assert [(e["batches"], e["loss"]) for e in plain_steps] == [(e["batches"], e["loss"]) for e in ahead_steps]
    wa, wb = weights(tmp_path / "a" / "run"), weights(ahead_cfg.out_dir)
    assert all(torch.equal(wa[n], wb[n]) for n in wa)
    cut_cfg = config(tmp_path / "c", tiny_model_dir, prefetch=True, prefetch_steps=steps)
    train_events(cut_cfg, drafter_store, stop_at=5)
    resumed, second = train_events(cut_cfg, drafter_store)
    assert [e["step"] for e in second] == [5, 6]
    assert [(e["batches"], e["loss"]) for e in second] == [(e["batches"], e["loss"]) for e in plain_steps[4:]]
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in plain.history]


def test_resume_with_changed_config_is_refused_naming_the_field(tmp_path, tiny_model_dir, drafter_store):
    cfg = config(tmp_path, tiny_model_dir, max_steps=2)
    train(cfg, store=drafter_store)
    with pytest.raises(ResumeRefused, match=r"lr: checkpoint 0\.002, now 0\.001"):
        train(cfg.model_copy(update={"lr": 1e-3}), store=drafter_store)
    with pytest.raises(ResumeRefused, match="ttt_steps"):
        train(cfg.model_copy(update={"ttt_steps": 4}), store=drafter_store)
    other = MemoryStore([drafter_store[i] for i in range(len(drafter_store) - 1)], drafter_store.provenance)
    with pytest.raises(ResumeRefused, match="store's content"):
        train(cfg, store=other)
    # pacing fields may change: a resume of a finished run does no step and keeps the weights
    again = train(cfg.model_copy(update={"log_every": 3, "max_minutes": 5.0}), store=drafter_store)
    assert again.step == 2 and again.history == train(cfg, store=drafter_store).history


def test_nan_loss_stops_before_the_optimizer_step(tmp_path, tiny_model_dir, drafter_store, monkeypatch):
    import eaglenest.drafter.ttt as ttt_mod
    real_forward, calls, steps = ttt_mod.ttt_forward, [], []

    def nan_on_third_micro_batch(model, batch, rows, k):
        results = real_forward(model, batch, rows, k)
        calls.append(1)
        if len(calls) == 3:  # step 1's loss sum turns NaN
            nan_at_1 = torch.ones(k).index_fill_(0, torch.tensor([1]), float("nan"))
            results = dataclasses.replace(results, loss_sum=results.loss_sum * nan_at_1)
        return results

    real_step = torch.optim.AdamW.step

    def counting_step(self, *a, **kw):
        steps.append(1)
        return real_step(self, *a, **kw)

    monkeypatch.setattr(ttt_mod, "ttt_forward", nan_on_third_micro_batch)
    monkeypatch.setattr(torch.optim.AdamW, "step", counting_step)
    cfg = config(tmp_path, tiny_model_dir, max_steps=6, save_every=2, grad_accum=1)
    with pytest.raises(NonFiniteLoss, match=r"step 3: non-finite loss.*before the optimizer step"):
        train(cfg, store=drafter_store)
    assert len(steps) == 2  # steps 1 and 2 happened, step 3 did not
    latest = CheckpointManager(cfg.out_dir).load()
    assert latest.step == 2 and all(torch.isfinite(v).all() for v in latest.model.values() if v.is_floating_point())
    monkeypatch.setattr(ttt_mod, "ttt_forward", real_forward)
    assert train(cfg, store=drafter_store).step == 6  # the run resumes from the last good checkpoint


def test_store_with_nan_hidden_states_is_refused_on_load(tmp_path, tiny_model_dir, drafter_store):
    s = drafter_store[0]
    final = s.final_hidden.clone()
    final[0, 0] = float("inf")
    samples = [StoreSample(s.sample_id, s.input_ids, s.loss_mask, s.aux_hidden, final)]
    samples += [drafter_store[i] for i in range(1, len(drafter_store))]
    from eaglenest.contract import ContractError

    with pytest.raises(ContractError, match="non-finite hidden states"):
        train(config(tmp_path, tiny_model_dir, max_steps=40, eval_fraction=0.0),
              store=MemoryStore(samples, drafter_store.provenance))


def test_crash_while_saving_a_checkpoint_leaves_a_loadable_latest(tmp_path, tiny_model_dir, drafter_store,
                                                                  monkeypatch):
    cfg = config(tmp_path, tiny_model_dir, max_steps=6, save_every=2)
    real_commit = CheckpointManager._commit
    calls = []

    def dying_commit(self, tmp, final):
        calls.append(final.name)
        if final.name == "step-00000004":  # files written and fsynced, rename not done: the process dies
            raise Crash
        real_commit(self, tmp, final)

    monkeypatch.setattr(CheckpointManager, "_commit", dying_commit)
    with pytest.raises(Crash):
        train(cfg, store=drafter_store)
    mgr = CheckpointManager(cfg.out_dir)
    assert [p.name for p in mgr.dir.iterdir() if ".tmp-" in p.name]  # the torn save is still there
    assert mgr.latest().name == "step-00000002"
    assert mgr.load().step == 2
    monkeypatch.setattr(CheckpointManager, "_commit", real_commit)
    resumed = train(cfg, store=drafter_store)  # cleans the temporary, resumes from step 2
    assert resumed.step == 6 and not [p for p in mgr.dir.iterdir() if ".tmp-" in p.name]
    assert sorted(p.name for p in mgr.complete()) == ["step-00000004", "step-00000006"]  # keep=2


def test_checkpoint_manager_keeps_two_and_survives_lost_pointer(tmp_path):
    mgr = CheckpointManager(tmp_path)
    for step in (1, 2, 3):
        mgr.save(step=step, model={"w": torch.full((2,), float(step))}, optimizer={}, trainer={}, state={})
    assert [p.name for p in mgr.complete()] == ["step-00000002", "step-00000003"]
    (mgr.dir / ckpt_mod.LATEST).unlink()
    assert mgr.load().step == 3
    with pytest.raises(ValueError):
        CheckpointManager(tmp_path, keep=1)


def test_time_budget_stops_with_a_resumable_checkpoint(tmp_path, tiny_model_dir, drafter_store):
    ticks = iter(range(0, 10**6, 30))  # every clock read advances 30 s
    cfg = config(tmp_path, tiny_model_dir, max_steps=20, save_every=50, max_minutes=2.0, eval_fraction=0.0)
    res = train(cfg, store=drafter_store, clock=lambda: float(next(ticks)))
    assert res.status == "time_budget" and 0 < res.step < 20
    assert CheckpointManager(cfg.out_dir).load().step == res.step


def test_held_out_metrics_are_consistent_and_training_helps(tmp_path, tiny_model_dir, drafter_store):
    cfg = config(tmp_path, tiny_model_dir, max_steps=12, eval_every=0, eval_fraction=0.2, eval_max_samples=8,
                 lr=3e-3, grad_accum=1)
    first = config(tmp_path / "zero", tiny_model_dir, max_steps=1, lr=1e-9, eval_fraction=0.2, eval_max_samples=8)
    before = train(first, store=drafter_store).eval
    after = train(cfg, store=drafter_store).eval
    for ev in (before, after):
        al = [ev["accept_length"][str(d)] for d in range(1, cfg.ttt_steps + 1)]
        assert al == sorted(al) and 1.0 <= al[0] <= al[-1] <= 1 + cfg.ttt_steps
        assert al[0] == pytest.approx(1 + ev["step_acc"][0])  # depth 1 accepts exactly the step-0 hits
        assert ev["step_acc"][0] <= ev["target_in_vocab"] <= 1.0
    assert after["step_loss"][0] < before["step_loss"][0]
    assert after["accept_length"]["3"] > before["accept_length"]["3"]


def test_the_result_says_where_the_loop_time_went(tmp_path, tiny_model_dir, drafter_store):
    """A store slow to read shows up as the steps' data wait, and the parts add up to the loop's time."""
    import time

    class SlowStore(MemoryStore):
        def __getitem__(self, i):
            time.sleep(0.02)
            return super().__getitem__(i)

    slow = SlowStore([drafter_store[i] for i in range(len(drafter_store))], drafter_store.provenance)
    events = []
    result = train(config(tmp_path, tiny_model_dir, max_steps=4, prefetch=False), store=slow, callback=events.append)
    split = result.time_split
    assert set(split) == {"data_wait", "device_wait", "eval", "save", "other"}
    read_in_steps = sum(len(mb) for e in events if e["kind"] == "train" for mb in e["batches"])
    assert read_in_steps > 10 and split["data_wait"] >= 0.9 * 0.02 * read_in_steps
    assert split["eval"] > 0 and split["save"] > 0  # the last evaluation and checkpoint
    assert sum(split.values()) == pytest.approx(result.train_seconds, abs=0.05)  # the loop's own time, all of it
