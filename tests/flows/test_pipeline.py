"""The pipeline flow: one parameter model, every stage derived from it, stages skipped only when their output
for the same inputs exists and validates (a re-run does no work), and extraction partitions for the fan-out."""

from __future__ import annotations

import json
import shutil

import pytest

from eaglenest.extraction.config import ExtractParams
from eaglenest.extraction.state import open_extraction, prepare
from eaglenest.pipeline import BenchOutput, PipelineParams, StageBook


def test_plan_derives_every_stage_from_one_form(tmp_path):
    p = PipelineParams.model_validate({"run_dir": str(tmp_path / "run"), "extract": {"model": "/m", "limit": 5},
                                       "train": {"max_steps": 3}, "bench": {"num_prompts": 2}})
    plan = p.plan()
    run = (tmp_path / "run").resolve()
    assert plan.extract.output_dir == str(run / "extractions") and plan.extract.store_url is None
    assert plan.store_url == str(run / "store")
    assert (plan.train.store, plan.train.out_dir, plan.train.target) == (str(run / "store"), str(run / "train"), "/m")
    assert plan.bench.draft == str(run / "export" / "sglang") and plan.bench.model == "/m"
    assert plan.bench.engine == "embedded" and plan.bench.store_url == str(run / "store")
    assert plan.stages == ("extract", "convert", "train", "export", "bench")
    assert (plan.bench.heldout_fraction, plan.bench.offline_max_samples) == (0.05, 200)  # the drafter's split
    assert PipelineParams(stop_after="train").plan().stages == ("extract", "convert", "train")
    # explicit values win over the derived ones
    q = PipelineParams.model_validate({"extract": {"output_dir": "/x"}, "store_url": "memory://s",
                                       "train": {"target": "/t"}, "bench": {"draft": "/d"}}).plan()
    assert (q.extract.output_dir, q.train.store, q.train.target, q.bench.draft) == ("/x", "memory://s", "/t", "/d")


def test_fresh_extraction_id_per_run_and_schema_errors():
    p = PipelineParams(fresh_extraction_id=True)
    with pytest.raises(ValueError, match="fresh_extraction_id"):
        p.plan()
    a, b = p.plan("re-20261130-000000-aaaa"), p.plan("re-20261130-000100-bbbb")
    assert a.extract.resolved_extraction_id() != b.extract.resolved_extraction_id()
    # the default id is content-addressed: the same request resumes the same extraction
    ids = {PipelineParams().plan().extract.resolved_extraction_id() for _ in range(2)}
    assert len(ids) == 1
    with pytest.raises(ValueError, match="stop_after"):
        PipelineParams.model_validate({"stop_after": "deploy"})
    with pytest.raises(ValueError, match="partition_index"):
        ExtractParams(partition_index=2, partition_count=2)
    with pytest.raises(ValueError, match="lr"):
        PipelineParams.model_validate({"train": {"lr": -1}})
    schema = PipelineParams.model_json_schema()  # what the UI renders as a form
    assert "description" in schema["properties"]["fresh_extraction_id"]


def test_partitions_are_disjoint_and_cover_the_source(tiny_model_dir, tmp_path):
    src = tmp_path / "p.jsonl"
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"question number {i}?"},
                                         {"role": "assistant", "content": f"answer {i}."}]} for i in range(30)]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = dict(recipe="capture",
                model=str(tiny_model_dir), source=str(src), limit=None, output_dir=str(tmp_path / "out"))
    whole = {s.sample_id for s in prepare(open_extraction(ExtractParams(**base))).samples}
    parts = [{s.sample_id for s in prepare(open_extraction(
        ExtractParams(**base, partition_index=i, partition_count=3))).samples} for i in range(3)]
    assert len(whole) == 30 and set().union(*parts) == whole and sum(map(len, parts)) == 30
    assert all(parts)  # a stable hash spreads 30 ids over 3 parts
    ids = {ExtractParams(**base, partition_index=i, partition_count=3).resolved_extraction_id() for i in range(3)}
    assert len(ids) == 3 and ExtractParams(**base).resolved_extraction_id() not in ids


def test_stage_book_skips_only_valid_output_for_the_same_key(tmp_path):
    book = StageBook(tmp_path)
    run = tmp_path / "bench"
    run.mkdir()
    (run / "report.json").write_text("{}")
    book.record("bench", "k1", BenchOutput(output_dir=str(run), speedups={"1": 1.0}, seconds=3.0))
    assert book.done("bench", "k1") == BenchOutput(output_dir=str(run), speedups={"1": 1.0})  # timing not recorded
    assert book.done("bench", "k2") is None  # other inputs
    (run / "report.json").unlink()
    assert book.done("bench", "k1") is None  # output gone
    (tmp_path / "stages.json").write_text("{torn")
    assert book.done("bench", "k1") is None  # unreadable book: run again


