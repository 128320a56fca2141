"""``eaglenest extract`` on the command line: options -> ExtractParams -> run, JSON report, exit codes."""

import json

from typer.testing import CliRunner

from eaglenest.cli import app


def test_cli_extracts_and_resumes(tiny_model_dir, tmp_path, capture_servers):
    out = tmp_path / "out"
    ((url, engine),) = capture_servers(out / "cli" / "capture")
    args = ["extract", "--recipe", "capture", "--model", str(tiny_model_dir), "--server-url", url, "--limit", "40",
            "--max-turns", "1",
            "--max-tokens", "384", "--output-dir", str(out), "--extraction-id", "cli", "--batch-size", "8", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout[result.stdout.index("{"):])
    assert report["complete"] and report["done"] == report["samples"] > 0
    assert report["done"] == len((out / "cli" / "ledger.jsonl").read_text().splitlines())
    for stage in ("prepare", "connect", "stream", "stop_servers"):  # on stderr as each ends (a log outlives a report)
        assert f"extract: {stage} took" in result.stderr, result.stderr
    sent = engine.stats["requests"]
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0 and json.loads(again.stdout[again.stdout.index("{"):])["run"]["requests"] == 0
    assert engine.stats["requests"] == sent


def test_cli_refuses_a_bad_option_naming_it(tmp_path):
    result = CliRunner().invoke(app, ["extract", "--engine", "vllm", "--output-dir", str(tmp_path)])
    assert result.exit_code == 2 and "engine" in result.output
