"""What an extraction's own servers do before its samples: write the prompts the target answers (self-prompting)
and capture the benchmark's prompts into an extraction of their own (the eval capture, never training data)."""

import json

import pytest

from eaglenest.extraction.run import run_extraction
from eaglenest.extraction.state import open_extraction
from tests.extract_helpers import WritesPrompts, ledger_ids, record_rids, regen_source, with_


def test_the_target_writes_its_own_prompts_on_the_runs_servers_then_answers_them(tiny_extract_params,
                                                                                   capture_servers, tmp_path):
    """ExtractParams.self_prompts: the run's own servers write the prompts first (kept ones in self-prompts.jsonl.xz,
    duplicates left out), the target answers them with the source's records, and a resumed run asks for none."""
    from eaglenest.data import ChatEncoder

    params = with_(tiny_extract_params, source=regen_source(tmp_path, 2), max_turns=None, concurrency=2,
                   regeneration={"enabled": True, "max_new_tokens": 8},
                   self_prompts={"count": 10, "seed": 3, "max_new_tokens": 32})
    ext = open_extraction(params)
    ((url, engine),) = capture_servers(ext.capture_dir)
    engine.runner = WritesPrompts(engine.runner, ChatEncoder(params.model).tokenizer)
    rids = record_rids(engine)
    params = with_(params, server_urls=[url])
    report = run_extraction(params)
    asked = json.loads((ext.dir / "self-prompts.json").read_text())
    assert asked["asked"] == 10 and asked["kept"] == 5 and asked["skipped"] == {"duplicate": 5}
    ids = ledger_ids(ext.dir)
    assert len([i for i in ids if i.startswith("self-3-")]) == 5 and {"p0", "p1"} <= set(ids)
    assert report["complete"] and report["run"]["phases_s"]["self_prompts"] > 0
    assert sum(":self:3:" in r for r in rids) == 10  # the prompts were asked on the run's server, once each
    before = len(rids)
    again = run_extraction(params)
    assert again["complete"] and again["run"]["requests"] == 0 and len(rids) == before  # nothing asked again


