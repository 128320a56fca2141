"""Averaging exports of one lineage: every weight the (weighted) mean of theirs; sources that differ in anything but
their weights' values are refused, naming what differs, and nothing is written."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file
from test_drafter_export import trained_run  # noqa: F401  (module fixture: a 2-step trained tiny drafter)

from eaglenest.cli import main
from eaglenest.contract import ContractError
from eaglenest.drafter.average import average_exports
from eaglenest.drafter.export import MANIFEST, export_drafter, load_drafter, read_export
from eaglenest.drafter.trim import trim_export


@pytest.fixture(scope="module")
def pair(trained_run, tmp_path_factory):  # noqa: F811
    """Two exports of one shape: the trained drafter and a copy whose floating weights moved (a 'continuation')."""
    root = tmp_path_factory.mktemp("average")
    a = export_drafter(trained_run, root / "a")
    _, drafter = read_export(a)
    g = torch.Generator().manual_seed(0)
    moved = {k: (v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v)
             for k, v in drafter.weights.items()}
    b = export_drafter(dataclasses.replace(drafter, weights=moved), root / "b")
    return a, b


def floats(path):
    return {k: v.float() for k, v in load_file(str(path / "model.safetensors")).items() if v.is_floating_point()}


@pytest.mark.parametrize("weights", [None, (1.0, 3.0)])
def test_average_is_the_weighted_mean_of_every_weight(pair, tmp_path, tiny_model_dir, weights):
    a, b = pair
    out = average_exports([a, b], tmp_path / "soup", weights=weights)
    wa, wb = (0.5, 0.5) if weights is None else (0.25, 0.75)
    fa, fb, fo = floats(a), floats(b), floats(out)
    assert fo.keys() == fa.keys() and len(fo) > 5
    for k in fo:  # the mean of the bf16 weights, taken in float32, stored in bf16 like its sources
        assert torch.equal(fo[k], (wa * fa[k] + wb * fb[k]).to(torch.bfloat16).float()), k
        assert not torch.equal(fo[k], fa[k]) or torch.equal(fa[k], fb[k])
    src, soup = load_file(str(a / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert torch.equal(soup["d2t"], src["d2t"]) and torch.equal(soup["t2d"], src["t2d"])
    # a regular export (the loader checks its sha256, shape and target), which says where it came from
    assert load_drafter(out, target_dir=tiny_model_dir).model.config == load_drafter(a, target_dir=tiny_model_dir
                                                                                      ).model.config
    averaged = json.loads((out / MANIFEST).read_text())["training"]["averaged"]
    assert averaged["from"] == [str(a), str(b)] and averaged["weights"] == [wa, wb]


def test_averaging_one_drafter_with_itself_changes_nothing(pair, tmp_path):
    a, _ = pair
    out = average_exports([a, a, a], tmp_path / "same")
    assert all(torch.equal(v, floats(a)[k]) for k, v in floats(out).items())


def test_sources_that_differ_are_refused_naming_what(pair, tmp_path, drafter_store):
    a, b = pair
    trimmed = trim_export(b, tmp_path / "t40", size=40, counts=torch.ones(512).numpy()).out_dir
    with pytest.raises(ContractError, match=r"a cannot be averaged with .*t40: drafter config \(draft_vocab_size\) "
                                            r"\(list the widest drafter first"):
        average_exports([trimmed, a], tmp_path / "x")
    high = trim_export(a, tmp_path / "high", size=60, counts=torch.arange(512).numpy()).out_dir
    low = trim_export(b, tmp_path / "low", size=40, counts=torch.arange(512).flip(0).numpy()).out_dir
    with pytest.raises(ContractError, match=r"high's \(60 tokens\) does not hold all of .*low's \(40\)"):
        average_exports([high, low], tmp_path / "x")
    _, drafter = read_export(b)
    other = export_drafter(dataclasses.replace(
        drafter, provenance=dataclasses.replace(drafter.provenance, model_hash="f" * 64)), tmp_path / "other")
    with pytest.raises(ContractError, match="model_hash"):
        average_exports([a, other], tmp_path / "x")
    d2t = drafter.weights["d2t"].clone()
    d2t[[0, 1]] = d2t[[1, 0]] + torch.tensor([1, -1])  # two draft ids swap their target ids: another vocabulary order
    swapped = export_drafter(dataclasses.replace(drafter, weights={**drafter.weights, "d2t": d2t}), tmp_path / "sw")
    with pytest.raises(ContractError, match=r"d2t \(the draft vocabulary\)"):
        average_exports([a, swapped], tmp_path / "x")
    with pytest.raises(ContractError, match="needs two exports or more, got 1"):
        average_exports([a], tmp_path / "x")
    with pytest.raises(ContractError, match=r"one positive weight per export \(2\)"):
        average_exports([a, b], tmp_path / "x", weights=[1.0, 0.0])
    with pytest.raises(ContractError, match=r"no eaglenest\.json; averaging takes eaglenest exports"):
        average_exports([a, tmp_path], tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_a_drafter_averages_with_the_narrower_one_it_widened(pair, tmp_path):
    """Across a widening (the first drafter's vocabulary holds the second's): each head row is the mean over the
    drafters that hold its token, so the rows of the tokens the widening added stay the wide drafter's own; every
    other weight is the plain mean, and the result keeps the wide vocabulary."""
    a, b = pair
    narrow = trim_export(b, tmp_path / "t40", size=40, counts=torch.arange(512).numpy()).out_dir
    out = average_exports([a, narrow], tmp_path / "soup", weights=(3.0, 1.0))
    fa, fn, fo = floats(a), floats(narrow), floats(out)
    src, soup, small = (load_file(str(p / "model.safetensors")) for p in (a, out, narrow))
    assert torch.equal(soup["d2t"], src["d2t"]) and torch.equal(soup["t2d"], src["t2d"])
    ids = src["d2t"] + torch.arange(src["d2t"].numel())
    held = torch.isin(ids, small["d2t"] + torch.arange(40))
    assert int(held.sum()) == 40
    head = fo["lm_head.weight"]
    assert torch.equal(head[~held], fa["lm_head.weight"][~held])  # the added tokens: the wide drafter's rows
    mean = 0.75 * fa["lm_head.weight"][held] + 0.25 * fn["lm_head.weight"]
    assert torch.equal(head[held], mean.to(torch.bfloat16).float())
    for k in fo.keys() - {"lm_head.weight"}:
        assert torch.equal(fo[k], (0.75 * fa[k] + 0.25 * fn[k]).to(torch.bfloat16).float()), k
    # three drafters, one narrower: a row held by all is their plain mean, one held by two is renormalized over them
    fb = floats(b)
    three = floats(average_exports([a, b, narrow], tmp_path / "three", weights=(2.0, 1.0, 1.0)))["lm_head.weight"]
    both = (2 * fa["lm_head.weight"][~held] + fb["lm_head.weight"][~held]) / 3
    torch.testing.assert_close(three[~held], both.to(torch.bfloat16).float(), rtol=0, atol=0)
    every = 0.5 * fa["lm_head.weight"][held] + 0.25 * fb["lm_head.weight"][held] + 0.25 * fn["lm_head.weight"]
    assert torch.equal(three[held], every.to(torch.bfloat16).float())


def test_cli_averages_and_reports_bad_input_in_one_line(pair, tmp_path, capsys):
    a, b = pair
    assert main(["average", str(a), str(b), "--out", str(tmp_path / "soup"), "--weight", "2", "--weight", "1"]) in (
        0, None)
    assert capsys.readouterr().out.strip() == str(tmp_path / "soup")
    assert json.loads((tmp_path / "soup" / MANIFEST).read_text())["training"]["averaged"]["weights"] == pytest.approx(
        [2 / 3, 1 / 3])
    assert main(["average", str(a), str(b), "--out", str(tmp_path / "soup")]) == 2  # exists: --overwrite replaces
    assert "exists" in capsys.readouterr().err
    assert main(["average", str(a), "--out", str(tmp_path / "one")]) == 2
    assert "averaging needs two exports or more, got 1" in capsys.readouterr().err
