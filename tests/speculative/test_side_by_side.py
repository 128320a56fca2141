"""Side by side: several EAGLE3 servers (drafters, verify kernels, trees) up together beside one baseline in the
same alternating rounds, how gpu_bench_grid.py reports them, and how the readers of its matrix keep them apart."""

from __future__ import annotations

import json
import os
import runpy
from pathlib import Path

import pytest

GRID = Path(__file__).resolve().parents[2] / "scripts" / "gpu_bench_grid.py"


@pytest.fixture
def fake_grid(tmp_path, monkeypatch):
    """gpu_bench_grid.py's main with no GPU: the servers are their commands, never started; measuring them together
    returns each server's ``tok_s`` per round (label -> list) and ``accept`` (label -> accept length) set on the
    returned namespace; ``launched`` gets the servers' commands by label. $OUT is tmp_path, the prompt set
    MT-Bench (``prompts`` of them)."""
    from types import SimpleNamespace

    from spec_support import level

    from eaglenest.speculative.bench import Prompts
    from eaglenest.speculative.live import ServerResult

    main = runpy.run_path(str(GRID))["main"]
    fake = SimpleNamespace(main=main, launched={}, tok_s={}, accept={}, prompts=3)

    def together(servers, prompt_sets, concurrencies, *, rounds, **_):
        fake.launched.update(servers)
        return {n: {s: ServerResult(name=n, cmd=[n], server_accept_length=fake.accept.get(n), startup_s=1.0,
                                    levels=[level(1, sum(fake.tok_s[n]) / rounds, accept=fake.accept.get(n))],
                                    round_tok_s={"1": fake.tok_s[n]}) for s in prompt_sets} for n in servers}

    grid = main.__globals__  # (the script's own globals: what main looks up)
    monkeypatch.setitem(grid, "bench_servers_together", together)
    monkeypatch.setitem(grid, "local_server", lambda cmd, **kw: cmd)
    monkeypatch.setitem(grid, "end_recorded_servers", lambda path: None)
    monkeypatch.setitem(grid, "gpu_name", lambda: "fake GPU")
    monkeypatch.setitem(grid, "prepare_prompts", lambda cfg: Prompts(
        name="mt-bench", source="x", token_ids=[[i, i + 1] for i in range(fake.prompts)]))
    monkeypatch.setenv("OUT", str(tmp_path))
    return fake


def test_several_eagle3_servers_share_the_rounds_and_the_gpu(tmp_path):
    """Two drafters (or verify kernels) compared side by side: the baseline and one EAGLE3 server per variant, all
    up at once on one GPU (each its share of the memory, its own port and drafter), on the CPU engine as well; the
    grid's side_by_side rows give each variant's tok/s over the first's in every round they shared."""
    from eaglenest.engines.sglang_guards import split_flags
    from eaglenest.speculative.bench import BenchConfig, server_commands
    from eaglenest.speculative.live import ServerResult

    def flags(cmd):
        return dict(split_flags(cmd[cmd.index("sglang.launch_server") + 1:]))

    cfg = BenchConfig(draft="/a", engine="sglang", model="/m", rounds=3, num_steps=7, topk=8, num_draft_tokens=48)
    other = cfg.model_copy(update={"draft": "/b"})
    cmds = server_commands(cfg, 30000, 30001, 30002, variants=[cfg, other])
    got = [(f.get("--mem-fraction-static"), f["--port"], f.get("--speculative-draft-model-path"))
           for f in map(flags, cmds)]
    assert got == [("0.266", "30000", None), ("0.363", "30001", "/a"), ("0.571", "30002", "/b")]
    assert all(flags(c)["--speculative-eagle-topk"] == "8" for c in cmds[1:])
    assert len(server_commands(cfg, 30000)) == 2  # no variants: the config's own EAGLE3 server
    with pytest.raises(ValueError, match="2 EAGLE3 servers need as many ports"):
        server_commands(cfg, 30000, 30001, variants=[cfg, other])
    (tmp_path / "config.json").write_text("{}")  # (the CPU engine's model must be a local folder)
    cpu = BenchConfig(draft="/a", engine="embedded", model=str(tmp_path), rounds=2)
    cpu_cmds = server_commands(cpu, 9000, 9001, 9002, variants=[cpu, cpu.model_copy(update={"draft": "/b"})])
    assert [c[c.index("--port") + 1] for c in cpu_cmds] == ["9000", "9001", "9002"]
    assert [c[c.index("--speculative-draft-model-path") + 1] for c in cpu_cmds[1:]] == ["/a", "/b"]

    from spec_support import level

    def server(name: str, tok_s: list[float], accept: float) -> ServerResult:
        return ServerResult(name=name, cmd=[], levels=[level(1, sum(tok_s) / 3, accept=accept)],
                            server_accept_length=None, startup_s=1.0, round_tok_s={"1": tok_s})

    side_by_side = runpy.run_path(str(GRID))["side_by_side"]
    rows = side_by_side({"eagle3@7-sglang": server("a", [1000.0, 900.0, 1100.0], 4.3),
                         "eagle3@7-splitkv": server("b", [1050.0, 900.0, 1210.0], 4.29)},
                        prompt_set="mt-bench", steps={"eagle3@7-sglang": 7, "eagle3@7-splitkv": 7})
    assert rows == [{"prompt_set": "mt-bench", "steps": 7, "versus_steps": 7, "concurrency": 1,
                     "variant": "eagle3@7-splitkv", "versus": "eagle3@7-sglang", "ratio_rounds": [1.05, 1.0, 1.1],
                     "ratio_median": 1.05,
                     "accept_length": 4.29, "versus_accept_length": 4.3}]
    assert side_by_side({"eagle3@7": server("a", [1.0, 1.0, 1.0], 4.0)}, prompt_set="x", steps={"eagle3@7": 7}) == []


