"""The training run's named steps, each alone: setup, resume, step, evaluate (held-out + eval sets), save;
plus the schedule, the time-budget note and the logs/plots of a run."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from test_drafter_train import config

from eaglenest.drafter.checkpoint import CheckpointManager
from eaglenest.drafter.train import HELDOUT, Trainer, train
from eaglenest.store.encoding import StoreSample
from eaglenest.testing.fake_store import MemoryStore


def eval_store(drafter_store, n=6):
    """A store of other samples of the same target (stands for an MT-Bench capture)."""
    return MemoryStore([drafter_store[i] for i in range(n)], drafter_store.provenance)


def test_setup_builds_a_schedule_that_covers_the_epochs(tmp_path, tiny_model_dir, drafter_store):
    cfg = config(tmp_path, tiny_model_dir, max_steps=None, epochs=2.0, grad_accum=2)
    t = Trainer.setup(cfg, store=drafter_store)
    per_epoch = t.stream.batches_per_epoch()
    assert t.total == math.ceil(2.0 * per_epoch / 2) and t.total > 1
    assert t.vocab.size == 200 and t.drafter.config.draft_vocab_size == 200
    assert set(t.train_idx).isdisjoint(t.eval_idx) and len(t.train_idx) + len(t.eval_idx) == len(drafter_store)
    assert t.checkpoint is None and not t.resume()  # nothing to resume in a fresh folder
    # the LR schedule runs over exactly those steps: warm-up to the peak, cosine down to the floor at the end
    lrs = []
    for _ in range(t.total):
        lrs.append(t.optimizer.param_groups[0]["lr"])
        t.scheduler.step()
    assert max(lrs) == pytest.approx(cfg.lr) and lrs[-1] == pytest.approx(cfg.lr * cfg.min_lr_ratio, rel=0.2)


def test_step_alone_moves_the_weights_and_reports_the_batch(tmp_path, tiny_model_dir, drafter_store):
    cfg = config(tmp_path, tiny_model_dir)
    t = Trainer.setup(cfg, store=drafter_store)
    before = {n: p.detach().clone() for n, p in t.drafter.named_parameters()}
    events = []
    t.callback = events.append
    ev = t.step()
    assert ev["kind"] == "train" and ev["step"] == 1 == t.step_no and len(ev["batches"]) == cfg.grad_accum
    assert ev["tokens"] == t.tokens_done > 0 and math.isfinite(ev["loss"]) and len(ev["step_acc"]) == cfg.ttt_steps
    assert any(not torch.equal(before[n], p) for n, p in t.drafter.named_parameters())
    assert events == [ev] and json.loads((tmp_path / "run" / "metrics.jsonl").read_text())["step"] == 1


def test_save_then_resume_alone_restores_the_exact_state(tmp_path, tiny_model_dir, drafter_store):
    cfg = config(tmp_path, tiny_model_dir)
    a = Trainer.setup(cfg, store=drafter_store)
    a.step()
    a.step()
    path = a.save(None)
    assert CheckpointManager(cfg.out_dir).latest() == path
    nxt = a.step()  # what the uninterrupted run does next
    b = Trainer.setup(cfg, store=drafter_store)
    assert not b.resume() and b.step_no == 2
    assert b.tokens_done == a.history[0]["tokens"] + a.history[1]["tokens"]
    again = b.step()
    assert (again["batches"], again["lr"], again["loss"]) == (nxt["batches"], nxt["lr"], nxt["loss"])


def test_evaluate_scores_the_held_out_split_and_every_eval_set(tmp_path, tiny_model_dir, drafter_store):
    cfg = config(tmp_path, tiny_model_dir, eval_sets={"mt-bench": "memory"}, eval_max_samples=4)
    t = Trainer.setup(cfg, store=drafter_store, eval_stores={"mt-bench": eval_store(drafter_store)})
    res = t.evaluate()
    assert set(res) == {HELDOUT, "mt-bench"}
    assert res["mt-bench"]["samples"] == 4  # capped like the held-out split
    for r in res.values():
        assert r["cycles"] > 0 and 1.0 <= r["accept_length_cycles"]["1"] <= 2.0
    events = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(e["kind"], e["set"]) for e in events] == [("eval", HELDOUT), ("eval", "mt-bench")]


def test_eval_sets_are_logged_per_set_and_returned(tmp_path, tiny_model_dir, drafter_store):
    from eaglenest.drafter.report import draw_accept_lengths, read_metrics

    cfg = config(tmp_path, tiny_model_dir, max_steps=4, eval_every=2, eval_sets={"mt-bench": "memory"})
    res = train(cfg, store=drafter_store, eval_stores={"mt-bench": eval_store(drafter_store)})
    assert res.status == "done" and res.note == "schedule finished"
    assert set(res.eval_sets) == {"mt-bench"} and res.eval["samples"] > 0
    m = read_metrics(cfg.out_dir)
    assert [e["step"] for e in m["eval"]] == [2, 4] and [e["step"] for e in m["eval:mt-bench"]] == [2, 4]
    assert all(e["train_tokens"] > 0 for e in m["eval:mt-bench"])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    labels = draw_accept_lengths(ax, m)
    plt.close(fig)
    # ttt_steps 3: depths 1, 2 and 3 each drawn once (depth 3 was drawn twice and depth 2 hidden)
    assert labels == ["held-out depth 1", "held-out depth 2", "held-out depth 3", "mt-bench depth 3"]


def test_evals_of_different_depths_in_one_run_plot(tmp_path):
    """A run resumed with another eval_steps holds evals of different depths: each depth is drawn where it was
    scored (a depth the earlier evals lack raised a KeyError in the report step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from eaglenest.drafter.report import draw_accept_lengths

    def ev(step, k):
        return {"step": step, "accept_length": {str(d): 1.0 + 0.1 * d for d in range(1, k + 1)}}

    m = {"eval": [ev(1, 2), ev(2, 4)], "eval:mt-bench": [ev(1, 4), ev(2, 2)]}
    fig, ax = plt.subplots()
    labels = draw_accept_lengths(ax, m)
    lines = {line.get_label(): list(line.get_xdata()) for line in ax.get_lines()}
    plt.close(fig)
    assert labels == ["held-out depth 1", "held-out depth 2", "held-out depth 3", "held-out depth 4",
                      "mt-bench depth 2"]
    assert lines["held-out depth 1"] == [1, 2] and lines["held-out depth 4"] == [2]


def test_an_eval_set_from_other_aux_layers_is_refused(tmp_path, tiny_model_dir, drafter_store):
    import dataclasses

    from eaglenest.contract import ContractError

    other = MemoryStore([drafter_store[0]], dataclasses.replace(drafter_store.provenance, aux_layer_ids=(0, 1, 2)))
    cfg = config(tmp_path, tiny_model_dir, eval_sets={"x": "memory"})
    with pytest.raises(ContractError, match=r"eval set 'x'.*aux layers"):
        Trainer.setup(cfg, store=drafter_store, eval_stores={"x": other})
    with pytest.raises(ValueError, match="heldout"):
        config(tmp_path, tiny_model_dir, eval_sets={"heldout": "x"})


def test_time_budget_is_reported_as_a_safety_stop(tmp_path, tiny_model_dir, drafter_store):
    ticks = iter(range(0, 10**6, 30))
    cfg = config(tmp_path, tiny_model_dir, max_steps=20, save_every=50, max_minutes=2.0, eval_fraction=0.0)
    res = train(cfg, store=drafter_store, clock=lambda: float(next(ticks)))
    assert res.status == "time_budget" and "safety stop" in res.note and "did NOT finish" in res.note
    assert json.loads((tmp_path / "run" / "result.json").read_text())["note"] == res.note


def test_two_ttt_steps_log_no_depth_that_does_not_exist(tmp_path, tiny_model_dir, drafter_store, caplog):
    cfg = config(tmp_path, tiny_model_dir, ttt_steps=2, max_steps=1)
    with caplog.at_level(logging.INFO, logger="eaglenest.drafter.train"):
        train(cfg, store=drafter_store)
    lines = [r.getMessage() for r in caplog.records if "accept length" in r.getMessage()]
    assert lines and all("nan" not in x and "@3" not in x and "@2" in x for x in lines), lines


def test_evaluation_unrolls_deeper_than_training_and_leaves_training_unchanged(tmp_path, tiny_model_dir,
                                                                              drafter_store):
    """eval_steps 4 on a TTT-2 drafter scores depths 1-4 (a 4-step chain's view); depths 1-2 equal the TTT-2 view,
    and the training step does not see the setting."""
    shallow = Trainer.setup(config(tmp_path / "a", tiny_model_dir, ttt_steps=2), store=drafter_store)
    deep = Trainer.setup(config(tmp_path / "b", tiny_model_dir, ttt_steps=2, eval_steps=4), store=drafter_store)
    a, b = shallow.evaluate()[HELDOUT], deep.evaluate()[HELDOUT]
    assert sorted(a["accept_length_cycles"]) == ["1", "2"] and sorted(b["accept_length_cycles"]) == ["1", "2", "3", "4"]
    for d in ("1", "2"):
        assert b["accept_length_cycles"][d] == pytest.approx(a["accept_length_cycles"][d])
    depths = [b["accept_length_cycles"][d] for d in ("1", "2", "3", "4")]
    assert depths == sorted(depths)
    assert shallow.step()["loss"] == pytest.approx(deep.step()["loss"])


def test_an_eval_set_key_picks_its_prompt_set_out_of_a_shared_capture(drafter_store):

    from eaglenest.drafter.data import prompt_set_view

    samples = [_with(drafter_store[i], sample_id=f"{'mt-bench' if i < 3 else 'humaneval'}:{i}")
               for i in range(5)]
    mixed = MemoryStore(samples, drafter_store.provenance)
    mt = prompt_set_view(mixed, "mt-bench")
    assert mt.sample_ids == ["mt-bench:0", "mt-bench:1", "mt-bench:2"] and len(mt) == 3
    assert mt[2].sample_id == "mt-bench:2" and list(mt.num_tokens) == list(mixed.num_tokens[:3])
    assert prompt_set_view(mixed, "sharegpt") is mixed  # no such set: the whole store


def _with(s: StoreSample, **changes) -> StoreSample:
    """A copy of a store sample with some of its fields replaced."""
    fields = {k: getattr(s, k) for k in ("sample_id", "input_ids", "loss_mask", "aux_hidden", "final_hidden")}
    return StoreSample(**{**fields, **changes})
