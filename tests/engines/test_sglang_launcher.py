"""The SGLang launcher on the CPU: command line, guards, plugin environment and entry-point discovery."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from eaglenest.engines import pool
from eaglenest.engines import sglang_launcher as sl
from eaglenest.engines.pool import LaunchError
from eaglenest.engines.sglang_capture import CaptureConfig
from eaglenest.engines.sglang_guards import REQUIRED_FLAGS, check_server_args, check_user_args


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"num_hidden_layers": 8, "hidden_size": 64}))
    return d


def test_command_has_guards_first_and_user_args_unchanged_last(model_dir, tmp_path):
    user = ["--tp-size", "2", "--chunked-prefill-size=512", "--attention-backend", "triton", "--disable-cuda-graph"]
    cmd, env = sl.build_command(model_dir=model_dir, capture_dir=tmp_path / "cap", port=31234, sglang_args=user)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    assert cmd[cmd.index("--model-path") + 1] == str(model_dir.resolve())
    assert cmd[cmd.index("--port") + 1] == "31234" and cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[-len(user):] == user
    start = cmd.index(REQUIRED_FLAGS[0])
    assert cmd[start:start + len(REQUIRED_FLAGS)] == list(REQUIRED_FLAGS)
    cfg = CaptureConfig.from_env(env)
    assert cfg.capture_dir == (tmp_path / "cap").resolve() and cfg.aux_layer_ids == (1, 3, 4)  # default for L=8
    assert cfg.receipt_dir.parent.name.startswith(sl.WORK_PREFIX)
    sl.release_work_dir(env)
    assert not cfg.receipt_dir.parent.exists()


def test_without_capture_the_same_server_settings_and_no_plugin_env(model_dir):
    cmd, env = sl.build_command(model_dir=model_dir, capture_dir=None, sglang_args=["--tp-size", "1"])
    assert env == {} and "--disable-radix-cache" in cmd and cmd[-2:] == ["--tp-size", "1"]


@pytest.mark.parametrize("args, needle", [
    (["--cuda-graph-backend-prefill", "breakable"], "--cuda-graph-backend-prefill breakable"),
    (["--cuda-graph-backend-prefill=tc_piecewise"], "--cuda-graph-backend-prefill tc_piecewise"),
    (["--enforce-piecewise-cuda-graph"], "--enforce-piecewise-cuda-graph"),
    (["--cuda-graph-config", '{"prefill": {"backend": "full"}}'], "prefill backend 'full'"),
    (["--enable-mixed-chunk"], "--enable-mixed-chunk"),
    (["--enable-hierarchical-cache"], "--enable-hierarchical-cache"),
    (["--pp-size", "2"], "pipeline parallel"),
    (["--enable-dp-attention"], "--enable-dp-attention"),
    (["--disaggregation-mode", "prefill"], "--disaggregation-mode prefill"),
    (["--speculative-algorithm", "NGRAM"], "EAGLE3 only"),
    (["--model-path", "/x"], "eaglenest serve --model"),
    (["--port", "1"], "eaglenest serve --port"),
])
def test_contradicting_user_args_are_refused_naming_the_flag(model_dir, tmp_path, args, needle):
    with pytest.raises(sl.SGLangArgsError, match="contradict the capture guards") as e:
        sl.build_command(model_dir=model_dir, capture_dir=tmp_path / "cap", sglang_args=args)
    assert needle in str(e.value)


def test_compatible_args_pass_the_guards():
    ok = ["--cuda-graph-backend-prefill", "disabled", "--cuda-graph-config", '{"decode": {"max_bs": 8}}',
          "--speculative-algorithm", "EAGLE3", "--pp-size", "1", "--chunked-prefill-size", "-1", "--disable-cuda-graph"]
    assert check_user_args(ok) == []


def test_bad_aux_layers_are_refused_before_launch(model_dir, tmp_path):
    with pytest.raises(sl.SGLangArgsError, match="out of range"):
        sl.build_command(model_dir=model_dir, capture_dir=tmp_path, aux_layer_ids=[0, 7])
    with pytest.raises(sl.SGLangArgsError, match=r"no config\.json"):
        sl.build_command(model_dir=tmp_path / "nothing", capture_dir=tmp_path)


def test_server_args_guard_names_every_problem():
    good = SimpleNamespace(disable_radix_cache=True, cuda_graph_config=SimpleNamespace(
        prefill=SimpleNamespace(backend="disabled")), speculative_algorithm="EAGLE3", pp_size=1)
    assert check_server_args(good) == []
    bad = SimpleNamespace(disable_radix_cache=False, cuda_graph_config={"prefill": {"backend": "breakable"}},
                          enable_mixed_chunk=True, pp_size=2, enable_dp_attention=True, disaggregation_mode="decode",
                          speculative_algorithm="NGRAM")
    problems = "\n".join(check_server_args(bad))
    for needle in ("--disable-radix-cache", "'breakable'", "--enable-mixed-chunk", "pipeline parallel",
                   "DP attention", "PD disaggregation", "NGRAM"):
        assert needle in problems


def test_generated_dist_info_makes_the_entry_point_discoverable(model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(sl, "plugin_discoverable", lambda: False)
    _, env = sl.build_command(model_dir=model_dir, capture_dir=tmp_path / "cap")
    site = env["PYTHONPATH"].split(os.pathsep)[0]
    assert Path(site, f"{sl.DIST_NAME}-0.1.0.dist-info", "entry_points.txt").is_file()
    probe = ("import importlib.metadata as m; eps = m.entry_points(group='sglang.srt.plugins'); "
             "ep = next(e for e in eps if e.name == 'eaglenest_capture'); f = ep.load(); "
             "print(ep.value, f.__module__, f.__name__)")
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, **env}, capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [sl.ENTRY_POINT, "eaglenest.engines.sglang_plugin", "register"]
    sl.release_work_dir(env)


def test_sglang_plugins_whitelist_keeps_the_plugin(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_PLUGINS", "other")
    _, env = sl.build_command(model_dir=model_dir, capture_dir=tmp_path / "cap")
    assert env["SGLANG_PLUGINS"] == "other,eaglenest_capture"
    sl.release_work_dir(env)


def test_capture_ready_needs_the_capture_block(capture_server, tiny_runner):
    url, _ = capture_server
    assert sl.capture_ready(url)
    from eaglenest.engines.embedded import EmbeddedEngine
    from eaglenest.engines.serving import BackgroundServer

    plain = EmbeddedEngine(tiny_runner, capture_dir=None)
    with BackgroundServer(plain) as plain_url:
        assert sl.capture_ready(plain_url, expect_capture=False)
        with pytest.raises(LaunchError, match="capture plugin is not active"):
            sl.capture_ready(plain_url)
    plain.close()


def test_serve_refuses_before_starting_anything_without_a_supported_sglang(model_dir, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a))
    started = []
    monkeypatch.setattr(pool.ServerProcess, "start", lambda self: started.append(self))
    with pytest.raises(sl.SGLangCompatError, match="sglang is not installed"):
        sl.serve_foreground(model_dir=model_dir, capture_dir=tmp_path / "cap", host="127.0.0.1", port=30000,
                            aux_layer_ids=None, sglang_args=[])
    assert started == []