def test_the_grid_compares_variants_only_in_shared_rounds(tmp_path):
    """Several drafters or verify kernels without --rounds would be measured one after another (the machine's drift
    between them unaccounted for): refused before anything starts, as is an unknown kernel."""
    import subprocess
    import sys

    def refused(*args: str) -> str:
        p = subprocess.run([sys.executable, str(GRID), "--model", "/m", "--prompts", "/p.jsonl", *args],
                           capture_output=True, text=True, env={**os.environ, "OUT": str(tmp_path)})
        assert p.returncode == 2
        return p.stderr

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir(), (tmp_path / "c").mkdir(), (tmp_path / "c" / "a").mkdir()
    assert "--rounds 2 or more" in refused("--draft", f"{a},{b}")
    assert "--rounds 2 or more" in refused("--draft", str(a), "--verify-kernel", "sglang,splitkv")
    assert "--verify-kernel fast: not one of sglang, splitkv" in refused("--draft", str(a), "--verify-kernel", "fast")
    assert "a kernel named twice" in refused("--draft", str(a), "--verify-kernel", "splitkv,splitkv", "--rounds", "2")
    # a mistyped or empty drafter entry is refused before the baseline's and the others' launches (minutes)
    assert f"no drafter folder at '{tmp_path}/typo', ''" in refused("--draft", f"{a},{tmp_path}/typo,", "--rounds", "2")
    assert "two drafters share a folder name" in refused("--draft", f"{a},{tmp_path}/c/a", "--rounds", "2")


def test_a_side_by_side_matrix_is_read_one_drafter_at_a_time():
    """The readers of matrix.json keep a side-by-side grid's drafters apart: the calibration takes the named
    drafter's live accept lengths (by folder name: the GPU's path differs) and refuses to guess; a depth sweep
    refuses such a matrix rather than keep whichever variant came last."""
    from eaglenest.speculative.calibration import live_accepts
    from eaglenest.speculative.report import depth_sweep

    def row(draft: str, accept: float, kernel: str = "sglang") -> dict:
        return {"prompt_set": "mt-bench", "steps": 7, "topk": 8, "draft_tokens": 48, "concurrency": 1,
                "variant": f"eagle3@7-{Path(draft).name}", "draft": draft, "verify_kernel": kernel,
                "accept_length": accept, "speedup": 1.4}

    grid = {"rows": [row("/tmp/init-drafter/n17", 4.3), row("/tmp/init-drafter/n18", 4.4)]}
    (only,) = live_accepts(grid, "matrix.json", ".gpu-drafters/n18")
    assert only.accept_length == 4.4
    with pytest.raises(ValueError, match=r"\(/tmp/init-drafter/n17, /tmp/init-drafter/n18\): name the one"):
        live_accepts(grid, "matrix.json")
    with pytest.raises(ValueError, match="none named n19"):
        live_accepts(grid, "matrix.json", "n19")
    assert len(live_accepts({"rows": [row("/d/n17", 4.3)]}, "m.json")) == 1  # one drafter: as before
    with pytest.raises(ValueError, match="matrix 1 served 2 EAGLE3 variants side by side"):
        depth_sweep([{"rows": [row("/d/n17", 4.3), row("/d/n17", 4.3, "splitkv")]}])
    assert len(depth_sweep([{"rows": [row("/d/n17", 4.3)]}, {"rows": [{**row("/d/n17", 4.5), "steps": 5}]}])) == 2


