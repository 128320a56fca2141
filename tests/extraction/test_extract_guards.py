"""What an extraction refuses before doing any work: a second run of the same extraction at once, an empty or
unreadable source (no stub folder left behind); and what the user is told on a resume and on Ctrl-C."""

import json

import pytest
from typer.testing import CliRunner

from eaglenest.cli import app
from eaglenest.extraction.run import run_extraction
from eaglenest.extraction.state import ExtractionBusy, ExtractionError, open_extraction
from tests.extract_helpers import ledger_ids, with_


def test_a_second_run_of_the_same_extraction_is_refused_naming_the_holder(tiny_extract_params, capture_servers):
    ext = open_extraction(tiny_extract_params)
    ((url, engine),) = capture_servers(ext.capture_dir)
    # another run holds it (flock conflicts between two open files, in one process too)
    with ext.lock(), pytest.raises(ExtractionBusy, match=r"is being run by pid \d+ .*run the same command again"):
        run_extraction(with_(tiny_extract_params, server_urls=[url]))
    assert engine.stats["requests"] == 0 and not (ext.dir / "ledger.jsonl").exists()
    assert run_extraction(with_(tiny_extract_params, server_urls=[url]))["complete"]  # released with its holder


@pytest.mark.parametrize("source", ["missing.jsonl", "foo://x.jsonl", "data.txt"])
def test_a_bad_source_is_refused_before_any_folder_is_made(tiny_extract_params, tmp_path, source):
    (tmp_path / "data.txt").write_text("{}")
    params = with_(tiny_extract_params, source=str(tmp_path / source) if "://" not in source else source,
                   output_dir=str(tmp_path / "out"), extraction_id=None)
    with pytest.raises(ExtractionError, match="source"):
        run_extraction(params)
    assert not (tmp_path / "out").exists()


def test_an_empty_source_is_an_error_not_zero_samples(tiny_model_dir, tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    args = ["extract", "--model", str(tiny_model_dir), "--source", str(tmp_path / "empty.jsonl"),
            "--output-dir", str(tmp_path / "out")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "holds no records" in result.output, result.output
    (tmp_path / "long.jsonl").write_text(json.dumps({"id": "a", "prompt": "word " * 600}) + "\n")
    result = CliRunner().invoke(app, [*args[:4], str(tmp_path / "long.jsonl"), *args[5:], "--max-tokens", "64"])
    assert result.exit_code == 2 and "no usable sample: 1 records (1 too_long)" in result.output, result.output


def test_progress_after_a_resume_counts_what_was_done_before(tiny_extract_params, capture_servers):
    params = with_(tiny_extract_params, concurrency=1, batch_size=4)
    ext = open_extraction(params)
    ((url, _),) = capture_servers(ext.capture_dir)
    params = with_(params, server_urls=[url])

    class Stop(BaseException):
        pass

    def stop(p):
        if p.validated >= 1:
            raise Stop

    with pytest.raises(Stop):
        run_extraction(params, on_progress=stop)
    before = len(ledger_ids(ext.dir))
    seen = []
    report = run_extraction(params, on_progress=seen.append)
    assert before > 0
    if before == report["done"]:  # validation (a thread) caught up with every answer before the stop: no work left
        return
    assert seen[0].done_before == before and seen[0].validated >= before
    assert seen[-1].validated == seen[-1].total == report["done"]


def test_ctrl_c_says_how_to_resume(tiny_model_dir, tmp_path, monkeypatch):
    import eaglenest.cli.extract as cli

    def interrupted(params):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_run", interrupted)
    result = CliRunner().invoke(app, ["extract", "--model", str(tiny_model_dir), "--output-dir", str(tmp_path)])
    assert result.exit_code == 130 and "re-run the same command to resume" in result.output


@pytest.mark.slow
def test_kill_9_mid_regeneration_then_the_same_command_asks_for_no_persisted_answer(tiny_model_dir, tmp_path,
                                                                                     capture_servers):
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from tests.extract_helpers import StopAfter, record_rids

    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Tell me about {i}."}) + "\n" for i in range(24)))
    out = tmp_path / "out"
    ((url, engine),) = capture_servers(out / "k" / "capture")
    engine.greedy_decoder = StopAfter(engine.runner, k=6, delay_s=1.0)  # ~24 s of regeneration in all
    rids = record_rids(engine)
    cmd = [sys.executable, "-m", "eaglenest", "extract", "--model", str(tiny_model_dir), "--source", str(src),
           "--server-url", url, "--output-dir", str(out), "--extraction-id", "k", "--concurrency", "2",
           "--regen-max-new-tokens", "8", "--max-tokens", "384", "--json"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                             start_new_session=True)
    answers = out / "k" / "answers.jsonl"
    deadline = time.monotonic() + 180
    while not (answers.is_file() and len(answers.read_text().splitlines()) >= 3):
        assert time.monotonic() < deadline and first.poll() is None
        time.sleep(0.2)
    # the same command while the first runs: refused, naming the holder; it sends nothing
    sent = len(rids)
    second = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180)
    assert second.returncode == 2 and f"pid {first.pid}" in second.stderr, second.stderr
    assert first.poll() is None  # still running: the refusal did not come from a finished run
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    assert all(r.startswith("nocapture:regen:") or not r.startswith("nocapture:") for r in rids[sent:])
    persisted = {f"nocapture:regen:{d['sample_id']}:{d['turn']}"
                 for d in map(json.loads, answers.read_text().splitlines()) if d}
    at_kill = len(rids)
    third = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert third.returncode == 0, third.stderr
    report = json.loads(third.stdout[third.stdout.index("{"):])
    assert report["complete"] and report["done"] == 24
    assert persisted and not persisted & set(rids[at_kill:])  # no persisted answer asked for again
    generated = [r for r in rids if r.startswith("nocapture:regen:")]
    assert len(set(generated)) == 24 and len(generated) - 24 <= 2  # at most the 2 in flight at the kill
