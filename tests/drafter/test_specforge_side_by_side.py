"""scripts/gpu_specforge.py and its scripts/specforge_side_by_side.py on the CPU: the store -> SpecForge
offline-format converter (default suite), and, when PyPI ``specforge`` is importable, its trainer on the converted
samples beside ours, both exports scored by our evaluator, and SpecForge's own forward against our reading of its
export (slow)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def side_by_side():
    """scripts/specforge_side_by_side.py, found as the script finds it: its folder first on sys.path."""
    folder = str(ROOT / "scripts")
    sys.path.insert(0, folder)
    try:
        yield importlib.import_module("specforge_side_by_side")
    finally:
        sys.path.remove(folder)
        sys.modules.pop("specforge_side_by_side", None)


@pytest.fixture(scope="module")
def sf_script(side_by_side):
    spec = importlib.util.spec_from_file_location("gpu_specforge", ROOT / "scripts" / "gpu_specforge.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _settings(side_by_side, tiny_model_dir, work, **kw):
    base = dict(store="memory", target=str(tiny_model_dir), work=str(work), max_train_tokens=10**6, epochs=1,
                draft_vocab=200, max_tokens=512, max_seq_len=512, sf_batch_size=2, sf_attention="sdpa",
                sf_sharding="NO_SHARD", sf_workers=0, warmup_steps=2, eval_fraction=0.1, eval_max_samples=4,
                device="cpu")
    return side_by_side.Settings(**{**base, **kw})


def test_selection_is_the_training_split_in_whole_specforge_steps(side_by_side, drafter_store, tiny_model_dir,
                                                                  tmp_path):
    from eaglenest.store import split_indices

    s = _settings(side_by_side, tiny_model_dir, tmp_path, max_train_tokens=1500)
    sel = side_by_side.select_samples(drafter_store, s)
    _, heldout = split_indices(drafter_store.sample_ids, s.eval_fraction, max_eval=s.eval_max_samples)
    assert heldout and not set(heldout) & set(sel.indices)
    assert len(sel.indices) % (sel.batch_size * sel.accumulation_steps) == 0
    assert sel.tokens == sum(int(drafter_store.num_tokens[i]) for i in sel.indices) <= 1500
    assert sel.indices == sorted(sel.indices)  # the first samples of the split, in store order


def test_specforge_steps_hold_as_many_samples_as_ours(side_by_side, drafter_store, tiny_model_dir, tmp_path):
    s = _settings(side_by_side, tiny_model_dir, tmp_path, max_tokens=1024, sf_batch_size=4)
    sel = side_by_side.select_samples(drafter_store, s)
    ours = len(sel.indices) / sel.eaglenest_steps_per_epoch
    assert sel.batch_size <= 4
    assert abs(sel.batch_size * sel.accumulation_steps - ours) <= sel.accumulation_steps / 2 + 1


def test_convert_writes_specforge_offline_features(side_by_side, drafter_store, tiny_model_dir, tmp_path):
    from eaglenest.drafter.vocab import build_draft_vocab

    s = _settings(side_by_side, tiny_model_dir, tmp_path)
    sel = side_by_side.select_samples(drafter_store, s)
    done = side_by_side.convert(drafter_store, s, sel)
    files = sorted((tmp_path / "features").glob("*.ckpt"))
    assert len(files) == len(sel.indices) == done["samples"] and not list((tmp_path / "features").glob("*.tmp"))
    for path, i in zip(files, sel.indices, strict=True):
        rec, sample = torch.load(path, weights_only=True), drafter_store[i]
        t, h = sample.input_ids.numel(), drafter_store.provenance.hidden_size
        assert rec["input_ids"].dtype == rec["loss_mask"].dtype == torch.int64
        assert rec["hidden_state"].shape == (1, t, h) and rec["aux_hidden_state"].shape == (1, t, 3 * h)
        assert rec["hidden_state"].dtype == rec["aux_hidden_state"].dtype == torch.bfloat16
        assert torch.equal(rec["input_ids"], sample.input_ids.long())
        assert torch.equal(rec["hidden_state"][0], sample.final_hidden.to(torch.bfloat16))
        assert torch.equal(rec["aux_hidden_state"][0], sample.aux_hidden.to(torch.bfloat16))
        # SpecForge counts anchor t by mask[t]; ours by the target row t + 1: the file holds our mask shifted
        assert torch.equal(rec["loss_mask"][:-1], sample.loss_mask[1:].long()) and rec["loss_mask"][-1] == 0
        assert path.stat().st_size < 4 * t * 4 * h * 2 + 10_000  # the sample's own bytes, not its source file's
    vocab = build_draft_vocab(((drafter_store[i].input_ids, drafter_store[i].loss_mask) for i in sel.indices),
                              vocab_size=int(json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]),
                              size=s.draft_vocab)
    mapping = torch.load(tmp_path / "vocab_mapping.pt", weights_only=True)
    assert torch.equal(mapping["d2t"], vocab.d2t) and torch.equal(mapping["t2d"], vocab.t2d)
    cfg = json.loads((tmp_path / "draft_config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 200
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(drafter_store.provenance.aux_layer_ids)
    index = json.loads((tmp_path / "target" / "model.safetensors.index.json").read_text())
    assert done["lm_head_key"] in index["weight_map"]
    before = [f.stat().st_mtime_ns for f in files]
    assert side_by_side.convert(drafter_store, s, sel)["key"] == done["key"]  # present and valid: reused
    assert [f.stat().st_mtime_ns for f in files] == before


@pytest.fixture
def specforge_on_cpu(monkeypatch):
    """SpecForge importable on the CPU: its KL loss is a Triton kernel (GPU only), so a torch stand-in with the
    kernel's semantics (per row -sum p log q where the position counts, mean over B x T) replaces the module
    that holds it; torch.compile is switched off (no compiler toolchain needed)."""
    pytest.importorskip("specforge", reason="PyPI specforge is not installed (pip install --no-deps specforge)")
    pytest.importorskip("datasets", reason="specforge's offline collator imports datasets")

    class LogSoftmaxLoss:
        @staticmethod
        def apply(logits, target_p, position_mask):
            logp = torch.log_softmax(logits.float(), dim=-1)
            return -(position_mask * target_p * logp).sum(-1).mean()

    stand_in = types.ModuleType("specforge.core.loss")
    stand_in.LogSoftmaxLoss = LogSoftmaxLoss
    for name in [m for m in sys.modules if m.startswith("specforge.algorithms.eagle3.model")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "specforge.core.loss", stand_in)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with torch._dynamo.config.patch(disable=True):
        yield


@pytest.mark.slow  # a tiny extraction, two tiny trainings, four evaluations: ~1-2 min on 2 cores
def test_side_by_side_cli_on_an_extraction(sf_script, specforge_on_cpu, tiny_extract_params, capture_servers,
                                           tiny_model_dir, tmp_path, monkeypatch):
    from eaglenest.extraction.run import run_extraction
    from eaglenest.extraction.state import open_extraction

    params = tiny_extract_params.model_copy(update={"limit": 60})
    ext = open_extraction(params).dir
    ((url, _),) = capture_servers(ext / "capture")
    assert run_extraction(params.model_copy(update={"server_urls": [url]}))["done"] >= 10
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    work = tmp_path / "work"
    tiny = ["--target", str(tiny_model_dir), "--work", str(work), "--epochs", "2", "--draft-vocab", "200",
            "--max-tokens", "512", "--max-seq-len", "512", "--sf-batch-size", "2", "--sf-attention", "sdpa",
            "--sf-sharding", "NO_SHARD", "--sf-workers", "0", "--warmup-steps", "2", "--eval-fraction", "0.2",
            "--eval-max-samples", "4", "--device", "cpu"]
    assert sf_script.main(["all", "--store", str(ext), *tiny, "--eval-set", f"again={ext}"]) == 0
    report = json.loads((tmp_path / "out" / "specforge_side_by_side.json").read_text())
    sel = json.loads((work / "selection.json").read_text())["selection"]
    sf, en = report["train"]["specforge"], report["train"]["eaglenest"]
    assert en["tokens"] == sf["tokens"] == 2 * sel["tokens"]  # the same tokens, each trainer its own steps
    assert sf["steps"] == 2 * len(sel["indices"]) // (sel["batch_size"] * sel["accumulation_steps"])
    assert all(math.isfinite(w["loss"]) for w in sf["log"]) and sf["tokens_per_s"] > 0 < en["tokens_per_s"]
    for name in ("eaglenest", "specforge"):
        for set_name in ("heldout", "again"):
            res = report["scores"][name][set_name]
            assert res["samples"] > 0 and all(1.0 <= v <= 8.0 for v in res["accept_length_cycles"].values())
    assert json.loads((work / "specforge-export" / "config.json").read_text())["eagle_config"]
    # one phase again: scoring alone reads what the run left and keeps the training records
    assert sf_script.main(["score", "--store", str(ext), *tiny]) == 0
    assert json.loads((tmp_path / "out" / "specforge_side_by_side.json").read_text())["train"] == report["train"]


@pytest.mark.slow
def test_our_reader_computes_specforge_drafter_as_specforge_does(side_by_side, specforge_on_cpu, drafter_store,
                                                                  tiny_model_dir, tmp_path):
    """Step 0 of the TTT unroll (no draft cache, positions 0..T-1 on both sides): the logits of SpecForge's own
    LlamaForCausalLMEagle3 equal those of eaglenest's drafter loaded from SpecForge's SGLang export."""
    from specforge.export.checkpoint_io import materialize_draft, resolve_training_state

    from eaglenest.drafter.data import collate
    from eaglenest.drafter.ttt import shift_left, unroll
    from eaglenest.speculative.draft import load_exported_drafter, target_embedding

    s = _settings(side_by_side, tiny_model_dir, tmp_path, max_train_tokens=800)
    sel = side_by_side.select_samples(drafter_store, s)
    done = side_by_side.convert(drafter_store, s, sel)
    side_by_side.train_specforge(side_by_side.specforge_config(s, sel, done["lm_head_key"]), mean_tokens=1.0)
    export = side_by_side.export_specforge(tmp_path)
    embed = target_embedding(tiny_model_dir).float()
    ours = load_exported_drafter(export, embed_weight=embed, dtype=torch.float32)
    theirs = materialize_draft(resolve_training_state(str(tmp_path / "specforge-run")),
                               str(tmp_path / "draft_config.json")).float().eval()
    theirs.embed_tokens.weight.data.copy_(embed)
    batch = collate([drafter_store[sel.indices[0]]], [0], max_seq_len=512, dtype=torch.float32)
    with torch.no_grad():
        z_ours = ours.head(next(unroll(ours, batch, 1)))  # [1, T, Vd]
        normed = theirs(hidden_states=batch.aux_hidden, inputs_embeds=theirs.embed_tokens(
            shift_left(batch.input_ids, 1)))
        z_theirs = theirs.lm_head(normed)
    assert torch.allclose(z_ours, z_theirs, atol=1e-4, rtol=1e-3), (z_ours - z_theirs).abs().max()
