"""Live benchmark driver, the embedded EAGLE3 server, the report files and the deployment gate."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from spec_support import level, one_thread, report

from eaglenest.speculative.live import bench_server_sets, server_accept_length, server_info, sglang_command
from eaglenest.speculative.loadgen import drive_level, percentile, run_levels
from eaglenest.speculative.report import GateFailed, gate, read_report, require_gate, write_report
from eaglenest.speculative.serve import SpecConfig


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


def fake_sglang(fail_every: int = 0):
    """An async /generate handler speaking SGLang's meta_info; counts requests in flight."""
    state = {"inflight": 0, "max_inflight": 0, "n": 0, "rids": []}

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        state["n"] += 1
        nth = state["n"]
        state["rids"].append(body["rid"])
        state["inflight"] += 1
        state["max_inflight"] = max(state["max_inflight"], state["inflight"])
        await asyncio.sleep(0.001)
        state["inflight"] -= 1
        if fail_every and nth % fail_every == 0:
            return httpx.Response(503, json={"error": "overloaded"})
        n = body["sampling_params"]["max_new_tokens"]
        return httpx.Response(200, json={"text": "x", "meta_info": {
            "completion_tokens": n, "spec_verify_ct": 4, "spec_num_correct_drafts": 6}})

    return handler, state


def test_driver_keeps_concurrency_and_reads_sglang_meta_info():
    handler, state = fake_sglang()
    lv = asyncio.run(drive_level("http://fake", [[1, 2, 3], [4, 5]], concurrency=4, num_requests=10,
                                 max_new_tokens=12, transport=httpx.MockTransport(handler)))
    assert state["n"] == 10 and state["max_inflight"] == 4
    assert all(r.startswith("nocapture:") for r in state["rids"])  # never captured by a capture server
    assert lv.requests == 10 and lv.errors == 0 and lv.output_tokens == 120
    assert lv.accept_length == pytest.approx((6 + 4) / 4)  # (correct drafts + verify) / verify: bonus counted
    assert lv.output_tok_s == pytest.approx(120 / lv.duration_s)
    assert lv.latency_p50_s <= lv.latency_p90_s <= lv.latency_p99_s


def test_driver_counts_failures_per_request():
    handler, _ = fake_sglang(fail_every=3)
    lv = asyncio.run(drive_level("http://fake", [[1, 2]], concurrency=2, num_requests=9, max_new_tokens=4,
                                 transport=httpx.MockTransport(handler)))
    assert lv.errors == 3 and lv.output_tokens == 6 * 4 and "503" in lv.first_error


def test_percentile_by_hand():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)
    assert percentile([7.0], 99) == 7.0


def test_spec_config_counts_the_root_like_sglang():
    assert SpecConfig(num_steps=3).sglang_args("/d")[-2:] == ["--speculative-num-draft-tokens", "4"]
    with pytest.raises(ValueError, match="counts the root"):
        SpecConfig(num_steps=3, num_draft_tokens=3)
    SpecConfig(num_steps=3, topk=4, num_draft_tokens=8)  # trees may verify fewer than topk * steps + 1
    # ... or more: SGLang keeps the best num_draft_tokens - 1 of topk + (steps-1)*topk^2 candidates (7x8: 392)
    assert SpecConfig(num_steps=7, topk=8, num_draft_tokens=64).shape.name == "tree7x8n63"
    assert SpecConfig(num_steps=7, topk=8, num_draft_tokens=393).shape.nodes == 392
    with pytest.raises(ValueError, match=r"num_draft_tokens=394 .*392"):
        SpecConfig(num_steps=7, topk=8, num_draft_tokens=394)
    with pytest.raises(ValueError, match="num_draft_tokens=1 "):
        SpecConfig(num_steps=3, topk=4, num_draft_tokens=1)
    cmd = sglang_command("/m", port=30000, draft="/d", spec=SpecConfig(num_steps=5), cuda_graph=True)
    assert "--disable-cuda-graph" not in cmd and cmd[cmd.index("--speculative-algorithm") + 1] == "EAGLE3"
    assert cmd[cmd.index("--speculative-num-steps") + 1] == "5"
    base = sglang_command("/m", port=1, cuda_graph=False)
    assert "--disable-cuda-graph" in base and "--speculative-algorithm" not in base


