"""The live grid's alternating rounds: both servers up, every level in rounds of reversed order, so a machine
that drifts during the run weighs on both sides alike."""

from __future__ import annotations

import asyncio
import json
import os
import runpy
from pathlib import Path

import httpx
import pytest

from eaglenest.speculative.loadgen import run_rounds


def drifting_machine(unit_s: float = 0.002):
    """Two identical fake servers on one machine that slows down with every request it serves (the n-th takes
    n units); records which server answered which rid, in order."""
    seen: list[tuple[str, str, list[int]]] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.host, body["rid"], body["input_ids"]))
        await asyncio.sleep(unit_s * len(seen))
        return httpx.Response(200, json={"text": "x", "meta_info": {"completion_tokens": 8}})

    return handler, seen


def test_rounds_alternate_send_each_prompt_once_per_server_and_cancel_the_drift():
    handler, seen = drifting_machine()
    prompts = [[i, i + 1] for i in range(8)]
    got = run_rounds({"a": "http://a", "b": "http://b"}, prompts, [1], rounds=4, max_new_tokens=8,
                     transport=httpx.MockTransport(handler))
    order = [host for host, _, _ in seen]
    assert order == ["a", "a", "b", "b", "b", "b", "a", "a"] * 2  # reversed every other round
    for name in ("a", "b"):
        (lv,), per_round = got[name]
        assert sorted(ids[0] for host, _, ids in seen if host == name) == list(range(8))  # each prompt once
        assert lv.requests == 8 and lv.errors == 0 and lv.output_tokens == 64 and len(per_round["1"]) == 4
    ratio = got["b"][0][0].output_tok_s / got["a"][0][0].output_tok_s
    assert ratio == pytest.approx(1.0, abs=0.15)  # run one after the other, b would look 2.8x slower


def test_rounds_must_fit_the_prompts():
    with pytest.raises(ValueError, match="rounds must be between 1 and the number of prompts"):
        run_rounds({"a": "http://a"}, [[1]], [1], rounds=2, max_new_tokens=4)


class _Started:
    """ServerProcess's interface over an in-thread server already listening; logs what the bench calls."""

    def __init__(self, url: str, log: list[str], name: str) -> None:
        self.url, self.cmd, self.pid, self.log, self.name = url, [name], None, log, name

    def start(self) -> None:
        self.log.append(f"start {self.name}")

    def wait_ready(self, **_: object) -> None:
        self.log.append(f"ready {self.name}")

    def stop(self) -> None:
        self.log.append(f"stop {self.name}")


def test_both_servers_up_together_every_set_in_rounds(spec_tiny):
    from spec_support import one_thread

    from eaglenest.engines.embedded import EmbeddedEngine
    from eaglenest.engines.serving import BackgroundServer
    from eaglenest.speculative.live import bench_servers_together, live_grid

    runner, _, _, seqs, plens = spec_tiny
    prompts = [s[:n] for s, n in zip(seqs, plens, strict=True)][:4]
    engines = [EmbeddedEngine(runner, capture_dir=None) for _ in range(2)]
    log: list[str] = []
    reported: list[tuple[str, str, int]] = []
    try:
        with one_thread(), BackgroundServer(engines[0]) as a, BackgroundServer(engines[1]) as b:
            servers = {"baseline": _Started(a, log, "baseline"), "eagle3": _Started(b, log, "eagle3")}
            res = bench_servers_together(servers, {"x": prompts[:2], "y": prompts[2:]}, [1, 2], rounds=2,
                                         max_new_tokens=5, ignore_eos=True, warmup_requests=1,
                                         progress=lambda srv, st, lv: reported.append((srv, st, lv.concurrency)))
            base, eagle = live_grid(servers["baseline"], servers["eagle3"], prompts, [1], rounds=2,
                                    max_new_tokens=5, ignore_eos=True, warmup_requests=1, requests_per_level=None)
    finally:
        for e in engines:
            e.close()
    # one after another (servers sharing a GPU size their memory from what is free), stopped in reverse
    assert log == ["start baseline", "ready baseline", "start eagle3", "ready eagle3", "stop eagle3",
                   "stop baseline"] * 2
    assert [base.name, eagle.name] == ["baseline", "eagle3"] and len(base.round_tok_s["1"]) == 2
    assert base.levels[0].requests == eagle.levels[0].requests == 4  # 2 per round (its 2 prompts, at least 2c)
    # each level as it finishes, named by its server and its prompt set
    assert reported == [(srv, st, c) for st in "xy" for c in (1, 2) for srv in ("baseline", "eagle3")]
    for name in servers:
        assert list(res[name]) == ["x", "y"]
        for r in res[name].values():
            assert [lv.concurrency for lv in r.levels] == [1, 2] and set(r.round_tok_s) == {"1", "2"}
            assert all(len(v) == 2 for v in r.round_tok_s.values())
            # each round: requests_for(c, 1 prompt) = max(1, 2c) -> 2 at c=1, 4 at c=2; every token answered
            assert [lv.requests for lv in r.levels] == [4, 8] and all(lv.errors == 0 for lv in r.levels)
            assert [lv.output_tokens for lv in r.levels] == [20, 40]


