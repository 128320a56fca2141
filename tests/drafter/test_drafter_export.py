"""Exports: SGLang EAGLE3 and vLLM speculators folders round-trip; the loader refuses another target."""

from __future__ import annotations

import dataclasses
import json
import runpy
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from test_drafter_model import SglangEagle3Reference

from eaglenest.contract import ContractError
from eaglenest.drafter.config import TrainConfig
from eaglenest.drafter.export import MANIFEST, export_drafter, load_drafter, read_trained
from eaglenest.drafter.model import Eagle3Drafter
from eaglenest.drafter.target import load_target_tensors
from eaglenest.drafter.train import train
from eaglenest.testing.fake_store import MemoryStore

# the tensors of shared/device/sglang-0.5.17/bin/make_tiny_eagle3.py (verified to load in SGLang 0.5.17)
SGLANG_KEYS = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
    f"midlayer.{n}.weight" for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm",
                                     "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, tiny_model_dir, drafter_store):
    out = tmp_path_factory.mktemp("export") / "run"
    cfg = TrainConfig(store="memory", out_dir=str(out), target=str(tiny_model_dir), draft_vocab_size=150,
                      ttt_steps=2, max_steps=2, max_tokens=256, max_seq_len=128, warmup_steps=1, eval_fraction=0.0,
                      eval_every=0, precision="fp32", threads=1)
    train(cfg, store=drafter_store)
    return out


def tensors(path):
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def test_sglang_export_layout_and_round_trip(tmp_path, trained_run, tiny_model_dir, drafter_store):
    out = export_drafter(trained_run, tmp_path / "sglang", fmt="sglang")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert (cfg["draft_vocab_size"], cfg["target_hidden_size"], cfg["vocab_size"]) == (150, 64, 512)
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(drafter_store.provenance.aux_layer_ids)
    assert cfg["tie_word_embeddings"] is False  # True would make SGLang use the embedding as the head
    w = tensors(out)
    assert set(w) == SGLANG_KEYS
    assert w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool and w["fc.weight"].dtype == torch.bfloat16
    assert int(w["t2d"].sum()) == 150 and bool((w["d2t"] >= 0).all())
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["provenance"]["model_hash"] == drafter_store.provenance.model_hash
    assert manifest["convention"] == drafter_store.provenance.convention and manifest["training"]["step"] == 2
    # the loader rebuilds exactly the exported (bf16-rounded) network
    loaded = load_drafter(out, target_dir=tiny_model_dir, provenance=drafter_store.provenance).model
    trained = read_trained(trained_run)
    ref = Eagle3Drafter(trained.config, embed_weight=load_target_tensors(tiny_model_dir).embed)
    ref.load_state_dict({k: v.to(torch.bfloat16).float() if v.is_floating_point() else v
                         for k, v in trained.weights.items()})
    s = drafter_store[0]
    n = s.input_ids.numel() - 1
    args = (s.input_ids[None, 1:].long(), s.aux_hidden[None, :n].float(), torch.arange(n)[None])
    with torch.no_grad():
        got, want = loaded.extend(*args), ref.extend(*args)
    assert torch.equal(got.logits, want.logits)
    # and SGLang's math over the exported tensors (names, d2t) gives the same draft
    sgl = SglangEagle3Reference(w, trained.config, load_target_tensors(tiny_model_dir).embed)
    sgl_logits, hot, _ = sgl.forward(args[0][0], args[2][0], args[1][0])
    torch.testing.assert_close(sgl_logits, got.logits[0], rtol=1e-4, atol=1e-4)
    assert torch.equal(hot[sgl_logits.argmax(-1)], loaded.to_target_ids(got.logits[0].argmax(-1)))
    with pytest.raises(FileExistsError):
        export_drafter(trained_run, out, fmt="sglang")


