"""Injected failures against the store: a crash before the manifest, a full disk, flipped bytes, truncated or
garbage files, a failed upload, stale temporaries, mixed schema versions and two converters at once."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from safetensors.torch import save_file

from eaglenest.contract import ContractError, UnknownSchemaVersion
from eaglenest.extraction.ledger import Ledger, LedgerEntry
from eaglenest.store import StoreCorrupt, StoreDiskFull, StoreNotFound, convert, list_versions, open_store, storage
from eaglenest.store import layout as L
from eaglenest.testing.fake_store import add_samples, fake_provenance, fake_shard, make_extraction

LENGTHS = [30] * 12
ROOT = Path(__file__).resolve().parents[2]


def run_child(code: str, *args: str, wait: bool = True):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-c", textwrap.dedent(code), *args]
    if not wait:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def store_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_crash_before_manifest_leaves_no_store_and_rerun_reuses_files(tmp_path):
    make_extraction(tmp_path / "ex", LENGTHS)
    url = str(tmp_path / "store")
    r = run_child("""
        import os, sys
        import eaglenest.store.converter as c
        c._write_manifest = lambda *a, **k: os._exit(3)
        c.convert(sys.argv[1], sys.argv[2], target_file_bytes=15_000)
    """, str(tmp_path / "ex"), url)
    assert r.returncode == 3, r.stderr
    assert any(n.endswith(".arrow") for n in store_files(tmp_path / "store"))  # data files were written...
    with pytest.raises(StoreNotFound):  # ...but without the manifest the store does not exist
        open_store(url)
    again = convert(tmp_path / "ex", url, target_file_bytes=15_000)
    assert again.files_written == 0 and again.files_reused == again.files_total > 1  # checksummed, reused
    assert open_store(url, verify=True).manifest["num_samples"] == len(LENGTHS)


def test_disk_full_in_child_is_clear_leaves_nothing_and_rerun_completes(tmp_path):  # EFBIG
    make_extraction(tmp_path / "ex", LENGTHS)
    url = str(tmp_path / "store")
    r = run_child("""
        import resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        from eaglenest.store import StoreDiskFull, convert
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))
        try:
            convert(sys.argv[1], sys.argv[2], target_file_bytes=40_000)
        except StoreDiskFull as e:
            print(type(e).__name__, e)
            sys.exit(2)
    """, str(tmp_path / "ex"), url)
    assert r.returncode == 2, r.stderr
    assert "StoreDiskFull disk full while writing" in r.stdout and "EFBIG" in r.stdout and "re-run" in r.stdout
    leftovers = store_files(tmp_path / "store")
    assert not [n for n in leftovers if n.endswith(".tmp") or n.endswith(".json") or n.endswith(".arrow")]
    with pytest.raises(StoreNotFound):
        open_store(url)
    assert convert(tmp_path / "ex", url, target_file_bytes=40_000).samples == len(LENGTHS)
    assert open_store(url).verify() == []


def test_enospc_on_rename_removes_temporary(tmp_path, monkeypatch):  # ENOSPC
    make_extraction(tmp_path / "ex", LENGTHS)

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(storage.os, "replace", full)
    with pytest.raises(StoreDiskFull, match="ENOSPC") as info:
        convert(tmp_path / "ex", str(tmp_path / "store"))
    assert not info.value.retryable
    assert store_files(tmp_path / "store") == []


def test_flipped_byte_is_named_by_verify_then_quarantined_and_rebuilt(tmp_path):
    make_extraction(tmp_path / "ex", LENGTHS)
    url = str(tmp_path / "store")
    convert(tmp_path / "ex", url, target_file_bytes=15_000)
    store = open_store(url)
    victim = Path(store._paths[1])
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    problems = open_store(url).verify()
    assert len(problems) == 1 and victim.name in problems[0] and "sha256" in problems[0]
    with pytest.raises(StoreCorrupt, match=victim.name):
        open_store(url, verify=True)
    summary = convert(tmp_path / "ex", url, target_file_bytes=15_000, rehash=True)
    assert summary.files_quarantined == 1 and summary.files_written == 1
    assert open_store(url).verify() == []
    reasons = list((tmp_path / "store" / L.QUARANTINE_DIR).glob("*.reason.json"))
    assert len(reasons) == 1 and "sha256" in json.loads(reasons[0].read_text())["reason"]


def test_truncated_or_garbage_files_give_typed_errors(tmp_path):
    make_extraction(tmp_path / "ex", LENGTHS)
    url = str(tmp_path / "store")
    convert(tmp_path / "ex", url, target_file_bytes=15_000)
    store = open_store(url)
    victim = Path(store._paths[0])
    original = victim.read_bytes()

    victim.write_bytes(original[: len(original) // 2])
    with pytest.raises(StoreCorrupt, match=f"{victim.name}.*truncated"):
        open_store(url)

    victim.write_bytes(b"JUNK" * 16 + original[64:])  # same size, garbage header
    with pytest.raises(StoreCorrupt, match=victim.name):
        open_store(url)[0]
    victim.write_bytes(original)

    index = tmp_path / "store" / store.manifest["index"]["path"]
    index_bytes = index.read_bytes()
    index.write_bytes(b"x" * len(index_bytes))
    with pytest.raises(StoreCorrupt, match="index"):
        open_store(url)
    index.write_bytes(index_bytes)

    manifest = tmp_path / "store" / L.VERSIONS_DIR / store.manifest["version"] / L.MANIFEST_NAME
    manifest.write_text("{not json")
    with pytest.raises(StoreCorrupt, match="garbage manifest"):
        open_store(url)


def test_exception_mid_upload_publishes_no_object(tmp_path, monkeypatch):
    make_extraction(tmp_path / "ex", LENGTHS)
    url = f"memory://st-{uuid.uuid4().hex}"
    real = storage.HashingWriter.write
    writers: list[int] = []

    def failing(self, data):
        if id(self) not in writers:
            writers.append(id(self))
        if len(writers) >= 3 and self.size > 5_000:  # 1st data file + its sidecar done, mid 2nd data file
            raise ConnectionError("upload interrupted")
        return real(self, data)

    monkeypatch.setattr(storage.HashingWriter, "write", failing)
    with pytest.raises(ConnectionError):
        convert(tmp_path / "ex", url, target_file_bytes=15_000)
    fs, root = storage.resolve(url)
    objects = fs.find(root)
    data = [p for p in objects if p.endswith(".arrow")]
    assert data and not [p for p in objects if "versions" in p]  # finished files only, no version
    for p in data:  # each published object is complete (its sidecar's size and sha256 hold)
        side = json.loads(fs.cat_file(p + L.SIDECAR_SUFFIX))
        assert storage.sha256_file(fs, p) == (side["bytes"], side["sha256"])
    monkeypatch.undo()
    assert convert(tmp_path / "ex", url, target_file_bytes=15_000).files_reused == len(data)
    assert open_store(url).verify() == []


def test_stale_temporaries_are_invisible_and_cleaned(tmp_path):
    make_extraction(tmp_path / "ex", LENGTHS)
    url = str(tmp_path / "store")
    data = tmp_path / "store" / L.DATA_DIR
    data.mkdir(parents=True)
    stale, fresh = data / "abc.arrow.1234.tmp", data / "def.arrow.5678.tmp"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"another converter at work")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    convert(tmp_path / "ex", url)
    assert not stale.exists() and fresh.exists()
    assert open_store(url).verify() == []


def test_mixed_schema_versions_and_provenance_are_refused(tmp_path):
    prov = fake_provenance()
    make_extraction(tmp_path / "ex", [10, 10])
    shard = fake_shard("v2", 10, prov)
    meta = {"schema_version": "2", "sample_id": "v2", "provenance": prov.to_json()}
    path = Ledger(tmp_path / "ex").capture_dir / "v2.safetensors"
    save_file({"input_ids": shard.input_ids, "aux_hidden": shard.aux_hidden,
               "final_hidden": shard.final_hidden}, str(path), metadata=meta)
    Ledger(tmp_path / "ex").append([LedgerEntry(sample_id="v2", shard=path.name, bytes=path.stat().st_size,
                                                sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
                                                num_tokens=10, loss_tokens=0)])
    with pytest.raises(UnknownSchemaVersion, match="mixed schema versions"):
        convert(tmp_path / "ex", str(tmp_path / "store"))
    assert not (tmp_path / "store").exists()

    make_extraction(tmp_path / "ex2", [10])
    add_samples(tmp_path / "ex2", [fake_shard("other", 10, fake_provenance(engine="sglang"))])
    with pytest.raises(ContractError, match="engine"):
        convert(tmp_path / "ex2", str(tmp_path / "store2"))

    make_extraction(tmp_path / "ex4", [10])  # model_path is machine-local: another host's path is fine
    add_samples(tmp_path / "ex4", [fake_shard("elsewhere", 10, fake_provenance(model_path="/other/host/model"))])
    assert convert(tmp_path / "ex4", str(tmp_path / "store4")).samples == 2

    make_extraction(tmp_path / "ex3", [10])
    convert(tmp_path / "ex3", str(tmp_path / "store3"))
    (m,) = list((tmp_path / "store3" / L.VERSIONS_DIR).glob(f"*/{L.MANIFEST_NAME}"))
    m.write_text(m.read_text().replace('"schema_version": 1', '"schema_version": 2'))
    with pytest.raises(UnknownSchemaVersion, match="schema_version 2"):
        open_store(str(tmp_path / "store3"))


CONCURRENT = """
    import sys, time
    from pathlib import Path
    from eaglenest.store import convert
    Path(sys.argv[3]).touch()
    while not Path(sys.argv[4]).exists():
        time.sleep(0.01)
    print(convert(sys.argv[1], sys.argv[2], target_file_bytes=15_000).version)
"""


@pytest.mark.parametrize("same_input", [True, False])
def test_two_converters_at_once_leave_intact_versions(tmp_path, same_input):
    make_extraction(tmp_path / "ex1", [60] * 16)
    make_extraction(tmp_path / "ex2", [60] * 16, prefix="b", seed=5)
    url = str(tmp_path / "store")
    go = tmp_path / "go"
    inputs = ["ex1", "ex1"] if same_input else ["ex1", "ex2"]
    procs = [run_child(CONCURRENT, str(tmp_path / x), url, str(tmp_path / f"ready{i}"), str(go), wait=False)
             for i, x in enumerate(inputs)]
    deadline = time.time() + 60
    while not all((tmp_path / f"ready{i}").exists() for i in range(2)) and time.time() < deadline:
        time.sleep(0.02)
    go.touch()
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    versions = {o[0].strip() for o in outs}
    assert len(versions) == (1 if same_input else 2)
    assert {m["version"] for m in list_versions(url)} == versions
    for v in versions:
        assert open_store(url, version=v, verify=True).verify() == []
    assert not [n for n in store_files(tmp_path / "store") if n.endswith(".tmp")]
