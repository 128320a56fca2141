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


def test_bench_serve_shape_flags():
    from eaglenest.speculative.serve import bench_serve_command
    from eaglenest.speculative.tree import SpecShape

    eagle = ["bench", "serve", "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/d"]
    wide = {"COLUMNS": "250"}  # typer's error panel must not wrap the messages checked here
    for extra in (["--speculative-num-steps", "3"], ["--speculative-eagle-topk", "2"]):
        res = CliRunner().invoke(app, [*eagle, "--speculative-shape", "chain3", *extra], env=wide)
        assert res.exit_code != 0 and "not both" in res.output, extra
    res = CliRunner().invoke(app, [*eagle, "--speculative-shape", "chain3p2"], env=wide)
    assert res.exit_code != 0 and "chainDpP" in res.output
    res = CliRunner().invoke(app, ["bench", "serve", "--speculative-shape", "chain3"], env=wide)
    assert res.exit_code != 0 and "needs --speculative-algorithm" in res.output
    # the shape goes by name (SGLang's flags cannot say a confidence stop); none: the server's measured best
    cmd = bench_serve_command(model="/m", port=1, draft="/d")
    assert "--speculative-draft-model-path" in cmd and "--speculative-shape" not in cmd
    cmd = bench_serve_command(model="/m", port=1, draft="/d", shape=SpecShape.parse("chain4p0.35"))
    assert cmd[cmd.index("--speculative-shape") + 1] == "chain4p0.35"


def test_bench_config_runs_the_measured_best_shape_on_the_embedded_engine():
    """No speculation flags: the embedded decoder's measured best shape, named in the report's spec; the SGLang
    flags when given (and always on SGLang); ``shape`` by name, embedded only, not beside the flags."""
    import pytest

    from eaglenest.speculative.bench import BenchConfig, _spec_json
    from eaglenest.speculative.serve import SGLANG_BEST, SpecConfig
    from eaglenest.speculative.tree import SpecShape, measured_best_shape

    best = measured_best_shape()
    cfg = BenchConfig(draft="/d")
    assert cfg.spec_shape == best and _spec_json(cfg)["shape"] == best.name
    assert _spec_json(cfg)["num_draft_tokens"] == best.nodes + 1
    assert BenchConfig(draft="/d", num_steps=3).spec_shape == SpecShape(depth=3)
    assert BenchConfig(draft="/d", shape="chain4p0.35").spec_shape == SpecShape(depth=4, min_prob=0.35)
    sglang = BenchConfig(draft="/d", engine="sglang")
    # SGLang's shape is the measured best there (a tree), not the CPU's shape; flags given, SGLang's own defaults
    assert sglang.spec == SGLANG_BEST and sglang.spec_shape == SpecShape(depth=6, topk=10, draft_tokens=63)
    assert _spec_json(sglang) == {"num_steps": 6, "topk": 10, "num_draft_tokens": 64}
    assert SGLANG_BEST.sglang_args("/d")[-6:] == ["--speculative-num-steps", "6", "--speculative-eagle-topk", "10",
                                                  "--speculative-num-draft-tokens", "64"]
    steps3 = BenchConfig(draft="/d", engine="sglang", num_steps=3)
    assert steps3.spec_shape == SpecShape(depth=3) and _spec_json(steps3)["num_draft_tokens"] == 4
    assert BenchConfig(draft="/d", engine="sglang", topk=2, num_draft_tokens=6).spec.num_steps == SpecConfig().num_steps
    with pytest.raises(ValueError, match="embedded"):
        BenchConfig(draft="/d", engine="sglang", shape="chain3")
    with pytest.raises(ValueError, match="not both"):
        BenchConfig(draft="/d", shape="chain3", num_steps=3)
    with pytest.raises(ValueError, match="chainDpP"):
        BenchConfig(draft="/d", shape="chain3p7")


def test_bench_offline_needs_a_store_or_prompt_sets():
    res = CliRunner().invoke(app, ["bench", "offline", "--draft", "/d"])
    assert res.exit_code != 0 and "--prompt-set" in res.output


def test_bench_offline_shapes_are_replayed_on_prompt_sets_only():
    res = CliRunner().invoke(app, ["bench", "offline", "--draft", "/d", "--store", "/s", "--shape", "tree6x4n15"])
    assert res.exit_code != 0 and "--prompt-set" in res.output
    res = CliRunner().invoke(app, ["bench", "offline", "--draft", "/d", "--prompt-set", "mt-bench",
                                   "--shape", "tree6x4"])
    assert res.exit_code != 0 and "treeDxKnN" in res.output


def test_a_tree_estimate_is_its_replay_with_the_chain_beside_it():
    from eaglenest.speculative.bench import with_tree
    from eaglenest.speculative.offline import ReplayResult
    from eaglenest.speculative.report import offline_estimate

    chain = {"samples": 8, "num_steps": 6, "accept_length": 3.0, "accept_length_cycles": 2.8, "cycles": 90,
             "target_agreement": 1.0, "sample_ids": ["a", "b"], "conditional_at": [0.9]}
    out = with_tree(chain, ReplayResult(shape="tree6x4n15", samples=8, cycles=60, accept_length_cycles=3.6))
    assert offline_estimate(out) == 3.6 and out["accept_length"] is None and out["chain"] == chain
    assert out["sample_ids"] == ["a", "b"] and "conditional_at" not in out and out["shape"] == "tree6x4n15"


def test_bench_offline_on_prompts_refuses_a_token_file():
    import pytest

    from eaglenest.speculative.bench import BenchConfig

    with pytest.raises(ValueError, match="offline_on_prompts"):
        BenchConfig(draft="d", prompt_file="p.jsonl", offline_on_prompts=True)


def test_bench_depth_joins_grids_and_names_the_best_depth(tmp_path):
    def matrix(steps, rows):
        return {"rows": [{"prompt_set": s, "steps": steps, "concurrency": c, "speedup": x, "accept_length": a}
                         for s, c, x, a in rows]}

    paths = []
    for steps, rows in ((3, [("mt-bench", 1, 0.9, 2.2), ("mt-bench", 16, 0.6, 2.1)]),
                        (7, [("mt-bench", 1, 1.1, 2.6), ("mt-bench", 16, 0.5, 2.4)])):
        paths.append(tmp_path / f"m{steps}.json")
        paths[-1].write_text(json.dumps(matrix(steps, rows)))
    res = CliRunner().invoke(app, ["bench", "depth", *map(str, paths), "--out", str(tmp_path / "d")])
    assert res.exit_code == 0, res.output
    assert "mt-bench c=1: best steps 7, 1.10x" in res.output and "mt-bench c=16: best steps 3, 0.60x" in res.output
    rows = json.loads((tmp_path / "d" / "depth.json").read_text())["rows"]
    assert [(r["concurrency"], r["steps"]) for r in rows] == [(1, 3), (1, 7), (16, 3), (16, 7)]
    assert (tmp_path / "d" / "depth.png").stat().st_size > 1000
    (tmp_path / "bad.json").write_text(json.dumps({"prompt_set": "mt-bench"}))
    res = CliRunner().invoke(app, ["bench", "depth", str(tmp_path / "bad.json")])
    assert res.exit_code != 0 and "not a matrix.json" in res.output