def test_rounds_in_the_bench_config_and_its_server_commands(tmp_path):
    """``rounds`` > 1 puts both servers up at once: two ports, and on SGLang each its share of the GPU's memory
    (the user's --mem-fraction-static is what they hold together, as for the extraction's servers)."""
    from eaglenest.engines.sglang_guards import split_flags
    from eaglenest.speculative.bench import BenchConfig, server_commands

    def fraction_and_port(cmd):
        flags = dict(split_flags(cmd[cmd.index("sglang.launch_server") + 1:]))
        return flags.get("--mem-fraction-static"), flags["--port"]

    one = BenchConfig(draft="/d", engine="sglang", model="/m", mem_fraction_static=0.6)
    assert [fraction_and_port(c) for c in server_commands(one, 30000)] == [("0.6", "30000"), ("0.6", "30000")]
    two = BenchConfig(draft="/d", engine="sglang", model="/m", rounds=2)
    assert [fraction_and_port(c) for c in server_commands(two, 30000, 30001)] == [("0.4", "30000"),
                                                                                  ("0.666", "30001")]
    given = BenchConfig(draft="/d", engine="sglang", model="/m", rounds=4, sglang_args=["--mem-fraction-static", "0.6"])
    base, eagle = server_commands(given, 30000, 30001)
    assert [fraction_and_port(c)[0] for c in (base, eagle)] == ["0.3", "0.428"]
    assert base.count("--mem-fraction-static") == 1 and "--speculative-algorithm" in eagle
    with pytest.raises(ValueError, match="requests_per_level applies to plain levels"):
        BenchConfig(draft="/d", rounds=2, requests_per_level=8)
    with pytest.raises(ValueError, match="each round needs a prompt"):
        BenchConfig(draft="/d", rounds=5, num_prompts=4)


def test_the_baseline_may_run_flags_of_its_own():
    """``baseline_sglang_args`` go to the baseline server alone, after the shared flags (SGLang's argparse keeps the
    last): a gate against the plain server as fast as a user would run it; speculation flags and a non-SGLang
    engine are refused, naming what is wrong."""
    from eaglenest.engines.sglang_guards import split_flags
    from eaglenest.speculative.bench import BenchConfig, server_commands

    def backends(cmd):
        return [v for k, v in split_flags(cmd[cmd.index("sglang.launch_server") + 1:]) if k == "--attention-backend"]

    for rounds, ports in ((1, (30000,)), (2, (30000, 30001))):
        cfg = BenchConfig(draft="/d", engine="sglang", model="/m", rounds=rounds, sglang_args=["--chunked-prefill-size",
                          "4096"], baseline_sglang_args=["--attention-backend", "flashinfer"])
        base, eagle = server_commands(cfg, *ports)
        assert backends(base) == ["triton", "flashinfer"] and backends(eagle) == ["triton"]
        assert "--chunked-prefill-size" in base and "--chunked-prefill-size" in eagle
    with pytest.raises(ValueError, match="decodes without speculation"):
        BenchConfig(draft="/d", engine="sglang", baseline_sglang_args=["--speculative-num-steps", "3"])
    with pytest.raises(ValueError, match="engine sglang"):
        BenchConfig(draft="/d", engine="embedded", baseline_sglang_args=["--attention-backend", "flashinfer"])
    with pytest.raises(ValueError, match=r"\['--port', '--mem-fraction-static'\]: where the servers run"):
        BenchConfig(draft="/d", engine="sglang", baseline_sglang_args=["--port=1", "--mem-fraction-static", "0.9"])
    from eaglenest.pipeline import PipelineBenchParams  # engine "auto" (resolved later) may carry them

    assert PipelineBenchParams(baseline_sglang_args=["--attention-backend", "flashinfer"]).baseline_sglang_args


