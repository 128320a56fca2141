"""Store round trip, reader API, versions, appends and idempotent re-runs (local, file:// and memory://)."""

from __future__ import annotations

import hashlib
import pickle
import random
import threading
import uuid

import pytest
import torch

from eaglenest.contract import read_shard
from eaglenest.extraction.ledger import Ledger, spans_to_mask
from eaglenest.store import StoreNotFound, convert, list_versions, open_store, storage
from eaglenest.testing.fake_store import add_samples, fake_provenance, fake_shard, make_extraction

LENGTHS = [7, 1, 33, 12, 64, 5, 20, 9, 40, 3]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def assert_matches_shards(store, extraction_dir):
    ledger = Ledger(extraction_dir)
    entries = ledger.entries()
    assert sorted(store.sample_ids) == sorted(entries)
    for i, sid in enumerate(store.sample_ids):
        s, e = store[i], entries[sid]
        shard = read_shard(ledger.capture_dir / e.shard)
        assert s.sample_id == sid
        assert s.input_ids.dtype == torch.int32 and s.loss_mask.dtype == torch.bool
        assert s.aux_hidden.dtype == torch.bfloat16 and s.final_hidden.dtype == torch.bfloat16
        assert torch.equal(s.input_ids, shard.input_ids)
        assert torch.equal(bits(s.aux_hidden), bits(shard.aux_hidden))  # bit-exact, NaN-safe
        assert torch.equal(bits(s.final_hidden), bits(shard.final_hidden))
        assert s.loss_mask.tolist() == [bool(m) for m in spans_to_mask(e.loss_spans, e.num_tokens)]
        assert store.num_tokens[i] == e.num_tokens and store.loss_tokens[i] == e.loss_tokens


@pytest.mark.parametrize("scheme", ["path", "file", "memory"])
def test_round_trip_bit_exact_and_random_equals_sequential(tmp_path, scheme):
    make_extraction(tmp_path / "ex", LENGTHS)
    url = {"path": str(tmp_path / "store"), "file": f"file://{tmp_path}/store",
           "memory": f"memory://store-{uuid.uuid4().hex}"}[scheme]
    summary = convert(tmp_path / "ex", url, target_file_bytes=20_000)
    assert summary.samples == len(LENGTHS) and summary.files_written == summary.files_total > 1
    store = open_store(url)
    assert len(store) == len(LENGTHS) and store.verify() == []
    assert store.provenance == fake_provenance() and store.manifest["num_samples"] == len(LENGTHS)
    assert_matches_shards(store, tmp_path / "ex")
    seq = [store[i] for i in range(len(store))]
    order = list(range(len(store)))
    random.Random(0).shuffle(order)
    for i in order:
        got = store[i]
        assert torch.equal(bits(got.aux_hidden), bits(seq[i].aux_hidden))
        assert torch.equal(got.input_ids, seq[i].input_ids)
    assert store.get(store.sample_ids[3]).sample_id == store.sample_ids[3]
    assert store[-1].sample_id == store.sample_ids[-1]
    with pytest.raises(KeyError, match="nope"):
        store.get("nope")
    with pytest.raises(IndexError):
        store[len(store)]


def test_local_reads_are_views_of_one_mapping(tmp_path):
    make_extraction(tmp_path / "ex", [50, 60])
    convert(tmp_path / "ex", str(tmp_path / "store"))
    store = open_store(str(tmp_path / "store"))
    a, b = store[0], store[0]
    assert a.aux_hidden.data_ptr() == b.aux_hidden.data_ptr()  # same bytes, no copy
    mm = store._mapped(0)[0]
    base = store._mapped(0)[1].data_ptr()
    assert base <= a.final_hidden.data_ptr() < base + len(mm)
    a.aux_hidden.add_(1)  # a private map: in-place writes never reach the file
    assert store.verify() == []


def test_remote_read_fetches_only_the_sample_bytes(tmp_path):
    make_extraction(tmp_path / "ex", [30, 30, 30, 30])
    url = f"memory://st-{uuid.uuid4().hex}"
    convert(tmp_path / "ex", url)
    store = open_store(url)
    store[0]  # first use of the (single) data file also checks its magic bytes
    calls = []
    real = store.fs.cat_file
    store.fs.cat_file = lambda path, start=None, end=None, **kw: calls.append((start, end)) or real(path, start, end)
    try:
        s = store[2]
    finally:
        del store.fs.cat_file
    assert calls == [(int(store._offset[2]), int(store._offset[2] + store._length[2]))]
    assert calls[0][1] - calls[0][0] < 1.2 * (s.aux_hidden.numel() * 2 + s.final_hidden.numel() * 2 + 30 * 5)