def test_speculators_export_layout(tmp_path, trained_run, tiny_model_dir, drafter_store):
    out = export_drafter(trained_run, tmp_path / "vllm", fmt="speculators", speculative_tokens=3)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["norm_before_residual"] is False
    assert cfg["transformer_layer_config"]["vocab_size"] == 512 and cfg["draft_vocab_size"] == 150
    assert cfg["speculators_config"]["proposal_methods"][0] == {"proposal_type": "greedy", "speculative_tokens": 3}
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == drafter_store.provenance.model_path
    # vLLM names the layer whose INPUT it takes: ours + 1
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in drafter_store.provenance.aux_layer_ids]
    assert set(tensors(out)) == {k.replace("midlayer.", "layers.0.") for k in SGLANG_KEYS}
    a = load_drafter(out, target_dir=tiny_model_dir).model
    b = load_drafter(export_drafter(trained_run, tmp_path / "sgl", fmt="sglang"), target_dir=tiny_model_dir).model
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_loader_refuses_a_mismatched_target_or_capture(tmp_path, trained_run, tiny_model_dir, drafter_store):
    out = export_drafter(trained_run, tmp_path / "sglang", fmt="sglang")
    other = tmp_path / "other-target"
    shutil.copytree(tiny_model_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(cfg | {"rms_norm_eps": 1e-6}))  # same shapes, other model
    with pytest.raises(ContractError, match="model_hash"):
        load_drafter(out, target_dir=other)
    (other / "config.json").write_text(json.dumps(cfg | {"hidden_size": 96}))
    with pytest.raises(ContractError, match="hidden_size: drafter 64 != target 96"):
        load_drafter(out, target_dir=other)
    (other / "config.json").write_text(json.dumps(cfg | {"vocab_size": 600}))
    with pytest.raises(ContractError, match="vocab_size"):
        load_drafter(out, target_dir=other)
    wrong_aux = dataclasses.replace(drafter_store.provenance, aux_layer_ids=(0, 2, 4))
    with pytest.raises(ContractError, match="aux_layer_ids"):
        load_drafter(out, target_dir=tiny_model_dir, provenance=wrong_aux)
    data = bytearray((out / "model.safetensors").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (out / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ContractError, match="sha256"):
        load_drafter(out, target_dir=tiny_model_dir)


def test_training_starts_from_an_exported_drafter(tmp_path, trained_run, tiny_model_dir, drafter_store):
    """init_from: a new run starts with the export's weights and draft vocabulary (a fresh schedule), and
    refuses a config that asks for another vocabulary size or for two starting points."""
    from eaglenest.drafter.train import Trainer

    out = export_drafter(trained_run, tmp_path / "sgl", fmt="sglang")
    exported = load_drafter(out, target_dir=tiny_model_dir).model.state_dict()
    cfg = TrainConfig(store="memory", out_dir=str(tmp_path / "more"), target=str(tiny_model_dir), init_from=str(out),
                      ttt_steps=2, max_steps=3, max_tokens=256, max_seq_len=128, warmup_steps=1, eval_fraction=0.0,
                      eval_every=0, precision="fp32", threads=1)
    t = Trainer.setup(cfg, store=drafter_store)
    assert t.vocab.size == 150 and t.total == 3 and t.step_no == 0
    start = t.drafter.state_dict()
    assert set(start) == set(exported) and all(torch.equal(start[k], exported[k]) for k in exported)
    fresh = Trainer.setup(cfg.model_copy(update={"init_from": None, "draft_vocab_size": 150,
                                                 "out_dir": str(tmp_path / "fresh")}), store=drafter_store)
    assert not torch.equal(fresh.drafter.state_dict()["fc.weight"], exported["fc.weight"])  # a real start point
    # new data with a vocabulary of its own: the drafter's vocabulary is kept, not rebuilt from the new store
    few = MemoryStore([drafter_store[i] for i in range(4)], drafter_store.provenance)
    own = Trainer.setup(cfg.model_copy(update={"init_from": None, "draft_vocab_size": 150,
                                               "out_dir": str(tmp_path / "own")}), store=few)
    assert not torch.equal(own.vocab.d2t, exported["d2t"])
    kept = Trainer.setup(cfg.model_copy(update={"out_dir": str(tmp_path / "kept")}), store=few)
    assert torch.equal(kept.vocab.d2t, exported["d2t"]) and torch.equal(kept.drafter.d2t, exported["d2t"])
    result = train(cfg, store=drafter_store)
    assert result.status == "done" and result.step == 3 and read_trained(tmp_path / "more").training["step"] == 3
    with pytest.raises(ContractError, match="draft_vocab_size 150, the config asks for 100"):
        Trainer.setup(cfg.model_copy(update={"draft_vocab_size": 100, "out_dir": str(tmp_path / "v")}),
                      store=drafter_store)
    with pytest.raises(ValueError, match="both set the starting weights"):
        TrainConfig(**{**cfg.model_dump(), "init": "target"})


def test_a_continued_drafter_widens_its_vocabulary(tmp_path, trained_run, tiny_model_dir, drafter_store):
    """init_from with a larger draft_vocab_size: the drafter's own tokens keep their head rows (its logits there are
    the export's), the training split's most frequent tokens it lacks join with zero rows, and the run trains and
    exports the wider vocabulary (an equal size keeps it; a smaller one is refused)."""
    from eaglenest.drafter.train import Trainer
    from eaglenest.drafter.vocab import DraftVocab

    out = export_drafter(trained_run, tmp_path / "sgl", fmt="sglang")
    exported = load_drafter(out, target_dir=tiny_model_dir).model
    own = DraftVocab.from_d2t(exported.d2t, exported.config.vocab_size)
    cfg = TrainConfig(store="memory", out_dir=str(tmp_path / "wider"), target=str(tiny_model_dir), init_from=str(out),
                      draft_vocab_size=own.size + 40, ttt_steps=2, max_steps=2, max_tokens=256, max_seq_len=128,
                      warmup_steps=1, eval_fraction=0.0, eval_every=0, precision="fp32", threads=1)
    t = Trainer.setup(cfg, store=drafter_store)
    ids = t.vocab.target_ids
    assert t.vocab.size == own.size + 40 and bool(torch.isin(own.target_ids, ids).all())
    assert torch.equal(t.drafter.to_target_ids(torch.arange(t.vocab.size)), ids)
    assert torch.equal(t.drafter.t2d, t.vocab.t2d) and int(t.drafter.t2d.sum()) == own.size + 40
    at = torch.searchsorted(ids, own.target_ids)
    head = t.drafter.lm_head.weight.detach()
    assert torch.equal(head[at], exported.lm_head.weight.detach())
    s = drafter_store[0]
    n = s.input_ids.numel() - 1
    args = (s.input_ids[None, 1:].long(), s.aux_hidden[None, :n].float(), torch.arange(n)[None])
    with torch.no_grad():
        torch.testing.assert_close(t.drafter.extend(*args).logits[..., at], exported.extend(*args).logits)
    added = torch.ones(t.vocab.size, dtype=torch.bool)
    added[at] = False
    assert not head[added].any()  # zero rows: drafted as before until trained
    assert train(cfg, store=drafter_store).status == "done"
    wider = export_drafter(tmp_path / "wider", tmp_path / "sgl-wider", fmt="sglang")
    trained = load_drafter(wider, target_dir=tiny_model_dir).model
    assert trained.config.draft_vocab_size == own.size + 40
    assert trained.lm_head.weight.detach()[added].abs().sum(dim=1).gt(0).all()  # training moved every added row
    same = Trainer.setup(cfg.model_copy(update={"draft_vocab_size": own.size, "out_dir": str(tmp_path / "same")}),
                         store=drafter_store)
    assert torch.equal(same.vocab.target_ids, own.target_ids)
    with pytest.raises(ContractError, match="a larger draft vocabulary widens it"):
        Trainer.setup(cfg.model_copy(update={"draft_vocab_size": own.size - 1, "out_dir": str(tmp_path / "v")}),
                      store=drafter_store)


def test_a_wider_draft_mlp_trains_exports_and_keeps_its_width(tmp_path, tiny_model_dir, drafter_store):
    """draft_intermediate_size widens the draft layer's MLP: the export's config says so, SGLang's math over the
    exported tensors gives the loaded drafter's logits, and a run started from it keeps that width."""
    from eaglenest.drafter.train import Trainer

    cfg = TrainConfig(store="memory", out_dir=str(tmp_path / "wide"), target=str(tiny_model_dir), draft_vocab_size=150,
                      draft_intermediate_size=320, ttt_steps=2, max_steps=2, max_tokens=256, max_seq_len=128,
                      warmup_steps=1, eval_fraction=0.0, eval_every=0, precision="fp32", threads=1)
    assert train(cfg, store=drafter_store).status == "done"
    out = export_drafter(tmp_path / "wide", tmp_path / "sgl", fmt="sglang")
    assert json.loads((out / "config.json").read_text())["intermediate_size"] == 320
    w = tensors(out)
    assert tuple(w["midlayer.mlp.gate_proj.weight"].shape) == (320, 64)
    loaded = load_drafter(out, target_dir=tiny_model_dir).model
    assert loaded.config.intermediate_size == 320
    s = drafter_store[0]
    n = s.input_ids.numel() - 1
    args = (s.input_ids[None, 1:].long(), s.aux_hidden[None, :n].float(), torch.arange(n)[None])
    with torch.no_grad():
        got = loaded.extend(*args)
    sgl = SglangEagle3Reference(w, loaded.config, load_target_tensors(tiny_model_dir).embed)
    torch.testing.assert_close(sgl.forward(args[0][0], args[2][0], args[1][0])[0], got.logits[0],
                               rtol=1e-4, atol=1e-4)
    more = cfg.model_copy(update={"draft_intermediate_size": None, "init_from": str(out),
                                  "out_dir": str(tmp_path / "more")})
    assert Trainer.setup(more, store=drafter_store).drafter.config.intermediate_size == 320
    with pytest.raises(ContractError, match="draft_intermediate_size 320, the config asks for 128"):
        Trainer.setup(more.model_copy(update={"draft_intermediate_size": 128}), store=drafter_store)


def test_an_untrained_drafter_of_a_given_shape_loads_for_its_target(tiny_model_dir, tmp_path):
    """gpu_check_export.py --random --draft-vocab V --draft-mlp M (what gpu_session's untrained:VxM times live):
    the export has that head and MLP, its target's fingerprint, and the warm start's head rows are the target's."""
    script = runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / "gpu_check_export.py"))
    out = script["random_drafter_export"](tiny_model_dir, tmp_path / "u", 100, 96)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["draft_vocab_size"], cfg["intermediate_size"]) == (100, 96)
    loaded = load_drafter(out, target_dir=tiny_model_dir)
    head = loaded.model.lm_head.weight.float()
    target_rows = load_target_tensors(tiny_model_dir).lm_head[:100].float()
    assert torch.allclose(head, target_rows.to(torch.bfloat16).float(), atol=1e-2)