def test_the_grid_says_how_its_baseline_was_measured(tmp_path):
    """A speedup against a reused baseline (measured alone, earlier) is not an alternated one: the live grid's
    report and matrix say which it is, and how old a reused baseline was."""
    from eaglenest.speculative.baseline import baseline_provenance as provenance

    cached = tmp_path / "server_baseline.json"
    cached.write_text("{}")
    os.utime(cached, (1000.0, 1000.0))
    assert provenance(3, None) == "measured together with EAGLE3, 3 alternating rounds"
    assert provenance(1, str(cached), now=1000.0 + 12 * 60) == (
        f"reused: {cached}, written 12 min before this run (not alternated)")
    assert provenance(1, None) == "measured alone in this run, before EAGLE3 (not alternated)"
    assert provenance(2, None, own_flags=["--attention-backend", "flashinfer"]) == (
        "measured together with EAGLE3, 2 alternating rounds; the baseline's own flags: --attention-backend flashinfer")


def test_a_reused_baseline_must_cover_the_run_and_have_run_alone(tmp_path):
    """gpu_bench_grid.py --baseline-json: a baseline lacking a prompt set or a level, sent another number of requests,
    measured in alternating rounds beside EAGLE3, or not a baseline file at all, is not reused, and the reason names
    what it lacks (2026-12-06c: a one-level rounds baseline was reused for c=1,16 and the run died on the missing
    level after the EAGLE3 launch)."""
    from eaglenest.speculative.baseline import baseline_covers as covers
    from eaglenest.speculative.baseline import reusable_baseline as reusable
    from eaglenest.speculative.live import ServerResult
    from eaglenest.speculative.loadgen import LevelResult

    def level(c: int, requests: int = 40) -> LevelResult:
        return LevelResult(concurrency=c, requests=requests, errors=0, duration_s=1.0, output_tokens=800,
                           output_tok_s=800.0, requests_per_s=40.0, latency_mean_s=0.2, latency_p50_s=0.2,
                           latency_p90_s=0.3, latency_p99_s=0.3, accept_length=None)

    def write(runs: dict[str, ServerResult], name: str = "server_baseline.json") -> str:
        path = tmp_path / name
        path.write_text(json.dumps({n: r.to_json() for n, r in runs.items()}))
        return str(path)

    alone = ServerResult(name="baseline", cmd=[], levels=[level(1), level(16)], server_accept_length=None, startup_s=9)
    ok = write({"mt-bench": alone, "humaneval": alone})
    runs, why = reusable(ok, {"mt-bench": 40}, [1, 16])
    assert set(runs) == {"mt-bench", "humaneval"} and why == ""

    def refused(path: str, counts: dict[str, int], levels: list[int], **kw) -> str:
        runs, why = reusable(path, counts, levels, **kw)
        assert runs is None
        return why

    assert "'mt-bench' lacks concurrency [64]" in refused(ok, {"mt-bench": 40}, [1, 64])
    narrow = write({"mt-bench": ServerResult(name="baseline", cmd=[], levels=[level(1)], server_accept_length=None,
                                             startup_s=9)}, "narrow.json")
    assert covers(ok, narrow) and not covers(narrow, ok)  # a tree's one-level baseline must not replace a wider one
    assert "no prompt set 'sharegpt'" in refused(ok, {"mt-bench": 40, "sharegpt": 40}, [1])
    assert "'mt-bench' at c=1 sent 40 requests, this run sends 80" in refused(ok, {"mt-bench": 80}, [1])
    assert "this run sends 8" in refused(ok, {"mt-bench": 40}, [16], requests_per_level=8)
    rounds = ServerResult(name="baseline", cmd=[], levels=[level(1)], server_accept_length=None, startup_s=9,
                          round_tok_s={"1": [850.0, 849.0, 848.0]})
    assert "alternating rounds beside EAGLE3, not alone" in refused(write({"mt-bench": rounds}), {"mt-bench": 40}, [1])
    # a baseline that ran other server flags (e.g. its own backend) is not this run's baseline
    from eaglenest.speculative.bench import BenchConfig, server_commands

    def launched(**kw) -> list[str]:
        return server_commands(BenchConfig(draft="/d", engine="sglang", model="/m", **kw), 30000)[0]

    ran = ServerResult(name="baseline", cmd=launched(), levels=[level(1)], server_accept_length=None, startup_s=9)
    plain = write({"mt-bench": ran}, "plain.json")
    elsewhere = launched()
    elsewhere[elsewhere.index("--port") + 1] = "30005"
    assert reusable(plain, {"mt-bench": 40}, [1], cmd=elsewhere)[1] == ""  # where it listens aside
    own = launched(baseline_sglang_args=["--attention-backend", "flashinfer"])
    why = refused(plain, {"mt-bench": 40}, [1], cmd=own)
    assert "'mt-bench' ran other server flags" in why and why.endswith("--attention-backend flashinfer")
    garbled = tmp_path / "garbled.json"
    garbled.write_text('{"mt-bench": {"levels": 3}}')
    assert "does not read as a baseline" in refused(str(garbled), {"mt-bench": 40}, [1])
    assert "does not read as a baseline" in refused(str(tmp_path / "missing.json"), {"mt-bench": 40}, [1])