def test_rerun_is_idempotent_and_new_extraction_is_a_new_version(tmp_path):
    url = str(tmp_path / "store")
    make_extraction(tmp_path / "ex1", LENGTHS)
    first = convert(tmp_path / "ex1", url, target_file_bytes=20_000)
    again = convert(tmp_path / "ex1", url, target_file_bytes=20_000)
    assert again.version == first.version and again.already_complete
    assert again.files_written == 0 and again.files_reused == first.files_total and again.bytes_in == 0
    v1_files = {p: p.read_bytes() for p in (tmp_path / "store").rglob("*") if p.is_file()}

    make_extraction(tmp_path / "ex2", [4, 8, 15], prefix="other", seed=7)
    second = convert(tmp_path / "ex2", url)
    assert second.version != first.version
    assert all(p.read_bytes() == data for p, data in v1_files.items())  # old version untouched
    assert [m["version"] for m in list_versions(url)] == [first.version, second.version]
    assert open_store(url).manifest["version"] == second.version  # latest
    old = open_store(url, version=first.version)
    assert_matches_shards(old, tmp_path / "ex1")
    assert open_store(f"{url}/versions/{first.version}").manifest["version"] == first.version


def test_growing_ledger_reuses_files_and_append_adds_samples(tmp_path):
    url = str(tmp_path / "store")
    prov = fake_provenance()
    make_extraction(tmp_path / "ex", [20] * 8)
    first = convert(tmp_path / "ex", url, target_file_bytes=10_000)
    add_samples(tmp_path / "ex", [fake_shard(f"late{i}", 20, prov, seed=50 + i) for i in range(4)], seed=3)
    grown = convert(tmp_path / "ex", url, target_file_bytes=10_000)
    assert grown.samples == 12 and grown.files_reused >= first.files_total - 1 and grown.files_written >= 1
    assert_matches_shards(open_store(url), tmp_path / "ex")

    elsewhere = fake_provenance(model_path="/another/host/model")  # same model loaded from another path
    add_samples(tmp_path / "more", [fake_shard(f"more{i}", 10, elsewhere, seed=90 + i) for i in range(3)], seed=4)
    appended = convert(tmp_path / "more", url, target_file_bytes=10_000, append=True)
    store = open_store(url)
    assert appended.samples == 15 and appended.files_reused == grown.files_total and appended.files_written == 1
    assert store.manifest["parent"] == grown.version and store.verify() == []
    assert store.sample_ids[-3:] == ["more0", "more1", "more2"] and store[-1].num_tokens == 10
    assert convert(tmp_path / "more", url, append=True).files_written == 0  # nothing new to add


def test_store_without_manifest_does_not_exist(tmp_path):
    with pytest.raises(StoreNotFound, match="convert"):
        open_store(str(tmp_path / "nothing"))


def test_store_pickles_for_dataloader_workers(tmp_path):
    make_extraction(tmp_path / "ex", [10, 20])
    convert(tmp_path / "ex", str(tmp_path / "store"))
    store = open_store(str(tmp_path / "store"))
    _ = store[0]
    clone = pickle.loads(pickle.dumps(store))
    assert torch.equal(bits(clone[1].aux_hidden), bits(store[1].aux_hidden))


def test_mapped_decoder_agrees_with_the_contract(tmp_path):
    import mmap

    from eaglenest.contract import ContractError, decode_shard
    from eaglenest.store.shards import decode_mapped

    (entry,) = make_extraction(tmp_path / "ex", [13])
    path = Ledger(tmp_path / "ex").capture_dir / entry.shard
    with open(path, "rb") as f:
        mapped = decode_mapped(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), str(path))
    ref = decode_shard(path.read_bytes())
    assert mapped.sample_id == ref.sample_id and mapped.provenance == ref.provenance and mapped.extra == ref.extra
    for name in ("input_ids", "aux_hidden", "final_hidden"):
        assert torch.equal(bits(getattr(mapped, name)), bits(getattr(ref, name)))
    junk = bytearray(path.read_bytes())
    junk[8:20] = b"not a header"
    with pytest.raises(ContractError, match="garbage header"):
        decode_mapped(junk, "junk")
    with pytest.raises(ContractError, match="truncated"):
        decode_mapped(bytearray(path.read_bytes()[:100]), "cut")


def test_background_hashing_writer_hashes_every_write_in_order(tmp_path):
    chunks = [b"x", torch.arange(100_000, dtype=torch.int32).numpy(), b"", bytes(range(256)) * 900,
              memoryview(torch.ones(70_000, dtype=torch.bfloat16).view(torch.uint8).numpy())]
    with open(tmp_path / "f", "wb", buffering=0) as raw:
        w = storage.HashingWriter(raw, background=True)
        for c in chunks:
            w.write(c)
        digest = w.hexdigest()
    data = (tmp_path / "f").read_bytes()
    assert digest == hashlib.sha256(data).hexdigest() and w.size == len(data)
    assert not any(t.name == "store-hash" for t in threading.enumerate())  # helper stopped
