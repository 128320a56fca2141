import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from eaglenest import atomic, contract
from eaglenest.contract import ContractError, Provenance, Shard, UnknownSchemaVersion


def make_provenance(**over) -> Provenance:
    base = dict(engine="embedded", engine_version="0", model_path="/m", model_hash="a" * 64,
                tokenizer_hash="b" * 64, chat_template_hash="c" * 64, dtype="bfloat16",
                aux_layer_ids=(1, 3, 4), hidden_size=8, num_layers=8)
    base.update(over)
    return Provenance(**base)


def make_shard(sample_id="s1", t=5, seed=0) -> Shard:
    g = torch.Generator().manual_seed(seed)
    return Shard(
        sample_id=sample_id,
        input_ids=torch.randint(0, 100, (t,), generator=g, dtype=torch.int32),
        aux_hidden=torch.randn(t, 24, generator=g).to(torch.bfloat16),
        final_hidden=torch.randn(t, 8, generator=g).to(torch.bfloat16),
        provenance=make_provenance(),
    )


def test_default_aux_layers_follow_design():
    assert contract.default_aux_layer_ids(30) == (1, 14, 26)
    assert contract.default_aux_layer_ids(8) == (1, 3, 4)
    with pytest.raises(ContractError, match="at least 8"):
        contract.default_aux_layer_ids(4)
    with pytest.raises(ContractError, match="out of range"):
        contract.check_aux_layer_ids([1, 29], 30)  # the last layer is only seen after the final norm
    with pytest.raises(ContractError, match="distinct"):
        contract.check_aux_layer_ids([3, 1], 30)


def test_shard_round_trip_is_bit_exact(tmp_path):
    shard = make_shard(t=17)
    path = contract.write_shard(tmp_path, shard)
    back = contract.read_shard(path)
    assert back.sample_id == "s1" and back.provenance == shard.provenance
    for name in ("input_ids", "aux_hidden", "final_hidden"):
        a, b = getattr(shard, name), getattr(back, name)
        assert a.dtype == b.dtype
        assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                           b.view(torch.int16) if b.dtype == torch.bfloat16 else b)


def _rewrite_metadata(data: bytes, **meta) -> bytes:
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"].update(meta)
    raw = json.dumps(header).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    return len(raw).to_bytes(8, "little") + raw + data[8 + n :]


def test_unknown_schema_version_refused(tmp_path):
    data = contract.encode_shard(make_shard())
    with pytest.raises(UnknownSchemaVersion, match="schema_version '2'"):
        contract.decode_shard(_rewrite_metadata(data, schema_version="2"))
    prov = json.loads(make_provenance().to_json())
    prov["schema_version"] = 7
    with pytest.raises(UnknownSchemaVersion):
        contract.decode_shard(_rewrite_metadata(data, provenance=json.dumps(prov)))