def test_embedded_eagle3_server_reports_like_sglang(spec_tiny):
    """The embedded engine with the EAGLE-3 decoder: SGLang's meta_info/server_info, lossless output."""
    from eaglenest.engines.embedded import EmbeddedEngine
    from eaglenest.engines.serving import BackgroundServer
    from eaglenest.speculative.decoder import plain_greedy
    from eaglenest.speculative.serve import SpecGreedy, load_spec_decoder

    runner, _, fitted, seqs, plens = spec_tiny
    engine = EmbeddedEngine(runner, capture_dir=None,
                            greedy_decoder=SpecGreedy(load_spec_decoder(runner, fitted, num_steps=3)))
    prompts = [s[:n] for s, n in zip(seqs, plens, strict=True)][:4]
    try:
        with BackgroundServer(engine) as url:
            r = httpx.post(f"{url}/generate", json={"input_ids": prompts[0], "rid": "nocapture:x", "sampling_params": {
                "max_new_tokens": 20, "temperature": 0, "ignore_eos": True}}, timeout=60)
            meta = r.json()["meta_info"]
            assert r.json()["output_ids"] == plain_greedy(runner, prompts[0], max_new_tokens=20,
                                                          ignore_eos=True).output_ids
            assert meta["spec_verify_ct"] > 0
            assert meta["spec_accept_length"] == pytest.approx(20 / meta["spec_verify_ct"])
            levels = run_levels(url, prompts, [1, 3], max_new_tokens=12, ignore_eos=True, requests_per_level=6)
            info = server_info(url)
    finally:
        engine.close()
    assert [lv.concurrency for lv in levels] == [1, 3] and all(lv.errors == 0 for lv in levels)
    assert all(lv.accept_length > 1.2 for lv in levels)
    assert info["speculative_algorithm"] == "EAGLE3" and server_accept_length(info) > 1.2


def test_bench_engine_builds_target_and_drafter_on_its_scheduler_thread(spec_tiny, tiny_model_dir, monkeypatch):
    """``bench serve``'s engine: the target, the drafter and their prepacked weights are made on the thread
    that decodes; the output stays the target's greedy tokens."""
    import threading

    from eaglenest.engines.embedded import Work
    from eaglenest.speculative import serve
    from eaglenest.speculative.decoder import plain_greedy

    runner, _, fitted, seqs, plens = spec_tiny
    made_on = []

    class Recorded(serve.TargetRunner):
        def __init__(self, *args, **kwargs):
            made_on.append(threading.current_thread())
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(serve, "TargetRunner", Recorded)
    engine = serve.build_bench_engine(tiny_model_dir, draft_dir=fitted, shape="chain3", dtype="float32")
    try:
        result, _ = engine.submit(Work(rid="r", input_ids=seqs[0][: plens[0]], max_new_tokens=12, temperature=0.0,
                                       ignore_eos=True)).result(timeout=60)
    finally:
        engine.close()
    assert made_on == [engine._thread] and result.spec_verify_ct > 0
    assert result.output_ids == plain_greedy(runner, seqs[0][: plens[0]], max_new_tokens=12,
                                             ignore_eos=True).output_ids


class _StartedElsewhere:
    """A ServerProcess stand-in for a server already running at ``url``: counts starts and stops."""

    def __init__(self, url: str) -> None:
        self.url, self.cmd, self.pid, self.calls = url, ["embedded"], None, []

    def start(self) -> None:
        self.calls.append("start")

    def wait_ready(self, **_: object) -> None:
        self.calls.append("ready")

    def stop(self) -> None:
        self.calls.append("stop")


def test_one_launch_serves_every_prompt_set(spec_tiny, monkeypatch):
    from eaglenest.engines.embedded import EmbeddedEngine
    from eaglenest.engines.serving import BackgroundServer
    from eaglenest.speculative import loadgen

    runner, _, _, seqs, plens = spec_tiny
    prompts = [s[:n] for s, n in zip(seqs, plens, strict=True)][:4]
    driven = []

    def recorded(*args, **kwargs):
        driven.append((kwargs["tag"], kwargs["concurrency"], kwargs["num_requests"]))
        return drive_level(*args, **kwargs)

    monkeypatch.setattr(loadgen, "drive_level", recorded)
    engine = EmbeddedEngine(runner, capture_dir=None)
    try:
        with BackgroundServer(engine) as url:
            server = _StartedElsewhere(url)
            results = bench_server_sets("baseline", server, {"a": prompts[:2], "b": prompts[2:]}, [2, 1],
                                        max_new_tokens=6, ignore_eos=True, requests_per_level=3, warmup_requests=1)
    finally:
        engine.close()
    assert server.calls == ["start", "ready", "stop"]
    # every level warmed once, at its own concurrency with at least that many requests, before anything is measured
    assert driven == [("warmup", 1, 1), ("warmup", 2, 2)] + [("baseline", c, 3) for c in (2, 1)] * 2
    assert list(results) == ["a", "b"]
    for r in results.values():
        assert [lv.concurrency for lv in r.levels] == [2, 1]
        assert all(lv.requests == 3 and lv.errors == 0 and lv.output_tokens == 18 for lv in r.levels)


