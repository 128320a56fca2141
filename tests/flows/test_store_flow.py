"""The convert flow against the session's Prefect server: store written, re-run is a cache hit."""

from __future__ import annotations

import shutil
from pathlib import Path

from eaglenest.store import open_store
from eaglenest.testing.fake_store import add_samples, fake_provenance, fake_shard, make_extraction


def test_convert_flow_writes_store_and_caches_on_ledger_content(prefect_api, tmp_path):
    from flows.convert import ConvertParams, convert_flow

    make_extraction(tmp_path / "ex", [8, 16, 4])
    url = str(tmp_path / "store")
    params = ConvertParams(extraction_dir=str(tmp_path / "ex"), store_url=url, target_file_mb=1)
    first = convert_flow(params)
    assert first["samples"] == 3 and open_store(url).verify() == []

    state = convert_flow(params, return_state=True)
    # a real second conversion would report already_complete=True, 0 files written and a new duration:
    # an identical summary means the task was a cache hit on the unchanged ledger
    assert state.result() == first

    add_samples(tmp_path / "ex", [fake_shard("late", 5, fake_provenance(), seed=11)])
    grown = convert_flow(params)  # ledger changed -> cache miss -> new version with 4 samples
    assert grown["samples"] == 4 and grown["version"] != first["version"]

    shutil.rmtree(url)  # the store was deleted: a re-run converts again instead of a cache hit on nothing
    assert convert_flow(params)["version"] == grown["version"] and open_store(url).verify() == []


def test_cli_convert_verify_info(tmp_path):
    import json

    from typer.testing import CliRunner

    from eaglenest.cli import app

    make_extraction(tmp_path / "ex", [8, 16, 4])
    url = str(tmp_path / "store")
    runner = CliRunner()
    r = runner.invoke(app, ["store", "convert", str(tmp_path / "ex"), url, "--target-file-mb", "1"])
    assert r.exit_code == 0 and "3 samples" in r.output, r.output
    r = runner.invoke(app, ["store", "verify", url])
    assert r.exit_code == 0 and r.output.startswith("OK"), r.output
    assert json.loads(runner.invoke(app, ["store", "info", url]).output)["samples"] == 3
    victim = Path(open_store(url)._paths[0])
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    r = runner.invoke(app, ["store", "verify", url])
    assert r.exit_code == 1 and victim.name in r.output
    r = runner.invoke(app, ["store", "info", str(tmp_path / "missing")])
    assert r.exit_code == 2 and "no committed store" in r.output