@pytest.mark.parametrize("junk", [b"", b"\x05", b"\xff" * 64, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json"])
def test_garbage_and_truncated_shards_raise_typed_errors(junk):
    with pytest.raises(ContractError):
        contract.decode_shard(junk)
    data = contract.encode_shard(make_shard())
    with pytest.raises(ContractError):
        contract.decode_shard(data[: len(data) - 7])


def test_shape_and_non_finite_guards():
    s = make_shard()
    bad = Shard(s.sample_id, s.input_ids, s.aux_hidden[:, :16], s.final_hidden, s.provenance)
    with pytest.raises(ContractError, match="aux_hidden"):
        contract.encode_shard(bad)
    nan = s.final_hidden.clone()
    nan[2, 3] = float("nan")
    with pytest.raises(ContractError, match="non-finite"):
        contract.encode_shard(Shard(s.sample_id, s.input_ids, s.aux_hidden, nan, s.provenance))


@pytest.mark.parametrize("rid", ["../x", "a/b", "/etc/passwd", "..", ".", ".hidden", "a\\b", "x" * 10_000,
                                 "nul\x00byte", "ünïcode/../../z", "C:\\evil"])
def test_malicious_sample_ids_never_escape(tmp_path, rid):
    out = tmp_path / "capture"
    path = contract.write_shard(out, make_shard(sample_id=rid))
    assert path.parent == out and len(path.name) < 200 and "/" not in path.name
    assert [p.name for p in contract.iter_shard_paths(out)] == [path.name]
    assert contract.read_shard(path).sample_id == rid
    assert sorted(p.name for p in tmp_path.iterdir()) == ["capture"]


def test_empty_sample_id_refused(tmp_path):
    with pytest.raises(ContractError, match="non-empty"):
        contract.shard_filename("")


def test_distinct_ids_get_distinct_files():
    ids = ["a/b", "a_b", "a\\b", "a?b", "x" * 500, "x" * 501, "._a", "_a"]
    assert len({contract.shard_filename(i) for i in ids}) == len(ids)


def test_provenance_mismatch_names_fields():
    a, b = make_provenance(), make_provenance(dtype="float16", model_path="/elsewhere")
    assert a.mismatches(b) == ["dtype"]
    with pytest.raises(ContractError, match="dtype"):
        a.require_match(b)


WRITER = textwrap.dedent("""
    import os, sys, time, torch
    from eaglenest import contract
    sys.path.insert(0, {tests!r})
    from test_contract import make_shard
    real_fsync = os.fsync
    def fsync(fd):
        print("progress", flush=True)   # the temporary is fully written; the rename has not happened
        time.sleep(60)
    os.fsync = fsync
    contract.write_shard({out!r}, make_shard("victim", t=4096))
""")


def test_killed_writer_leaves_no_shard_under_final_name(tmp_path):
    out = tmp_path / "capture"
    code = WRITER.format(tests=os.path.dirname(__file__), out=str(out))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "progress"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert not (out / contract.shard_filename("victim")).exists()
    assert list(out.glob("*.tmp")), "the killed writer's temporary should be there to clean"
    assert list(contract.iter_shard_paths(out)) == []
    assert atomic.clean_temporaries(out) == 1
    contract.write_shard(out, make_shard("victim", t=8))  # a resume rewrites it
    assert [p.name for p in contract.iter_shard_paths(out)] == ["victim.safetensors"]


def test_failed_write_removes_temporary(tmp_path, monkeypatch):
    def full(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic.os, "replace", full)
    with pytest.raises(OSError, match="No space"):
        contract.write_shard(tmp_path, make_shard())
    assert list(tmp_path.iterdir()) == []


def test_shards_are_write_once(tmp_path):
    """A late duplicate (client retried after a timeout) never replaces a shard that may be validated."""
    first = contract.encode_shard(make_shard("dup", seed=1))
    second = contract.encode_shard(make_shard("dup", seed=2))
    path, kept = atomic.publish_once(tmp_path / "dup.safetensors", first)
    assert kept == first
    path2, kept2 = atomic.publish_once(tmp_path / "dup.safetensors", second)
    assert path2 == path and kept2 == first and path.read_bytes() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dup.safetensors"]  # no temporary left


def test_publish_shard_describes_the_stored_file_or_refuses_another_request(tmp_path):
    """A reused id: same tokens and provenance -> the existing file's receipt; anything else -> ShardConflict."""
    path = tmp_path / "dup.safetensors"
    first = contract.encode_shard(make_shard("dup", seed=1))
    receipt = contract.publish_shard(path, first)
    assert not receipt["existing"] and receipt["sha256"] == contract.sha256_bytes(first)
    assert (receipt["num_tokens"], receipt["aux_hidden"], receipt["final_hidden"]) == (5, [5, 24], [5, 8])
    same_ids = make_shard("dup", seed=1)
    same_ids = dataclasses.replace(same_ids, final_hidden=same_ids.final_hidden + 1)  # recomputed: other numerics
    again = contract.publish_shard(path, contract.encode_shard(same_ids))
    assert again == {**receipt, "existing": True}
    longer = contract.encode_shard(make_shard("dup", t=6, seed=1))
    with pytest.raises(contract.ShardConflict, match=r"rid 'dup' .*5 tokens stored, 6 sent"):
        contract.publish_shard(path, longer)
    other_model = dataclasses.replace(make_shard("dup", seed=1), provenance=make_provenance(model_hash="d" * 64))
    with pytest.raises(contract.ShardConflict, match="other provenance"):
        contract.publish_shard(path, contract.encode_shard(other_model))
    assert path.read_bytes() == first and sorted(p.name for p in tmp_path.iterdir()) == ["dup.safetensors"]
    path.write_bytes(first[: len(first) // 2])  # a damaged stored file is not silently answered for
    with pytest.raises(contract.ShardConflict, match="cannot be read"):
        contract.publish_shard(path, first)