def test_the_report_shows_each_round_and_warns_when_they_disagree():
    """A run in alternating rounds lists each round's speedup in the order they ran, in the Markdown report and in
    the grid's matrix columns, and warns when they disagree (2026-12-06d: rounds of 0.87x, 0.76x and 1.39x pooled to
    0.95x, the same tree alone minutes later 1.51x): the pooled speedup of such a run is no reading."""
    import dataclasses

    from spec_support import level, report

    from eaglenest.speculative.report import markdown_table

    def with_rounds(base_tok_s: list[float], eagle_tok_s: list[float]):
        r = report([level(1, 560.0)], [level(1, 530.0, accept=4.17)])
        return dataclasses.replace(r, baseline=dataclasses.replace(r.baseline, round_tok_s={"1": base_tok_s}),
                                   eagle3=dataclasses.replace(r.eagle3, round_tok_s={"1": eagle_tok_s}))

    noisy = with_rounds([585.3, 589.1, 500.9], [510.7, 447.7, 697.4])
    assert [round(x, 2) for x in noisy.round_speedups()[1]] == [0.87, 0.76, 1.39]
    text = markdown_table(noisy)
    assert "in the order they ran): 0.87x, 0.76x, 1.39x; median 0.87x" in text
    assert "WARNING: at concurrency 1 the rounds disagree (0.76x to 1.39x)" in text
    steady = with_rounds([600.0, 610.0, 590.0], [750.0, 770.0, 760.0])
    assert "median 1.26x" in markdown_table(steady) and "rounds disagree" not in markdown_table(steady)
    assert "each alternating round" not in markdown_table(report([level(1, 560.0)], [level(1, 700.0, accept=3.0)]))
    assert "rounds disagree (0.00x to 1.27x)" in markdown_table(with_rounds([600.0, 610.0], [0.0, 775.0]))

    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu_bench_grid.py"
    columns = runpy.run_path(str(script))["round_columns"]
    assert columns(noisy, 1) == {"speedup_rounds": [0.873, 0.76, 1.392], "speedup_median": 0.873}
    assert columns(noisy, 16) == {}


