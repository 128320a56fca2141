"""A store changed after conversion is never trained on; verify reports damage as PROBLEM lines; convert
refuses an extraction with pending samples unless asked for a partial store (RELIABILITY rows 30, 32)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from eaglenest.cli import app
from eaglenest.contract import ContractError, Shard
from eaglenest.store import ConvertInputError, StoreCorrupt, StoreDataset, convert, open_store
from eaglenest.store import reader as reader_mod
from eaglenest.testing.fake_store import add_samples, make_extraction

LENGTHS = [30] * 12


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def store_of(samples, url: str, extraction: Path, **kw) -> str:
    """An Arrow store holding the samples of an in-memory store (their provenance is the tiny target's)."""
    prov = samples.provenance
    shards = [Shard(sample_id=s.sample_id, input_ids=s.input_ids, aux_hidden=s.aux_hidden.to(torch.bfloat16),
                    final_hidden=s.final_hidden.to(torch.bfloat16), provenance=prov)
              for s in (samples[i] for i in range(len(samples)))]
    add_samples(extraction, shards)
    convert(extraction, url, target_file_bytes=20_000, **kw)
    return url


def test_flipped_byte_fails_training_naming_the_file(tmp_path, tiny_model_dir, drafter_store):  # row 30
    from eaglenest.drafter.config import TrainConfig
    from eaglenest.drafter.train import train

    url = store_of(drafter_store, str(tmp_path / "store"), tmp_path / "ex")
    victim = Path(open_store(url)._paths[-1])
    flip_byte(victim)
    cfg = dict(store=url, out_dir=str(tmp_path / "run"), target=str(tiny_model_dir), draft_vocab_size=200,
               ttt_steps=2, max_steps=2, max_tokens=256, max_seq_len=128, warmup_steps=1, eval_fraction=0.0,
               precision="fp32", seed=0, threads=1)
    with pytest.raises(StoreCorrupt, match=rf"{victim.name}.*sha256.*--rehash"):
        train(TrainConfig(**cfg))
    assert not (tmp_path / "run" / "result.json").exists()
    # the opt-out reads the changed bytes (a store the user vouches for): training runs
    result = train(TrainConfig(**{**cfg, "check_store_sha256": False, "out_dir": str(tmp_path / "run2")}))
    assert result.step == 2


def test_training_dataset_read_fails_on_a_changed_file_and_checks_each_file_once(tmp_path, monkeypatch):
    make_extraction(tmp_path / "ex", LENGTHS)
    url = str(tmp_path / "store")
    convert(tmp_path / "ex", url, target_file_bytes=15_000)
    hashed = []
    real = reader_mod.hashlib.sha256

    def counting(data=b"", **kw):
        if len(data):
            hashed.append(len(data))
        return real(data, **kw)

    monkeypatch.setattr(reader_mod.hashlib, "sha256", counting)
    reader_mod._CHECKED.clear()
    store = open_store(url)
    ds = StoreDataset(store)
    ds.__getitems__(list(range(len(ds))))
    n_files = len(store.manifest["files"])
    assert n_files > 1 and len(hashed) == n_files + 1  # each data file once (+ the index at open)
    again = open_store(url)  # a second Store of this process trusts what was checked
    StoreDataset(again).__getitems__(list(range(len(again))))
    assert len(hashed) == n_files + 2

    victim = Path(store._paths[0])
    flip_byte(victim)  # changed after it was checked: its identity (mtime) changed, so it is hashed again
    fresh = StoreDataset(open_store(url))
    with pytest.raises(StoreCorrupt, match=victim.name) as err:
        fresh.__getitems__([0])
    assert "convert" in str(err.value) and "--rehash" in str(err.value)
    assert open_store(url, check_sha256=False)[0].num_tokens == LENGTHS[0]  # opt-out: no check


def test_remote_store_checks_sha256_on_first_use(tmp_path):
    import fsspec

    make_extraction(tmp_path / "ex", LENGTHS[:4])
    url = f"memory://integrity-{tmp_path.name}"
    convert(tmp_path / "ex", url, target_file_bytes=1 << 20)
    fs = fsspec.filesystem("memory")
    path = open_store(url)._paths[0]
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0x01
    fs.pipe_file(path, bytes(data))
    with pytest.raises(StoreCorrupt, match="sha256"):
        open_store(url)[0]


def test_verify_names_truncated_and_flipped_files_with_exit_1(tmp_path):  # issue: verify exited 2
    make_extraction(tmp_path / "ex", LENGTHS)
    url = str(tmp_path / "store")
    convert(tmp_path / "ex", url, target_file_bytes=15_000)
    paths = [Path(p) for p in open_store(url)._paths]
    paths[0].write_bytes(paths[0].read_bytes()[:1000])
    flip_byte(paths[1])
    r = CliRunner().invoke(app, ["store", "verify", url])
    assert r.exit_code == 1, r.output
    lines = r.output.strip().splitlines()
    assert all(ln.startswith("PROBLEM ") for ln in lines) and len(lines) == 2, r.output
    assert paths[0].name in lines[0] and "truncated" in lines[0]
    assert paths[1].name in lines[1] and "sha256" in lines[1]
    assert "error:" not in r.output

    manifest = next((tmp_path / "store" / "versions").glob("*/manifest.json"))
    index = manifest.parent / json.loads(manifest.read_text())["index"]["path"].rsplit("/", 1)[-1]
    index.write_bytes(b"x" * index.stat().st_size)
    r = CliRunner().invoke(app, ["store", "verify", url])
    assert r.exit_code == 1 and r.output.startswith("PROBLEM ") and "index" in r.output, r.output
    r = CliRunner().invoke(app, ["store", "verify", str(tmp_path / "nothing")])
    assert r.exit_code == 2 and "no committed store" in r.output


def _report(folder: Path, samples: int, done: int, pending: int) -> None:
    (folder / "report.json").write_text(json.dumps({"samples": samples, "done": done, "pending": pending,
                                                    "complete": pending == 0}))


def test_convert_of_a_pending_extraction_is_refused_without_partial(tmp_path):  # row 32
    ex = tmp_path / "ex"
    make_extraction(ex, [10] * 8)
    _report(ex, 43, 8, 35)
    url = str(tmp_path / "store")
    with pytest.raises(ConvertInputError, match=r"35 of 43 samples are still pending.*--partial"):
        convert(ex, url)
    r = CliRunner().invoke(app, ["store", "convert", str(ex), url])
    assert r.exit_code == 2 and "35 of 43" in r.output and "--partial" in r.output, r.output
    r = CliRunner().invoke(app, ["store", "convert", str(ex), url, "--partial"])
    assert r.exit_code == 0 and "8 samples" in r.output and "35 pending" in r.output, r.output
    assert convert(ex, url, partial=True).pending == 35

    make_extraction(ex, [10] * 35, prefix="late")  # validated after the report (a later run killed): counted
    assert convert(ex, url).pending == 0 and len(open_store(url)) == 43
    _report(ex, 43, 43, 0)
    assert convert(ex, url).samples == 43


def test_pending_counted_from_prepared_samples_without_a_report(tmp_path):
    ex = tmp_path / "ex"
    entries = make_extraction(ex, [10] * 3)
    ids = [e.sample_id for e in entries] + ["never-captured-1", "never-captured-2"]
    pq.write_table(pa.table({"sample_id": ids}), ex / "samples.parquet")
    with pytest.raises(ConvertInputError, match="2 of 5 samples"):
        convert(ex, str(tmp_path / "store"))
    assert convert(ex, str(tmp_path / "store"), partial=True).samples == 3


def test_hand_made_folder_without_report_or_samples_converts(tmp_path):
    make_extraction(tmp_path / "ex", [10] * 3)
    assert convert(tmp_path / "ex", str(tmp_path / "store")).samples == 3


def test_an_extraction_read_in_place_checks_each_shard_on_its_first_read(tmp_path, monkeypatch):
    """Training straight from an extraction folder: a shard changed before its first read fails naming it;
    a shard read once is not hashed again (later epochs), as an Arrow store checks a file once per process."""
    from eaglenest.store import extraction as extraction_mod
    from eaglenest.store.extraction import ExtractionStore

    make_extraction(tmp_path / "ext", LENGTHS)
    store = ExtractionStore(tmp_path / "ext")
    shard = tmp_path / "ext" / "capture" / store._entries[3].shard
    flip_byte(shard)
    with pytest.raises(ContractError, match=f"{shard.name}: sha256 differs from the ledger's"):
        store[3]
    hashed = []
    real = extraction_mod.hashlib.sha256
    monkeypatch.setattr(extraction_mod.hashlib, "sha256", lambda data: hashed.append(len(data)) or real(data))
    for _ in range(3):  # three epochs over the healthy shards
        assert [store[i].sample_id for i in (1, 2, 4)] == [store.sample_ids[i] for i in (1, 2, 4)]
    assert len(hashed) == 3  # each read shard hashed once (shard 0 was hashed when the store opened)