def _tiny_pipeline(tiny_model_dir, tmp_path, **over) -> PipelineParams:
    return PipelineParams.model_validate({
        "run_dir": str(tmp_path / "run"),
        "extract": {"recipe": "capture",
                    "model": str(tiny_model_dir), "limit": 100, "max_turns": 1, "max_tokens": 384, "batch_size": 8,
                    "concurrency": 4, "dtype": "float32", "request_timeout_s": 30, "launch_timeout_s": 90,
                    "extraction_id": "tiny"},
        "train": {"max_steps": 6, "max_tokens": 1024, "max_seq_len": 384, "draft_vocab_size": 128, "ttt_steps": 2,
                  "eval_every": 0, "save_every": 3, "eval_max_samples": 3, "eval_fraction": 0.1,
                  "device": "cpu", "precision": "fp32", "threads": 1, "max_minutes": None},
        "export_formats": ["sglang", "speculators"],
        "bench": {"num_prompts": 2, "max_new_tokens": 8, "ignore_eos": True, "concurrencies": [1],
                  "target_concurrency": 1, "min_speedup": 0.0, "dtype": "float32", "threads": 1,
                  "ready_timeout_s": 120},
        **over,
    })


def test_pipeline_runs_every_stage_then_skips_them_all(prefect_api, tiny_model_dir, tmp_path):
    from flows.pipeline import pipeline

    params = _tiny_pipeline(tiny_model_dir, tmp_path)
    first = pipeline(params)
    run = tmp_path / "run"
    assert [first[s]["skipped"] for s in ("extract", "convert", "train", "export", "bench")] == [False] * 5
    assert first["extract"]["run"]["requests"] == first["extract"]["done"] > 0
    assert first["convert"]["samples"] == first["extract"]["done"]
    assert (run / "export" / "sglang" / "model.safetensors").is_file()
    assert (run / "export" / "speculators" / "config.json").is_file()
    assert (run / "bench" / "report.json").is_file() and first["bench"]["speedups"]
    assert json.loads((run / "pipeline.json").read_text())["train"]["step"] == 6

    again = pipeline(params)  # a re-run: every stage skipped, nothing recomputed
    assert [again[s]["skipped"] for s in ("extract", "convert", "train", "export", "bench")] == [True] * 5
    # the headline prints the same numbers the second time (speedups keyed the same way, not {1: ..} then {'1': ..})
    from eaglenest.pipeline import PipelineSummary
    from flows.pipeline import _headline

    assert first["bench"]["speedups"] == again["bench"]["speedups"] and list(first["bench"]["speedups"]) == ["1"]
    def bench_line(summary):
        return next(x for x in _headline(PipelineSummary.model_validate(summary)).splitlines()
                    if x.startswith("bench:"))

    assert bench_line(first) == bench_line(again)
    assert f"prompts read -> {first['extract']['done']} samples" in _headline(PipelineSummary.model_validate(first))

    # a changed training setting re-trains (and re-exports, re-benches); extraction and store are kept
    shutil.rmtree(run / "bench")  # and an output that vanished is recomputed
    changed = pipeline(_tiny_pipeline(tiny_model_dir, tmp_path, stop_after="export",
                                      train={**params.train.model_dump(), "lr": 5e-4, "out_dir": str(run / "train2")}))
    assert (changed["extract"]["skipped"], changed["convert"]["skipped"]) == (True, True)
    assert (changed["train"]["skipped"], changed["export"]["skipped"]) == (False, False)
    assert "bench" not in changed


