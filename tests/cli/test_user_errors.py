"""Expected user mistakes end in one line that says what and what to do, and exit code 2 (no traceback)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from eaglenest.cli import main

CASES = {
    "missing source": (["extract", "--source", "{tmp}/missing.jsonl", "--model", "{model}"], "does not exist"),
    "unknown protocol": (["extract", "--source", "foo://x.jsonl", "--model", "{model}"], "Protocol not known: foo"),
    "missing model": (["extract", "--model", "{tmp}/no-model"], "local Hugging Face folder"),
    "negative lr": (["train", "--store", "{tmp}/s", "--out", "{tmp}/t", "--lr", "-0.001"], "lr: Input should be"),
    "zero epochs": (["train", "--store", "{tmp}/s", "--out", "{tmp}/t", "--epochs", "0"], "epochs: Input should be"),
    "unknown --set field": (["train", "--store", "{tmp}/s", "--out", "{tmp}/t", "--set", "nosuch=1"],
                            "'nosuch' is not a TrainConfig field"),
    "missing store": (["train", "--store", "{tmp}/no-store", "--out", "{tmp}/t"], "no committed store"),
    "export into an existing folder": (["export", "{tmp}/run", "{tmp}"], "exists; pass overwrite"),
    "greedy self-prompting": (["prompts", "self", "--out", "{tmp}/p.jsonl", "--model", "{model}", "--temperature", "0"],
                              "temperature must be > 0"),
    "unknown starter set": (["prompts", "self", "--out", "{tmp}/p.jsonl", "--model", "{model}", "--starter-set",
                             "kinds", "--starter-set", "poems"],
                            "--starter-set 'poems': not a built-in set (have: kinds, code, creative)"),
    "opening with a trailing space": (["prompts", "self", "--out", "{tmp}/p.jsonl", "--model", "{model}",
                                       "--starter", "Solve "], "starters must not begin or end with whitespace"),
    "self prompts without answers": (["extract", "--model", "{model}", "--recipe", "capture", "--self-prompts", "5"],
                                     "self_prompts: the target's own prompts come without answers"),
    "extraction's unknown starter set": (["extract", "--model", "{model}", "--self-prompts", "5",
                                          "--self-starter-set", "poems"], "starter_sets: 'poems': not a built-in set"),
}


@pytest.mark.parametrize("case", CASES)
def test_user_mistake_is_one_line_and_exit_2(case, tiny_model_dir, tmp_path, capsys):
    args, expected = CASES[case]
    args = [a.format(tmp=tmp_path, model=tiny_model_dir) for a in args]
    assert main(args) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("eaglenest: error:")]
    assert len(lines) == 1 and expected in lines[0], err
    assert "Traceback" not in err


def test_self_prompts_exclude_file_of_another_shape(tiny_model_dir, tmp_path, capsys):
    bad = tmp_path / "texts.json"
    bad.write_text('{"mt-bench": ["a question"]}')
    args = ["prompts", "self", "--out", str(tmp_path / "p.jsonl"), "--model", str(tiny_model_dir),
            "--exclude-file", str(bad)]
    assert main(args) == 2
    assert f"--exclude-file {bad}: expected a JSON list of strings" in capsys.readouterr().err
    assert not (tmp_path / "p.jsonl").exists()  # refused before any server was launched


def test_debug_keeps_the_traceback(tmp_path):
    with pytest.raises(Exception, match="no committed store"):
        main(["train", "--store", str(tmp_path / "no-store"), "--out", str(tmp_path / "t"), "--debug"])


def _run(code: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=240,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})


def test_store_info_on_s3_without_s3fs(tmp_path):
    code = ("import sys; sys.modules['s3fs'] = None  # as if s3fs were not installed\n"
            "from eaglenest.cli import main; raise SystemExit(main(['store', 'info', 's3://bucket/store']))")
    r = _run(code, tmp_path)
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: s3://bucket/store: s3:// needs s3fs"), r.stderr
    assert last.endswith("pip install 'eaglenest[s3]'"), r.stderr  # names the extra to install
    assert "Traceback" not in r.stderr


def test_pipeline_params_file_missing(tmp_path):
    r = _run(f"import sys; from flows.pipeline import main; sys.exit(main(['--params', "
             f"{str(tmp_path / 'missing.json')!r}]))", tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [f"flows.pipeline: error: --params {tmp_path / 'missing.json'}: no such "
                                             "file (give a PipelineParams JSON file, or the JSON itself)"]


def test_prompts_self_takes_every_starter_set_named(tiny_model_dir, tmp_path, monkeypatch):
    """--starter-set is repeatable: the openings are --starter's, then each named set's, in the order given."""
    from eaglenest.extraction import self_prompts as sp

    seen = []
    monkeypatch.setattr(sp, "self_prompts", lambda urls, model, cfg, out, **kw: seen.append((urls, cfg)) or {})
    assert main(["prompts", "self", "--out", str(tmp_path / "p.jsonl"), "--model", str(tiny_model_dir),
                 "--server-url", "http://127.0.0.1:9", "--starter", "Go on:", "--starter-set", "code",
                 "--starter-set", "kinds"]) == 0
    [(urls, cfg)] = seen
    assert urls == ["http://127.0.0.1:9"]
    assert cfg.starters == ("Go on:", *sp.STARTER_SETS["code"], *sp.STARTER_SETS["kinds"])


def test_prompts_self_launches_an_embedded_server_and_stops_it(tiny_model_dir, tmp_path, monkeypatch):
    """No --server-url: one embedded server of --model is launched for the call (and ended); 3 prompts are asked,
    none can end within 1 token, so nothing is kept and the error says why."""
    from eaglenest.engines import pool

    port = pool.free_port()
    monkeypatch.setattr(pool, "free_port", lambda *a, **k: port)  # the port the command will launch on
    out = tmp_path / "p.jsonl"
    with pytest.raises(RuntimeError, match=r"no prompt was kept of 3 \(skipped \{'cut': 3\}, failed \{\}\)"):
        main(["prompts", "self", "--out", str(out), "--model", str(tiny_model_dir), "--count", "3",
              "--max-new-tokens", "1", "--concurrency", "3"])
    assert not out.exists()
    assert not pool.port_serving(f"http://127.0.0.1:{port}")  # the server was ended with the call
