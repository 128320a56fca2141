"""Shard builders shared by the validation tests (not a test module): a provenance and the run's expectation
of it, samples, shard bytes (valid or deliberately broken) and ``check``, which writes the shards into an
extraction folder and validates them as one batch."""

import torch
from safetensors.torch import save as st_save

from eaglenest import contract
from eaglenest.data import Sample
from eaglenest.extraction.validate import Expectation, ValidateConfig, validate_batch

H, AUX = 16, (1, 3, 4)


def prov(**changes):
    base = dict(engine="embedded", engine_version="0", model_path="/m", model_hash="mh", tokenizer_hash="th",
                chat_template_hash="ch", dtype="bfloat16", aux_layer_ids=AUX, hidden_size=H, num_layers=8)
    return contract.Provenance(**{**base, **changes})


EXPECT = Expectation(aux_layer_ids=AUX, hidden_size=H, num_layers=8, model_hash="mh", tokenizer_hash="th",
                     chat_template_hash="ch", provenance=prov())


def sample(sid, t=6, regenerated=False):
    return Sample(sample_id=sid, input_ids=list(range(3, 3 + t)), loss_spans=((2, t),), regenerated=regenerated)


def shard_bytes(s, *, p=None, ids=None, scale=1.0, final=None, raw_nan=False):
    ids = torch.tensor(s.input_ids.tolist() if ids is None else ids, dtype=torch.int32)
    g = torch.Generator().manual_seed(len(s.sample_id))
    t = ids.shape[0]
    aux = (torch.randn(t, len(AUX) * H, generator=g) * scale).to(torch.bfloat16)
    fin = (torch.randn(t, H, generator=g) if final is None else final).to(torch.bfloat16)
    shard = contract.Shard(sample_id=s.sample_id, input_ids=ids, aux_hidden=aux, final_hidden=fin,
                           provenance=p or prov())
    if raw_nan:  # bypass the writer's finite check: a corrupted file on disk
        aux[1, 2] = float("nan")
        meta = {"schema_version": "1", "sample_id": s.sample_id, "provenance": shard.provenance.to_json()}
        return st_save({"input_ids": ids, "aux_hidden": aux, "final_hidden": fin}, metadata=meta)
    return contract.encode_shard(shard)


def put(ext_dir, s, data):
    cap = ext_dir / "capture"
    cap.mkdir(parents=True, exist_ok=True)
    (cap / contract.shard_filename(s.sample_id)).write_bytes(data)


def check(tmp_path, items, **kw):
    for s, data in items:
        if data is not None:
            put(tmp_path, s, data)
    cfg = kw.pop("config", ValidateConfig(shard_wait_s=0.0))
    return validate_batch([s for s, _ in items], extraction_dir=tmp_path, expect=kw.pop("expect", EXPECT),
                          config=cfg, **kw)
