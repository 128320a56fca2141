"""The fp8 store encoding: error bound, finite scales, NaN/inf refused, verify/rehash, one encoding per version."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from eaglenest.cli import app
from eaglenest.contract import ContractError, Shard
from eaglenest.drafter.data import collate
from eaglenest.store import ConvertInputError, StoreCorrupt, StoreSample, convert, open_store
from eaglenest.store import layout as L
from eaglenest.store.encoding import FP8_REL_ERROR, Fp8States, bytes_per_token, decode_fp8, encode_fp8
from eaglenest.testing.fake_store import add_samples, fake_provenance, make_extraction


def rows_of_every_kind(h: int, g: torch.Generator) -> torch.Tensor:
    """[R, h] float32 rows: Gaussian at many scales, heavy tails (a few huge channels, as hidden states have),
    values across e4m3's subnormal range, one-hot, all-equal and zero rows."""
    gauss = torch.randn(64, h, generator=g) * torch.logspace(-20, 20, 64).unsqueeze(1)
    heavy = torch.randn(32, h, generator=g)
    heavy[:, :3] *= 3000.0  # massive activations: most of the row falls into e4m3 subnormals after scaling
    wide = torch.randn(16, h, generator=g) * torch.logspace(-6, 6, h).unsqueeze(0)  # spans 12 decades per row
    special = torch.zeros(4, h)
    special[1, 7] = -5.0
    special[2] = 3.25
    special[3, ::2] = 1e-3
    return torch.cat([gauss, heavy, wide, special])


@pytest.mark.parametrize("h", [16, 576, 4096])
def test_round_trip_is_within_the_stated_bound_per_row(h):
    g = torch.Generator().manual_seed(h)
    x = rows_of_every_kind(h, g).to(torch.bfloat16)  # [R, h]: one block per row
    codes, scale = encode_fp8(x, 1)
    assert codes.dtype == torch.uint8 and scale.dtype == torch.float32 and scale.shape == (x.shape[0], 1)
    assert torch.isfinite(scale).all() and (scale >= 0).all()
    y = decode_fp8(codes, scale)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    xf, yf = x.double(), y.double()  # float64: norms of 1e20-sized rows overflow float32
    norm = xf.norm(dim=-1)
    rel = (yf - xf).norm(dim=-1) / norm.clamp_min(1e-300)
    rel[norm == 0] = (yf[norm == 0].abs().sum(-1) > 0).float()  # zero rows must decode to exact zeros
    assert float(rel.max()) <= FP8_REL_ERROR, float(rel.max())
    assert 0.01 < float(rel[:64].mean()) < 0.04  # Gaussian rows: e4m3's rounding, not a vacuous bound


def test_blocks_are_scaled_on_their_own():
    g = torch.Generator().manual_seed(0)
    quiet, loud = torch.randn(5, 32, generator=g) * 1e-3, torch.randn(5, 32, generator=g) * 1e3
    x = torch.cat([quiet, loud, quiet], dim=1).to(torch.bfloat16)  # [T, 3H]: one loud aux layer between quiet ones
    codes, scale = encode_fp8(x, 3)
    assert scale.shape == (5, 3) and (scale[:, 1] > 1e5 * scale[:, 0]).all()
    y = decode_fp8(codes, scale).float().view(5, 3, 32)
    blocks = x.float().view(5, 3, 32)
    rel = (y - blocks).norm(dim=-1) / blocks.norm(dim=-1)
    assert float(rel.max()) <= FP8_REL_ERROR  # the quiet layers keep their precision next to the loud one


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_states_are_refused(bad):
    x = torch.randn(4, 64).to(torch.bfloat16)
    x[2, 5] = bad
    with pytest.raises(ContractError, match="non-finite"):
        encode_fp8(x, 2)


def test_non_finite_decoded_states_are_refused_by_collate():
    x = torch.randn(6, 32).to(torch.bfloat16)
    aux_codes, aux_scale = encode_fp8(torch.cat([x, x], 1), 2)
    final_codes, final_scale = encode_fp8(x, 1)
    aux_scale[3, 1] = float("nan")  # damaged bytes (the sha256 check was turned off)
    s = StoreSample("s", torch.arange(6, dtype=torch.int32), torch.ones(6, dtype=torch.bool),
                    fp8=Fp8States(aux_codes, aux_scale, final_codes, final_scale))
    with pytest.raises(ContractError, match="non-finite"):
        collate([s], [0], max_seq_len=64, dtype=torch.float32, device="cpu")


