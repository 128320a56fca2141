"""Calibration on the same prompts: the target answers a prompt set, the answers are captured, the drafter
is simulated on exactly those samples, and the estimate predicts the live decoder's accept length."""

from __future__ import annotations

import json

import pytest
from spec_support import one_thread

from eaglenest.speculative import calibration as C
from eaglenest.speculative import prompts as P
from eaglenest.speculative.prompts import Prompt, PromptSet


def prompt_sets() -> list[PromptSet]:
    texts = ["def main(): return os.path.join(a, b)", "import sys, os; print(sys.argv)",
             "class Foo: pass  # a tiny class", "for i in range(10): print(i)",
             "with open(path) as f: data = f.read()", "raise ValueError('bad value')"]
    mk = [Prompt(id=f"mt-bench:{i}", messages=[{"role": "user", "content": t}], kind=("writing", "coding")[i % 2])
          for i, t in enumerate(texts[:4])]
    he = [Prompt(id=f"HumanEval/{i}", messages=[{"role": "user", "content": t}]) for i, t in enumerate(texts[4:])]
    return [PromptSet(name="mt-bench", source="test", prompts=mk),
            PromptSet(name="humaneval", source="test", prompts=he)]


def test_prompt_source_round_trip(tmp_path):
    path = P.write_prompt_source(tmp_path / "src.jsonl", prompt_sets())
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["id"] for r in rows][:2] == ["mt-bench:0", "mt-bench:1"] and rows[4]["id"] == "humaneval:HumanEval/0"
    assert P.read_prompt_source(path) == {"mt-bench": "test", "humaneval": "test"}
    assert P.read_prompt_kinds(path) == {"mt-bench:0": "writing", "mt-bench:1": "coding", "mt-bench:2": "writing",
                                         "mt-bench:3": "coding"}  # HumanEval's prompts have no kind
    with pytest.raises(ValueError, match="empty"):
        P.write_prompt_source(tmp_path / "none.jsonl", [PromptSet(name="x", source="s", prompts=[])])
    # a work folder that does not exist yet (`eaglenest bench offline --prompt-set mt-bench --out NEW`)
    fresh = P.write_prompt_source(tmp_path / "new" / "calib" / "prompts.jsonl", prompt_sets())
    assert fresh.read_text() == path.read_text()