def eval_prompts(tmp_path, n=3):
    """A benchmark's prompt sets as `bench prompts --format messages` writes them (ids ``<set>:<id>``)."""
    rows = [{"id": f"mt-bench:{i}", "prompt_set": "mt-bench", "source": "test",
             "messages": [{"role": "user", "content": f"Name {i + 2} colours."}]} for i in range(n)]
    (tmp_path / "eval.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(tmp_path / "eval.jsonl")


def test_the_runs_servers_capture_the_benchmarks_prompts_into_an_extraction_of_their_own(
        tiny_extract_params, capture_servers, tmp_path):
    """ExtractParams.eval_capture: before its samples the run's servers answer the benchmark's prompts greedily,
    captured into <output_dir>/calibration (the offline side of the live benchmark), never into the run's
    own extraction; a resumed run asks for none of them again."""
    from eaglenest.store.extraction import open_samples

    params = with_(tiny_extract_params, source=regen_source(tmp_path, 2), max_turns=None, concurrency=2,
                   regeneration={"enabled": True, "max_new_tokens": 8},
                   eval_capture={"prompts": eval_prompts(tmp_path), "max_new_tokens": 6})
    ext = open_extraction(params)
    ((url, engine),) = capture_servers(ext.capture_dir)
    rids = record_rids(engine)
    params = with_(params, server_urls=[url])
    report = run_extraction(params)
    ev = report["run"]["eval_capture"]
    folder = tmp_path / "out" / "calibration"
    assert ev["dir"] == str(folder) and ev["samples"] == ev["done"] == 3 and ev["pending"] == 0
    assert report["complete"] and report["run"]["phases_s"]["eval_capture"] > 0
    assert sorted(ledger_ids(folder)) == [f"mt-bench:{i}" for i in range(3)]
    assert not [i for i in ledger_ids(ext.dir) if i.startswith("mt-bench:")]  # never in the training data
    assert not [p for p in ext.capture_dir.iterdir() if "mt-bench" in p.name]  # its shards moved to its folder
    assert len(open_samples(str(folder), check_sha256=False)) == 3  # what `bench offline` and the eval sets read
    before = len(rids)
    again = run_extraction(params)  # nothing left to extract: no servers asked, the eval capture stands
    assert again["complete"] and "eval_capture" not in again["run"] and len(rids) == before
    ledger = folder / "ledger.jsonl"  # one eval sample lost: a run with samples to extract finishes it
    ledger.write_text("".join(ledger.read_text().splitlines(keepends=True)[:-1]))
    main = ext.dir / "ledger.jsonl"
    main.write_text("".join(main.read_text().splitlines(keepends=True)[:-1]))
    third = run_extraction(params)
    assert third["complete"] and third["run"]["eval_capture"]["done"] == 3
    assert len(ledger_ids(folder)) == 3 and len(rids) == before + 2, rids[before:]  # both shards were there:
    assert all(r.startswith("nocapture:ready-") for r in rids[before:])  # validated; only the two readiness probes
    # the calibration of the same prompt file into the same folder (`bench offline`, scripts/gpu_calibrate.py)
    # resumes this capture: nothing is answered again
    from eaglenest.speculative.calibration import CaptureSettings, capture_answers

    _, rep = capture_answers(params.eval_capture.prompts, CaptureSettings(model=params.model, server_urls=[url],
                                                                          max_new_tokens=6), tmp_path / "out")
    assert rep["done"] == 3 and rep["run"]["requests"] == 0


def test_a_failing_eval_capture_is_reported_and_the_run_goes_on(tiny_extract_params, capture_servers, tmp_path):
    (tmp_path / "a-file").write_text("")  # its folder cannot be made: the eval capture fails
    params = with_(tiny_extract_params, source=regen_source(tmp_path, 2), max_turns=None, concurrency=2,
                   regeneration={"enabled": True, "max_new_tokens": 8},
                   eval_capture={"prompts": eval_prompts(tmp_path), "output_dir": str(tmp_path / "a-file")})
    ext = open_extraction(params)
    ((url, _),) = capture_servers(ext.capture_dir)
    report = run_extraction(with_(params, server_urls=[url]))
    assert report["complete"] and report["done"] == 3  # p0, p1 and c: the run's own samples
    assert report["run"]["eval_capture"]["error"].startswith(("FileExistsError", "NotADirectoryError"))


def test_an_interrupted_eval_capture_is_in_the_runs_report(tiny_extract_params, capture_servers, tmp_path,
                                                             monkeypatch):
    import eaglenest.extraction.run as run_module

    def interrupted(ext, pool):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_module, "capture_eval_prompts", interrupted)
    params = with_(tiny_extract_params, source=regen_source(tmp_path, 2), max_turns=None,
                   regeneration={"enabled": True, "max_new_tokens": 8},
                   eval_capture={"prompts": eval_prompts(tmp_path)})
    ext = open_extraction(params)
    ((url, _),) = capture_servers(ext.capture_dir)
    with pytest.raises(KeyboardInterrupt):
        run_extraction(with_(params, server_urls=[url]))
    report = json.loads((ext.dir / "report.json").read_text())
    assert report["status"] == "interrupted" and report["run"]["eval_capture"]["ended"] == "before it finished"


def test_an_eval_capture_into_the_runs_own_folder_or_from_no_file_is_refused(tiny_extract_params, tmp_path):
    regen = {"enabled": True, "max_new_tokens": 8}
    with pytest.raises(ValueError, match=r"eval_capture.extraction_id: 't' is this extraction's own folder"):
        with_(tiny_extract_params, regeneration=regen,
              eval_capture={"prompts": eval_prompts(tmp_path), "extraction_id": "t"})
    with pytest.raises(ValueError, match=r"eval_capture: .*needs regeneration.enabled"):
        with_(tiny_extract_params, eval_capture={"prompts": eval_prompts(tmp_path)})
    with pytest.raises(ValueError, match=r"eval_capture: the eval capture expects the model's default aux layers"):
        with_(tiny_extract_params, regeneration=regen, aux_layer_ids=[0, 1],
              eval_capture={"prompts": eval_prompts(tmp_path)})
    with pytest.raises(ValueError, match=r"eval_capture.output_dir: 's3://bucket/evals' is not local"):
        with_(tiny_extract_params, regeneration=regen,
              eval_capture={"prompts": eval_prompts(tmp_path), "output_dir": "s3://bucket/evals"})
    missing = with_(tiny_extract_params, regeneration=regen, eval_capture={"prompts": str(tmp_path / "none.jsonl")})
    with pytest.raises(FileNotFoundError, match=r"eval_capture.prompts: .*none.jsonl is not a file"):
        run_extraction(missing)
    assert not (tmp_path / "out" / "t").exists()  # refused before the extraction or a server started