def test_the_grid_reports_each_variant_against_the_shared_baseline(tmp_path, monkeypatch, fake_grid):
    """gpu_bench_grid.py with two drafters and --rounds 3 (servers faked, no GPU): ONE launch of the baseline and
    both EAGLE3 servers together, each drafter's report (under steps7/<label>) and matrix rows against that one
    baseline, and the side_by_side row of the second over the first, round by round."""
    fake_grid.tok_s = {"baseline": [800.0, 700.0, 810.0], "eagle3@7-a": [1120.0, 980.0, 1130.0],
                       "eagle3@7-b": [1176.0, 980.0, 1243.0]}
    fake_grid.accept = {"eagle3@7-a": 4.3, "eagle3@7-b": 4.4}
    (tmp_path / "x" / "a").mkdir(parents=True), (tmp_path / "x" / "b").mkdir()
    monkeypatch.chdir(tmp_path)  # (the drafters' folders, relative: x/a and x/b)
    monkeypatch.setattr("sys.argv", ["gpu_bench_grid.py", "--model", "/m", "--draft", "x/a,x/b", "--prompts",
                                     "/p.jsonl", "--concurrency", "1", "--steps", "7", "--topk", "8",
                                     "--draft-tokens", "48", "--rounds", "3"])
    assert fake_grid.main() == 0
    assert list(fake_grid.launched) == ["baseline", "eagle3@7-a", "eagle3@7-b"]
    matrix = json.loads((tmp_path / "matrix.json").read_text())
    rows = {r["variant"]: r for r in matrix["rows"]}
    assert set(rows) == {"eagle3@7-a", "eagle3@7-b"} and rows["eagle3@7-b"]["draft"] == "x/b"
    assert rows["eagle3@7-a"]["speedup_rounds"] == [1.4, 1.4, 1.395]
    assert rows["eagle3@7-b"]["baseline_tok_s"] == rows["eagle3@7-a"]["baseline_tok_s"]  # one shared baseline
    assert matrix["side_by_side"] == [{"prompt_set": "mt-bench", "steps": 7, "versus_steps": 7, "concurrency": 1,
                                       "variant": "eagle3@7-b", "versus": "eagle3@7-a",
                                       "ratio_rounds": [1.05, 1.0, 1.1], "ratio_median": 1.05,
                                       "accept_length": 4.4, "versus_accept_length": 4.3}]
    for label in ("7-a", "7-b"):
        report = json.loads((tmp_path / "mt-bench" / "steps7" / label / "report.json").read_text())
        assert report["draft"] == f"x/{label[-1]}"


def test_the_grid_serves_shapes_side_by_side(tmp_path, monkeypatch, capsys, fake_grid):
    """--shapes 6x8x49,7x8x48 --rounds 2 (servers faked): both trees up together beside one baseline, each with its
    own flags, report (shapes/<shape>) and matrix rows, and the second's tok/s over the first's round by round;
    a malformed shape, or one beside --steps, is refused before anything starts."""
    from eaglenest.engines.sglang_guards import split_flags

    fake_grid.tok_s = {"baseline": [800.0, 700.0], "eagle3@6x8x49": [1100.0, 1000.0],
                       "eagle3@7x8x48": [1155.0, 1000.0]}
    fake_grid.accept = {"eagle3@6x8x49": 4.2, "eagle3@7x8x48": 4.2}
    fake_grid.prompts = 2
    (tmp_path / "d").mkdir()
    argv = ["gpu_bench_grid.py", "--model", "/m", "--draft", str(tmp_path / "d"), "--prompts", "/p.jsonl",
            "--concurrency", "1", "--rounds", "2"]
    monkeypatch.setattr("sys.argv", [*argv, "--shapes", "6x8x49,7x8x48"])
    assert fake_grid.main() == 0
    flags = {n: dict(split_flags(cmd[cmd.index("sglang.launch_server") + 1:])) for n, cmd in fake_grid.launched.items()}
    assert [(f["--speculative-num-steps"], f["--speculative-eagle-topk"], f["--speculative-num-draft-tokens"])
            for n, f in flags.items() if n != "baseline"] == [("6", "8", "49"), ("7", "8", "48")]
    matrix = json.loads((tmp_path / "matrix.json").read_text())
    assert [(r["variant"], r["steps"], r["draft_tokens"]) for r in matrix["rows"]] == [
        ("eagle3@6x8x49", 6, 49), ("eagle3@7x8x48", 7, 48)]
    (row,) = matrix["side_by_side"]
    assert row["variant"] == "eagle3@7x8x48" and row["ratio_rounds"] == [1.05, 1.0]
    assert (row["steps"], row["versus_steps"]) == (7, 6)  # each tree's own depth
    assert (tmp_path / "mt-bench" / "shapes" / "7x8x48" / "report.json").is_file()
    for bad, why in ((["--shapes", "7x8"], "each shape is STEPSxTOPKxDRAFT_TOKENS"),
                     (["--shapes", "7x8x48", "--steps", "5"], "no --steps, --topk or --draft-tokens")):
        monkeypatch.setattr("sys.argv", [*argv, *bad])
        with pytest.raises(SystemExit):
            fake_grid.main()
        assert why in capsys.readouterr().err