@pytest.mark.slow  # regeneration on the embedded engine: ~1-3 min on a shared 2-core machine
def test_offline_on_the_targets_answers_predicts_the_live_decoder(spec_tiny, tiny_model_dir, capture_servers,
                                                                  tmp_path):
    import shutil

    from spec_support import fit_drafter

    from eaglenest.speculative.cpu_bench import live_accept_on_samples
    from eaglenest.speculative.serve import load_spec_decoder
    from eaglenest.store.extraction import open_samples as open_store

    runner, untrained, _, _, _ = spec_tiny
    source = P.write_prompt_source(tmp_path / "src.jsonl", prompt_sets())
    work = tmp_path / "work"
    ((url, _),) = capture_servers(work / "calibration" / "capture")
    live_report = {"prompt_set": "mt-bench", "spec": {"num_steps": 3, "topk": 1},
                   "eagle3": {"levels": [{"concurrency": 1, "accept_length": 2.0},
                                         {"concurrency": 16, "accept_length": None}]}}
    (tmp_path / "report.json").write_text(json.dumps(live_report))
    tree_grid = {"command": ["gpu_bench_grid.py", "--steps", "3", "--topk=2", "--draft-tokens", "6"],
                 "rows": [{"prompt_set": "mt-bench", "steps": 3, "draft_tokens": 6, "concurrency": 1,
                           "accept_length": 2.5}]}
    (tmp_path / "tree.json").write_text(json.dumps(tree_grid))
    settings = C.CaptureSettings(model=str(tiny_model_dir), server_urls=[url], max_new_tokens=40, dtype="float32",
                                 answer_max_new_tokens=400,
                                 batch_size=8, concurrency=4)
    folder, _ = C.capture_answers(source, settings, work)
    store = open_store(str(folder))
    fitted = shutil.copytree(untrained, tmp_path / "draft")
    with one_thread():  # a drafter that knows these answers (the point is the estimate, not the drafter)
        fit_drafter(runner, fitted, [store[i].input_ids.tolist() for i in range(len(store))])
        rep = C.calibrate_on_prompts(source=source, draft=fitted, settings=settings, work_dir=work,
                                     live_reports=[tmp_path / "report.json", tmp_path / "tree.json"],
                                     depths=(1, 2, 3))  # the tree live ran is replayed without being asked
    by_set = {s.prompt_set: s for s in rep.sets}
    assert {k: v.samples for k, v in by_set.items()} == {"mt-bench": 4, "humaneval": 2}
    mt = by_set["mt-bench"]
    # the captured answers are the target's own greedy answers (a capped answer ends in the template's end
    # token, which the target did not choose: one miss per sample)
    assert mt.target_agreement > 0.95
    al = [mt.by_depth[d]["accept_length_cycles"] for d in (1, 2, 3)]
    assert al == sorted(al) and 1.5 <= al[2] <= 4.0
    assert {k: v["samples"] for k, v in mt.by_kind.items()} == {"coding": 2, "writing": 2}  # from the source's kinds
    tree = mt.by_shape["tree3x2n5"]["accept_length_cycles"]
    assert tree >= al[2] - 0.05  # a tree replayed beside the chains
    # a level without an accept length is not a row
    assert [(r["shape"], r["concurrency"]) for r in rep.rows] == [("chain3", 1), ("tree3x2n5", 1)]
    assert rep.rows[0]["ratio"] == pytest.approx(mt.by_depth[3]["accept_length_cycles"] / 2.0)
    assert rep.rows[1]["offline"] == tree
    out = C.write_calibration(rep, tmp_path / "out")
    assert json.loads(out.read_text())["rows"][0]["prompt_set"] == "mt-bench"
    assert "| mt-bench | chain3 | 1 |" in (tmp_path / "out" / "calibration.md").read_text()
    # the same prompts decoded live (the embedded EAGLE-3 decoder, greedy, same answer cap)
    samples = [store[i] for i, sid in enumerate(store.sample_ids) if sid.startswith("mt-bench:")]
    with one_thread():
        live = live_accept_on_samples(load_spec_decoder(runner, fitted, num_steps=3), samples, max_new_tokens=40)
    assert live.cycles > 20
    assert mt.by_depth[3]["accept_length_cycles"] == pytest.approx(live.accept_length, rel=0.05)


def test_a_live_tree_pairs_with_its_replay_not_with_the_chain_of_its_depth():
    tree_report = {"prompt_set": "mt-bench", "spec": {"num_steps": 6, "topk": 4, "num_draft_tokens": 16},
                   "eagle3": {"levels": [{"concurrency": 1, "accept_length": 3.7}]}}
    grid = {"command": ["scripts/gpu_bench_grid.py", "--steps", "6", "--topk", "4", "--draft-tokens", "16"],
            "rows": [{"prompt_set": "humaneval", "steps": 6, "draft_tokens": 16, "concurrency": 1,
                      "accept_length": 4.3}]}  # a grid written before its rows said topk: from its command
    live = C.live_accepts(tree_report, "r.json") + C.live_accepts(grid, "matrix.json")
    assert [x.shape for x in live] == ["tree6x4n15", "tree6x4n15"]
    sets = [C.SetOffline(prompt_set=n, samples=2, target_agreement=1.0,
                         by_depth={6: {"accept_length_cycles": 2.9, "accept_length": 3.0}},
                         by_shape={"tree6x4n15": {"accept_length_cycles": v, "cycles": 50}})
            for n, v in (("mt-bench", 3.5), ("humaneval", 4.4))]
    rows = C.side_by_side(sets, live)
    assert [(r["shape"], r["offline"], r["offline_per_start"]) for r in rows] == [
        ("tree6x4n15", 3.5, None), ("tree6x4n15", 4.4, None)]
    assert rows[0]["ratio"] == pytest.approx(3.5 / 3.7)
    md = C.markdown(C.CalibrationReport(model="m", draft="d", capture={}, sets=sets, rows=rows))
    assert "| mt-bench | 3.50 |" in md and "| mt-bench | tree6x4n15 | 1 | 3.50 | - | 3.70 | 0.95 |" in md
    embedded = {"prompt_set": "mt-bench", "spec": {"num_steps": 4, "topk": 1, "num_draft_tokens": 5,
                                                   "shape": "chain4p0.35"},
                "eagle3": {"levels": [{"concurrency": 1, "accept_length": 2.2}]}}
    (row,) = C.side_by_side(sets, C.live_accepts(embedded))  # a confidence-stopped chain is not chain4: no guess
    assert row["shape"] == "chain4p0.35" and row["offline"] is None
    with pytest.raises(ValueError, match="num_draft_tokens"):  # a shape SGLang would refuse is not guessed at
        C.live_accepts({"prompt_set": "x", "spec": {"num_steps": 2, "topk": 2, "num_draft_tokens": 9},
                        "eagle3": {"levels": []}})