def test_gate_passes_fails_and_refuses_to_judge():
    r = report([level(1, 100), level(16, 1000), level(64, 2000)],
               [level(1, 180, 3.0), level(16, 1100, 2.9), level(64, 1320, 2.8)])
    assert r.speedups() == pytest.approx({1: 1.8, 16: 1.1, 64: 0.66})
    assert gate(r, target_concurrency=1, min_speedup=1.5).passed
    g = gate(r, target_concurrency=64)
    assert not g.passed and g.speedup == pytest.approx(0.66)
    assert "0.66x" in g.message and "concurrency 64" in g.message and "do NOT deploy" in g.message
    with pytest.raises(GateFailed, match=r"threshold 1\.20x"):
        require_gate(r, target_concurrency=16, min_speedup=1.2)
    assert "not measured" in gate(r, target_concurrency=4).message
    bad = report([level(1, 100, errors=2)], [level(1, 300, 3.0)])
    assert not gate(bad, target_concurrency=1).passed and "failed" in gate(bad, target_concurrency=1).message


def test_gate_reports_the_cycle_cost_in_baseline_steps():
    """1.92 tokens per cycle at 0.66x: one cycle took 1.92 / 0.66 = 2.91 baseline steps (the break-even)."""
    g = gate(report([level(1, 100)], [level(1, 66, 1.92)]), target_concurrency=1)
    assert g.cycle_cost_steps == pytest.approx(1.92 / 0.66)
    assert "one cycle costs 2.91 baseline steps" in g.message and "break-even accept length is 2.91" in g.message
    # 100 tok/s at concurrency 1: a baseline step takes 10 ms, so the cycle took 29.09 ms
    assert "(29.09 ms against 10.00 ms)" in g.message
    g16 = gate(report([level(16, 1600)], [level(16, 800, 2.0)]), target_concurrency=16)
    assert "one cycle costs 4.00 baseline steps (40.00 ms against 10.00 ms)" in g16.message


def test_gate_refuses_a_speedup_the_accept_length_cannot_explain(tmp_path):
    """2.5x with 1.16 tokens per verify: the baseline ran under heavier load than EAGLE3 (seen in a demo run)."""
    r = report([level(1, 3.2)], [level(1, 8.0, 1.16)])
    g = gate(r, target_concurrency=1, min_speedup=1.0)
    assert not g.passed and "implausible" in g.message and "re-measure" in g.message
    assert gate(r, target_concurrency=1, min_speedup=0.0).passed  # threshold 0: reported, not gated
    assert "WARNING" in write_report(r, tmp_path)["markdown"].read_text()
    assert gate(report([level(1, 100)], [level(1, 140, 1.5)]), target_concurrency=1).passed  # plausible


