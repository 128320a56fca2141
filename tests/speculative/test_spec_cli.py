"""`eaglenest bench ...` parses and calls the library (cheap commands only; `live` runs in the flow test)."""

from __future__ import annotations

import json

from spec_support import level, report
from typer.testing import CliRunner

from eaglenest.cli import app


def test_bench_plot_renders_a_fetched_report(tmp_path):
    r = report([level(1, 100), level(4, 300)], [level(1, 150, 2.5), level(4, 240, 2.4)])
    (tmp_path / "report.json").write_text(json.dumps(r.to_json()))
    res = CliRunner().invoke(app, ["bench", "plot", str(tmp_path / "report.json")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "tok_s.png").is_file()
    assert "| 4 | 300.0 | 240.0 | 0.80x |" in (tmp_path / "report.md").read_text()


def test_bench_serve_refuses_half_a_speculative_config():
    res = CliRunner().invoke(app, ["bench", "serve", "--speculative-draft-model-path", "/d"])
    assert res.exit_code != 0 and "speculative-algorithm" in res.output
    res = CliRunner().invoke(app, ["bench", "serve", "--speculative-algorithm", "MEDUSA",
                                   "--speculative-draft-model-path", "/d"])
    assert res.exit_code != 0 and "EAGLE3" in res.output
