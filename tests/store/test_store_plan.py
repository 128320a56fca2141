"""`eaglenest store plan`: bytes per token and store size from a target's config, checked against real stores."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from eaglenest.cli import app
from eaglenest.store import convert, open_store
from eaglenest.store.plan import footprint, target_shape
from eaglenest.testing.fake_store import fake_provenance, make_extraction


def test_a_7168_wide_target_needs_about_a_terabyte_in_bf16():
    r = CliRunner().invoke(app, ["store", "plan", "--hidden-size", "7168", "--num-layers", "61",
                                 "--samples", "10000", "--mean-tokens", "1730"])
    assert r.exit_code == 0, r.output
    assert "57,349 B/token" in r.output and "992.1 GB" in r.output and "924.0 GiB" in r.output
    r = CliRunner().invoke(app, ["store", "plan", "--model", "kimi-k2", "--samples", "10000", "--mean-tokens", "1730",
                                 "--encoding", "fp8", "--json"])
    out = json.loads(r.output)
    assert out["encoding"] == "fp8" and out["fp8"]["bytes"] < 0.52 * out["bf16"]["bytes"]
    assert out["aux_layer_ids"] == [1, 29, 57]


@pytest.mark.parametrize("encoding", ["bf16", "fp8"])
def test_plan_predicts_a_real_store_within_2_percent(tmp_path, encoding):
    prov = fake_provenance(hidden_size=576, aux_layer_ids=(1, 14, 26), num_layers=30)
    lengths = [120, 300, 80, 260, 200, 150]
    make_extraction(tmp_path / "ex", lengths, provenance=prov)
    convert(tmp_path / "ex", str(tmp_path / "store"), encoding=encoding)
    store = open_store(str(tmp_path / "store"))
    real = store.info()["bytes"] + store.manifest["index"]["bytes"]
    shape = target_shape(None, hidden_size=576, num_layers=30)
    planned = footprint(shape, samples=len(lengths), mean_tokens=sum(lengths) / len(lengths))[encoding]["bytes"]
    assert abs(planned - real) / real < 0.02, (planned, real)


def test_model_from_a_folder_or_its_config_and_clear_errors(tmp_path, tiny_model_dir):
    runner = CliRunner()
    for spec in (str(tiny_model_dir), str(tiny_model_dir / "config.json")):
        r = runner.invoke(app, ["store", "plan", "--model", spec, "--samples", "10", "--mean-tokens", "100", "--json"])
        cfg = json.loads((tiny_model_dir / "config.json").read_text())
        out = json.loads(r.output)
        assert out["hidden_size"] == cfg["hidden_size"] and out["num_layers"] == cfg["num_hidden_layers"]
    r = runner.invoke(app, ["store", "plan", "--model", str(tmp_path / "nothing-here")])
    assert r.exit_code == 2 and "error:" in r.output and "--hidden-size" in r.output
    r = runner.invoke(app, ["store", "plan"])
    assert r.exit_code == 2 and "--model" in r.output
    r = runner.invoke(app, ["store", "plan", "--hidden-size", "64", "--num-layers", "4"])
    assert r.exit_code == 2 and "aux" in r.output  # too shallow for the default aux layers: says to pass them