def test_fp8_store_round_trip_collate_and_pickle(tmp_path):
    make_extraction(tmp_path / "ex", [30, 17, 5, 40])
    convert(tmp_path / "ex", str(tmp_path / "b"))
    bf16 = open_store(str(tmp_path / "b"))
    summary = convert(tmp_path / "ex", str(tmp_path / "f"), encoding="fp8")
    fp8 = open_store(str(tmp_path / "f"))
    assert summary.encoding == fp8.encoding == fp8.provenance.store_encoding == "fp8"
    manifest = fp8.manifest
    assert manifest["encoding"] == "fp8" and manifest["layout"] == L.LAYOUTS["fp8"]
    assert json.loads(fp8.provenance.to_json())["store_encoding"] == "fp8"
    assert "store_encoding" not in json.loads(bf16.provenance.to_json())  # bf16 provenance reads as before
    assert all(f["encoding"] == "fp8" for f in manifest["files"])
    for i in range(len(bf16)):
        a, b = bf16[i], fp8[i]
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        assert torch.isfinite(b.fp8.aux_scale).all() and torch.isfinite(b.fp8.final_scale).all()
        for name, blocks in (("aux_hidden", 3), ("final_hidden", 1)):
            x, y = getattr(a, name).float(), getattr(b, name)
            assert y.dtype == torch.bfloat16 and y.shape == x.shape
            xb, yb = x.view(len(x), blocks, -1), y.float().view(len(x), blocks, -1)
            assert float(((yb - xb).norm(dim=-1) / xb.norm(dim=-1)).max()) <= FP8_REL_ERROR
    batch = collate([fp8[i] for i in range(4)], list(range(4)), max_seq_len=64, dtype=torch.bfloat16, device="cpu")
    for r in range(4):
        s = fp8[r]
        assert torch.equal(batch.aux_hidden[r, : s.num_tokens], s.aux_hidden)
        assert not batch.aux_hidden[r, s.num_tokens :].any() and not batch.final_hidden[r, s.num_tokens :].any()
    again = pickle.loads(pickle.dumps(fp8[1]))  # DataLoader workers send samples across processes
    assert again.sample_id == fp8[1].sample_id and torch.equal(again.final_hidden, fp8[1].final_hidden)


def test_bytes_per_token_is_about_half_of_bf16(tmp_path):
    prov = fake_provenance(hidden_size=576, aux_layer_ids=(1, 14, 26), num_layers=30)
    make_extraction(tmp_path / "ex", [200, 300, 250], provenance=prov)
    runner = CliRunner()
    for enc in ("bf16", "fp8"):
        r = runner.invoke(app, ["store", "convert", str(tmp_path / "ex"), str(tmp_path / enc), "--encoding", enc])
        assert r.exit_code == 0 and f"({enc})" in r.output, r.output
    info = {enc: json.loads(runner.invoke(app, ["store", "info", str(tmp_path / enc)]).output)
            for enc in ("bf16", "fp8")}
    assert info["fp8"]["encoding"] == "fp8" and info["bf16"]["encoding"] == "bf16"
    ratio = info["fp8"]["bytes_per_token"] / info["bf16"]["bytes_per_token"]
    assert ratio <= 0.52, ratio
    assert bytes_per_token("fp8", 576, 3) / bytes_per_token("bf16", 576, 3) == pytest.approx(0.504, abs=1e-3)


def test_verify_and_rehash_work_for_fp8_files(tmp_path):
    make_extraction(tmp_path / "ex", [30] * 12)
    url = str(tmp_path / "store")
    convert(tmp_path / "ex", url, target_file_bytes=8_000, encoding="fp8")
    assert open_store(url).verify() == []
    victim = Path(open_store(url)._paths[1])
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    r = CliRunner().invoke(app, ["store", "verify", url])
    assert r.exit_code == 1 and victim.name in r.output and "sha256" in r.output, r.output
    with pytest.raises(StoreCorrupt, match=victim.name):
        [open_store(url)[i] for i in range(12)]
    summary = convert(tmp_path / "ex", url, target_file_bytes=8_000, encoding="fp8", rehash=True)
    assert summary.files_quarantined == 1 and summary.files_written == 1 and summary.encoding == "fp8"
    assert open_store(url).verify() == []