def test_fanout_partitions_the_extraction_and_merges_the_parts_into_one_store(prefect_api, tiny_model_dir, tmp_path,
                                                                              monkeypatch):
    """pipeline-fanout with run_deployment replaced by a local run of the extract flow (the live deployment path
    is covered by tests/deployments/test_deployments_e2e.py): N disjoint parts, one store version holding all of
    them."""
    import threading
    from types import SimpleNamespace
    from uuid import uuid4

    import prefect.deployments

    from eaglenest.store import open_store
    from flows.extract import extract
    from flows.pipeline import FanoutParams, pipeline_fanout

    calls, lock = [], threading.Lock()

    def fake_run_deployment(name, parameters=None, **kwargs):
        with lock:
            calls.append((name, parameters["params"]["partition_index"], parameters["params"]["partition_count"]))
        state = extract(ExtractParams.model_validate(parameters["params"]), return_state=True)
        return SimpleNamespace(id=uuid4(), state=state)

    monkeypatch.setattr(prefect.deployments, "run_deployment", fake_run_deployment)
    base = _tiny_pipeline(tiny_model_dir, tmp_path)
    params = FanoutParams(pipeline=base.model_copy(update={"stop_after": "convert"}), nodes=3,
                          extract_deployment="extract/extract-gpu-process")
    out = pipeline_fanout(params)
    assert sorted(calls) == [("extract/extract-gpu-process", i, 3) for i in range(3)]
    parts = [json.loads((tmp_path / "run" / "extractions" / f"tiny-p{i}of3" / "report.json").read_text())
             for i in range(3)]
    assert all(p["complete"] and p["done"] > 0 for p in parts)
    store = open_store(out["convert"]["url"], verify=True)
    assert len(store) == sum(p["done"] for p in parts) == out["convert"]["samples"]
    assert len(set(store.sample_ids)) == len(store)  # disjoint parts: no sample twice
    whole = prepare(open_extraction(base.plan().extract)).samples
    assert sorted(store.sample_ids) == sorted(s.sample_id for s in whole)  # and together: the whole source


def test_fresh_extraction_id_gives_each_flow_run_its_own_extraction(prefect_api, tiny_model_dir, tmp_path):
    """The scheduled re-extraction: two runs of the same parameters make two extractions (ids from each run)."""
    from flows.pipeline import pipeline

    params = _tiny_pipeline(tiny_model_dir, tmp_path, stop_after="extract", fresh_extraction_id=True)
    params = params.model_copy(update={"extract": params.extract.model_copy(update={"extraction_id": None,
                                                                                     "limit": 30})})
    a, b = pipeline(params), pipeline(params)
    assert a["extraction_id"] != b["extraction_id"] and a["extraction_id"].startswith("re-")
    assert not a["extract"]["skipped"] and not b["extract"]["skipped"]
    assert b["extract"]["run"]["requests"] == b["extract"]["done"] > 0  # a new snapshot, not a resume


def test_demo_is_fixed_work_and_its_headline_explains_its_numbers():
    from typer.main import get_command

    from eaglenest.cli import app
    from eaglenest.pipeline import ExtractOutput, PipelineSummary, TrainOutput
    from flows.pipeline import DEMO_TRAIN_STEPS, _headline, demo_params, samples_line

    p = demo_params("runs/demo")
    assert p.train.max_steps == DEMO_TRAIN_STEPS  # steps, not a wall-clock budget, decide the drafter
    assert p.train.max_minutes is None or p.train.max_minutes >= 30  # only a far-off safety stop
    ex = ExtractOutput(dir="x", records=128, done=67, skipped_samples={"too_long": 58, "template": 3}, bad_records=0)
    assert samples_line(ex) == "128 prompts read -> 67 samples (61 skipped: 58 too_long, 3 template; 0 bad records)"
    def train(status: str) -> TrainOutput:
        return TrainOutput(run_dir="t", status=status, step=96)

    text = _headline(PipelineSummary(run_dir="runs/demo", extraction_id="x", extract=ex, train=train("done")))
    assert "not expected to pay off" in text and "H100" in text and "6x10x64 tree accept 4.4" in text
    assert "time budget" in _headline(PipelineSummary(run_dir="r", extraction_id="x", extract=ex,
                                                      train=train("time_budget")))
    demo_cmd = get_command(app).commands["demo"]  # `eaglenest demo` must not write into make demo's folder
    out_default = next(o.default for o in demo_cmd.params if o.name == "out")
    assert str(out_default) != "runs/demo"


def test_a_new_measured_default_shape_reruns_the_bench_stage(monkeypatch, tmp_path):
    """Without shape flags the bench runs the day's measured best shape: a new one is a new bench, not a skip."""
    from eaglenest.pipeline import bench_key
    from eaglenest.speculative import bench as bench_mod
    from eaglenest.speculative.bench import BenchConfig
    from eaglenest.speculative.tree import SpecShape

    cfg = BenchConfig(draft=str(tmp_path / "d"), engine="embedded")
    pinned = cfg.model_copy(update={"shape": "chain2"})  # an explicit shape does not follow the default
    monkeypatch.setattr(bench_mod, "measured_best_shape", lambda: SpecShape(depth=1))
    before, pinned_before = bench_key(cfg), bench_key(pinned)
    assert bench_key(cfg) == before
    monkeypatch.setattr(bench_mod, "measured_best_shape", lambda: SpecShape(depth=1, quant="q8"))
    assert bench_key(cfg) != before and bench_key(pinned) == pinned_before