def test_answers_are_kept_by_prompt_and_compared_paired_across_servers():
    """Two servers answer the same prompts in alternating rounds; server b answers prompt 5 otherwise (a near-tie
    flipped). Each answer is recorded under its prompt's index in the whole set, and the comparison pairs the
    identical answers only, with each side's accept length over those."""
    from eaglenest.speculative.loadgen import answer_digest, compare_answers

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        p = body["input_ids"][0]
        ids = [p, p + 1, 7 if request.url.host == "b" and p == 5 else 8]
        correct = 2 if request.url.host == "a" else 1  # a drafts better: 3 accepted a verify, b 2
        return httpx.Response(200, json={"text": "t", "output_ids": ids, "meta_info": {
            "completion_tokens": 3, "spec_verify_ct": 1, "spec_num_correct_drafts": correct}})

    prompts = [[i, i + 1] for i in range(8)]
    got = run_rounds({"a": "http://a", "b": "http://b"}, prompts, [1], rounds=3, max_new_tokens=3,
                     transport=httpx.MockTransport(handler))
    (a,), _ = got["a"]
    (b,), _ = got["b"]
    assert sorted(row[0] for row in a.answers) == list(range(8))  # rounds slice the set; the index is the set's
    for row in a.answers:  # the index names the prompt that was sent (its answer starts with the prompt's first id)
        assert row[4] == answer_digest({"output_ids": [row[0], row[0] + 1, 8]})
    same = compare_answers(a, b)
    assert same == {"prompts": 8, "identical": 7, "accept_a": pytest.approx(3.0), "accept_b": pytest.approx(2.0)}
    from eaglenest.speculative.loadgen import LevelResult
    assert LevelResult.from_json(json.loads(json.dumps(a.to_json()))).answers == a.answers  # report.json's round trip
    old = {k: v for k, v in a.to_json().items() if k != "answers"}  # a level written before answers were kept
    assert compare_answers(LevelResult.from_json(old), b) is None


def test_the_report_says_how_many_answers_match_the_baseline():
    import dataclasses

    from spec_support import level, report

    from eaglenest.speculative.report import markdown_table
    base = dataclasses.replace(level(1, 100.0), answers=[[0, 3, 0, None, "d0"], [1, 3, 0, None, "d1"],
                                                         [2, 3, 0, None, "d2"]])
    eagle = dataclasses.replace(level(1, 150.0, accept=2.0), answers=[[0, 3, 1, 1, "d0"], [1, 3, 1, 1, "x1"],
                                                                       [2, 3, 1, 1, "d2"]])
    md = markdown_table(report([base], [eagle]))
    assert "concurrency 1: on 2 of 3 prompts EAGLE3 answered as the baseline, token for token" in md
    assert "answered as the baseline" not in markdown_table(report([level(1, 100.0)], [level(1, 150.0, 2.0)]))


def test_paired_answers_script_pairs_two_reports(tmp_path, capsys):
    import dataclasses
    import runpy

    from spec_support import level, report

    from eaglenest.speculative.report import write_report
    rows = {"a": [[0, 4, 2, 2, "d0"], [1, 4, 2, 2, "d1"]], "b": [[0, 4, 1, 3, "d0"], [1, 4, 2, 2, "zz"]]}
    for name, answers in rows.items():
        eagle = dataclasses.replace(level(1, 150.0, accept=2.0), answers=answers)
        write_report(report([level(1, 100.0)], [eagle]), tmp_path / name, plots=False)
    main = runpy.run_path("scripts/paired_answers.py")["main"]
    got = main([str(tmp_path / "a" / "report.json"), str(tmp_path / "b" / "report.json")])
    assert got == {1: {"prompts": 2, "identical": 1, "accept_a": 2.0, "accept_b": 4.0}}
    assert '"identical": 1' in capsys.readouterr().out
    write_report(report([level(1, 100.0)], [level(1, 150.0, 2.0)]), tmp_path / "old", plots=False)
    with pytest.raises(SystemExit, match="records its answers"):
        main([str(tmp_path / "a" / "report.json"), str(tmp_path / "old" / "report.json")])
    write_report(dataclasses.replace(report([level(1, 100.0)], [eagle]), num_prompts=40), tmp_path / "c", plots=False)
    with pytest.raises(SystemExit, match="num_prompts 80 / 40"):
        main([str(tmp_path / "a" / "report.json"), str(tmp_path / "c" / "report.json")])