def test_append_of_another_encoding_is_refused(tmp_path):
    make_extraction(tmp_path / "ex", [10, 12])
    url = str(tmp_path / "store")
    convert(tmp_path / "ex", url, encoding="fp8")
    make_extraction(tmp_path / "ex", [9], prefix="late")
    with pytest.raises(ConvertInputError, match=r"holds fp8 states.*--encoding fp8"):
        convert(tmp_path / "ex", url, append=True)
    assert convert(tmp_path / "ex", url, append=True, encoding="fp8").samples == 3


def test_a_version_of_fp8_and_bf16_files_is_refused(tmp_path):
    make_extraction(tmp_path / "ex", [10, 12, 14])
    fp8_url, bf16_url = str(tmp_path / "fp8"), str(tmp_path / "bf16")
    convert(tmp_path / "ex", fp8_url, encoding="fp8")
    convert(tmp_path / "ex", bf16_url)
    bf16_file = open_store(bf16_url).manifest["files"][0]
    manifest_path = next((tmp_path / "fp8" / L.VERSIONS_DIR).glob(f"*/{L.MANIFEST_NAME}"))
    manifest = json.loads(manifest_path.read_text())
    original = json.dumps(manifest)

    mixed = {**manifest, "files": manifest["files"] + [bf16_file]}  # a bf16 file listed in an fp8 version
    shutil.copy(tmp_path / "bf16" / bf16_file["path"], tmp_path / "fp8" / bf16_file["path"])
    manifest_path.write_text(json.dumps(mixed))
    with pytest.raises(StoreCorrupt, match=r"mixed encodings in one version.*bf16"):
        open_store(fp8_url)

    # a bf16 file under an fp8 file's record (the record lies): refused when the file is first read
    fp8_path = tmp_path / "fp8" / manifest["files"][0]["path"]
    shutil.copy(tmp_path / "bf16" / bf16_file["path"], fp8_path)
    lying = json.loads(original)
    lying["files"][0].update(bytes=bf16_file["bytes"], sha256=bf16_file["sha256"])
    manifest_path.write_text(json.dumps(lying))
    with pytest.raises(StoreCorrupt, match="holds bf16 states but the version is fp8"):
        open_store(fp8_url)[0]


def test_manifests_from_before_encodings_read_as_bf16(tmp_path):
    make_extraction(tmp_path / "ex", [10, 12])
    url = str(tmp_path / "store")
    convert(tmp_path / "ex", url)
    manifest_path = next((tmp_path / "store" / L.VERSIONS_DIR).glob(f"*/{L.MANIFEST_NAME}"))
    m = json.loads(manifest_path.read_text())
    del m["encoding"]
    for f in m["files"]:
        del f["encoding"]
    manifest_path.write_text(json.dumps(m))
    store = open_store(url)
    assert store.encoding == "bf16" and store[1].aux_hidden.dtype == torch.bfloat16


def test_training_reads_an_fp8_store_and_records_its_encoding(tmp_path, tiny_model_dir, drafter_store):
    from eaglenest.drafter.checkpoint import CheckpointManager
    from eaglenest.drafter.config import TrainConfig
    from eaglenest.drafter.train import train

    prov = drafter_store.provenance
    shards = [Shard(sample_id=s.sample_id, input_ids=s.input_ids, aux_hidden=s.aux_hidden.to(torch.bfloat16),
                    final_hidden=s.final_hidden.to(torch.bfloat16), provenance=prov)
              for s in (drafter_store[i] for i in range(len(drafter_store)))]
    add_samples(tmp_path / "ex", shards)
    url = str(tmp_path / "store")
    convert(tmp_path / "ex", url, encoding="fp8")
    cfg = TrainConfig(store=url, out_dir=str(tmp_path / "run"), target=str(tiny_model_dir), draft_vocab_size=200,
                      ttt_steps=2, max_steps=2, max_tokens=256, max_seq_len=128, warmup_steps=1, eval_fraction=0.1,
                      eval_max_samples=4, precision="fp32", seed=0, threads=1, device="cpu")
    result = train(cfg)
    assert result.step == 2 and result.eval is not None
    state = CheckpointManager(tmp_path / "run").load()
    assert state.state["provenance"]["store_encoding"] == "fp8"