def test_report_files_round_trip(tmp_path):
    r = report([level(1, 100), level(4, 300)], [level(1, 150, 2.5), level(4, 360, 2.4)],
               offline={"accept_length": 2.6, "accept_length_lower": 2.4, "samples": 10, "chains": 500},
               calibration={"ratio": 1.06, "offline_accept_length": 2.6, "live_accept_length": 2.45})
    paths = write_report(r, tmp_path)
    assert paths["tok_s"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert paths["accept_length"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = paths["markdown"].read_text()
    assert "| 4 | 300.0 | 360.0 | 1.20x | 2.40 |" in md and "bonus token" in md and "Calibration" in md
    back = read_report(paths["json"])
    assert back.speedups() == r.speedups() and back.eagle3.levels == r.eagle3.levels
    assert back.live_accept_length() == pytest.approx((2.5 * 150 + 2.4 * 360) / 510)
    assert not list(tmp_path.glob("*.tmp"))


def test_offline_line_lies_inside_the_accept_length_plot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from eaglenest.speculative.report import draw_accept_length

    r = report([level(1, 100), level(16, 900)], [level(1, 70, 1.92), level(16, 540, 1.95)],
               offline={"accept_length": 2.74, "accept_length_cycles": 2.1})
    fig, ax = plt.subplots()
    draw_accept_length(ax, r)
    top = ax.get_ylim()[1]
    plt.close(fig)
    assert top > 2.1 * 1.1  # not on the top border
    r = report([level(1, 100)], [level(1, 70, 1.92)], offline={"accept_length": 3.4})  # an older report
    fig, ax = plt.subplots()
    draw_accept_length(ax, r)
    assert ax.get_ylim()[1] > 3.4 * 1.1
    plt.close(fig)


def test_a_bench_run_given_a_prompt_file_records_that_files_set(tmp_path):
    from eaglenest.speculative import prompts as P
    from eaglenest.speculative.bench import BenchConfig, assemble, prepare_prompts

    token_file = P.write_token_file(tmp_path / "he.jsonl", P.PromptSet(name="humaneval", source="pkg", prompts=[]),
                                    [[1, 2, 3], [4, 5]])
    cfg = BenchConfig(draft="d", engine="sglang", prompt_file=str(token_file))
    prompts = prepare_prompts(cfg)
    r = assemble(cfg, prompts, report([level(1, 100)], [level(1, 70, 1.9)]).baseline,
                 report([level(1, 100)], [level(1, 70, 1.9)]).eagle3)
    assert r.prompt_set == "humaneval"
    recorded = json.loads(r.notes[0].removeprefix("config: "))
    assert recorded["prompt_set"] == "humaneval" and recorded["prompt_file"] == str(token_file)


def test_verify_kernel_reaches_the_eagle3_server_only(tmp_path, monkeypatch):
    from eaglenest.engines import ENV_VERIFY_KERNEL, sglang_launcher
    from eaglenest.speculative.bench import BenchConfig, eagle3_env

    assert eagle3_env(BenchConfig(engine="sglang", model="/m", draft="/d", output_dir=str(tmp_path))) == {}
    monkeypatch.setattr(sglang_launcher, "plugin_discoverable", lambda: False)  # eaglenest on PYTHONPATH only
    cfg = BenchConfig(engine="sglang", model="/m", draft="/d", output_dir=str(tmp_path), verify_kernel="splitkv",
                      num_steps=7, topk=8, num_draft_tokens=48)
    env = eagle3_env(cfg)
    assert env[ENV_VERIFY_KERNEL] == "splitkv"
    site = tmp_path / "plugin-site"
    assert env["PYTHONPATH"].split(":")[0] == str(site)
    (entry,) = site.glob("*.dist-info/entry_points.txt")
    assert "eaglenest.engines.sglang_plugin:register" in entry.read_text()
    for bad in (dict(engine="embedded"), dict(engine="sglang", attention_backend="flashinfer")):
        with pytest.raises(ValueError, match="verify_kernel=splitkv: replaces SGLang's triton verify kernel"):
            BenchConfig(model="/m", draft="/d", verify_kernel="splitkv", **bad)


def test_the_cycle_profile_serves_the_verify_kernel_it_is_asked_for(tmp_path, monkeypatch):
    """gpu_profile_cycle.py --verify-kernel splitkv (no GPU: the profiling faked): the EAGLE3 server gets the plugin's
    kernel in its environment, the baseline nothing, and profile.json names the kernel."""
    import json
    import runpy
    from pathlib import Path

    from eaglenest.engines import ENV_VERIFY_KERNEL
    from eaglenest.speculative.bench import Prompts

    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu_profile_cycle.py"
    main = runpy.run_path(str(script))["main"]
    seen: dict[str, dict | None] = {}

    def profile_server(label, cmd, port, prompts, *, env=None, out, **_):
        seen[label] = env
        if label == "eagle3":  # the server's log, as the plugin writes it when the kernel runs
            (out / "server_eagle3.log").write_text("[x] eaglenest verify kernel: first tree verify (batch 1, ...)\n")
        return {"command": cmd}

    monkeypatch.setitem(main.__globals__, "profile_server", profile_server)
    monkeypatch.setitem(main.__globals__, "prepare_prompts", lambda cfg: Prompts(name="mt-bench", source="x",
                                                                                 token_ids=[[1, 2]] * 6))
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr("sys.argv", ["gpu_profile_cycle.py", "--model", "/m", "--draft", "/d", "--prompts",
                                     "/p.jsonl", "--steps", "7", "--topk", "8", "--draft-tokens", "48",
                                     "--verify-kernel", "splitkv"])
    assert main() == 0
    assert seen["baseline"] is None and seen["eagle3"][ENV_VERIFY_KERNEL] == "splitkv"
    profile = json.loads((tmp_path / "profile.json").read_text())
    assert profile["verify_kernel"] == "splitkv"
    assert profile["eagle3"]["verify_kernel_seen"] == "first tree verify (batch 1, ...)"