def test_a_grid_matrix_gives_one_live_row_per_set_steps_and_concurrency():
    rows = [{"prompt_set": "mt-bench", "steps": k, "concurrency": c, "accept_length": 1.5 + k / 10}
            for k in (1, 3) for c in (1, 16)] + [{"prompt_set": "humaneval", "steps": 3, "concurrency": 1,
                                                  "accept_length": None}]
    live = C.live_accepts({"rows": rows}, "matrix.json")
    assert [(x.prompt_set, x.num_steps, x.concurrency) for x in live] == [
        ("mt-bench", 1, 1), ("mt-bench", 1, 16), ("mt-bench", 3, 1), ("mt-bench", 3, 16)]
    off = C.SetOffline(prompt_set="mt-bench", samples=2, target_agreement=1.0,
                       by_depth={1: {"accept_length_cycles": 1.6, "accept_length": 1.7},
                                 3: {"accept_length_cycles": 2.0, "accept_length": 2.4}})
    table = C.side_by_side([off], live)
    assert [round(r["ratio"], 4) for r in table] == [1.0, 1.0, round(2.0 / 1.8, 4), round(2.0 / 1.8, 4)]
    assert table[2]["offline_per_start"] == 2.4


def test_a_training_runs_eval_is_the_offline_side():
    ev = {"mt-bench": {"samples": 40, "accept_length_cycles": {"1": 1.6, "3": 2.2},
                       "accept_length": {"1": 1.7, "3": 2.6}},
          "sharegpt": {"samples": 40, "accept_length_cycles": {"3": 2.5}, "accept_length": {"3": 2.9}}}
    sets = C.sets_from_eval(ev)
    live = C.live_accepts({"rows": [{"prompt_set": "mt-bench", "steps": 3, "concurrency": 1, "accept_length": 2.0},
                                    {"prompt_set": "sharegpt", "steps": 5, "concurrency": 1, "accept_length": 3.0}]})
    table = C.side_by_side(sets, live)
    assert round(table[0]["ratio"], 4) == 1.1 and table[0]["offline_per_start"] == 2.6
    assert table[1]["offline"] is None and table[1]["ratio"] is None  # depth 5: the eval went to depth 3 only
    md = C.markdown(C.CalibrationReport(model="m", draft="d", capture={}, sets=sets, rows=table))
    assert "| mt-bench | 40 | - | 1.60 | 2.20 |" in md
    with pytest.raises(ValueError, match="'heldout'"):
        C.sets_from_eval({"heldout": {"samples": 3, "step_acc": [0.5]}})


def test_each_sets_chains_are_also_scored_per_kind_of_prompt(monkeypatch):
    """MT-Bench's 40 prompts the grid decodes are four of its kinds; which of them holds its accept length down is
    what to steer the training data toward (2026-12-05e: writing 2.24, math 2.62)."""
    from types import SimpleNamespace

    import torch

    from eaglenest.speculative import offline
    from eaglenest.store import StoreSample
    from eaglenest.testing.fake_store import MemoryStore

    def fake_depths(store, draft, head, idx, depths):  # accept length = 1 + the mean of the indices scored
        al = 1 + sum(idx) / len(idx)
        return {d: SimpleNamespace(accept_length_cycles=al + d, accept_length=al, cycles=len(idx), chains=len(idx),
                                   target_agreement=1.0) for d in depths}

    def fake_groups(store, draft, head, groups, depths):  # what simulate_groups computes, per group
        return {name: fake_depths(store, draft, head, idx, depths) for name, idx in groups.items()}

    monkeypatch.setattr(offline, "simulate_groups", fake_groups)
    ids = ["mt-bench:81", "mt-bench:91", "mt-bench:92", "humaneval:0"]
    one = torch.zeros(4, 2, dtype=torch.bfloat16)
    store = MemoryStore([StoreSample(i, torch.arange(4, dtype=torch.int32), torch.ones(4, dtype=torch.bool), one, one)
                         for i in ids], provenance=None)
    kinds = {"mt-bench:81": "writing", "mt-bench:91": "roleplay", "mt-bench:92": "roleplay"}
    sets = {s.prompt_set: s for s in C.simulate_prompt_sets(store, None, None, depths=(1, 3), kinds=kinds)}
    mt = sets["mt-bench"]
    assert mt.by_depth[3]["accept_length_cycles"] == 1 + 1 + 3  # indices 0, 1, 2
    assert mt.by_kind == {"roleplay": {"samples": 2, "by_depth": {1: 3.5, 3: 5.5}},  # indices 1, 2
                          "writing": {"samples": 1, "by_depth": {1: 2.0, 3: 4.0}}}
    assert sets["humaneval"].by_kind == {}
    assert json.loads(json.dumps(mt.to_json()))["by_kind"]["roleplay"]["by_depth"] == {"1": 3.5, "3": 5.5}
    md = C.markdown(C.CalibrationReport(model="m", draft="d", capture={}, sets=list(sets.values())))
    assert "| mt-bench | roleplay | 2 | 3.50 | 5.50 |" in md and "| mt-bench | writing | 1 | 2.00 | 4.00 |" in md


def test_answers_are_scored_up_to_the_live_cap():
    import torch

    mask = torch.tensor([0, 0, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1], dtype=torch.bool)
    assert C.cap_turns(mask, 3).int().tolist() == [0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("encoding", ["bf16", "fp8"])
def test_the_capped_view_keeps_each_sample_and_cuts_its_answers(encoding):
    """The view the calibration simulates on: what the reader hands out (bf16 views or fp8 codes), with every
    answer cut to the live cap and nothing else changed."""
    import torch

    from eaglenest.store import StoreSample
    from eaglenest.store.encoding import Fp8States, encode_fp8
    from eaglenest.testing.fake_store import MemoryStore

    aux, final = torch.randn(12, 6, dtype=torch.bfloat16), torch.randn(12, 2, dtype=torch.bfloat16)
    ids = torch.arange(12, dtype=torch.int32)
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1], dtype=torch.bool)
    if encoding == "fp8":
        sample = StoreSample("a", ids, mask, fp8=Fp8States(*encode_fp8(aux, 3), *encode_fp8(final, 1)))
    else:
        sample = StoreSample("a", ids, mask, aux, final)
    view = C._CappedAnswers(MemoryStore([sample], provenance=None), 3)
    got = view[0]
    assert got.loss_mask.int().tolist() == [0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1]
    assert sample.loss_mask.int().tolist() == mask.int().tolist()  # the store's own sample is untouched
    assert got.sample_id == "a" and torch.equal(got.input_ids, ids) and torch.equal(got.aux_hidden, sample.aux_hidden)
    assert (got.fp8 is None) == (encoding == "bf16")
