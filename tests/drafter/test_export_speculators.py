"""The vLLM (speculators) export read by the ``speculators`` package itself (PyPI 0.9.0, CPU).

Not our reading of the format: speculators' own :class:`Eagle3SpeculatorConfig` parses config.json and
its :class:`Eagle3DraftModel.from_pretrained` builds the drafter and loads model.safetensors (HF's
strict key matching, minus the verifier-owned tensors it documents as missing). Then its
``load_verifier_weights`` fills the embedding and the draft LM head's verifier copy from the target
folder the config names. Every config field, weight and the vocabulary mapping must equal ours.

speculators pins transformers <= 5.19 and pulls torchvision/torchaudio; install it beside our torch
without letting pip resolve it (`make interop` does exactly this):
``pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0 datasets==5.1.0 dill multiprocess xxhash``
plus ``pip install openai loguru pandas`` (what its imports really need).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from test_drafter_export import trained_run  # noqa: F401  (module fixture: a 2-step trained tiny drafter)

from eaglenest.drafter.export import export_drafter, read_trained
from eaglenest.drafter.target import load_target_tensors

eagle3 = pytest.importorskip(
    "speculators.models.eagle3",
    reason="speculators 0.9.0 is not importable (`make interop` installs it with --no-deps beside torch 2.13)")


@pytest.fixture(scope="module")
def exported(trained_run, tmp_path_factory):  # noqa: F811
    return export_drafter(trained_run, tmp_path_factory.mktemp("spec") / "vllm", fmt="speculators",
                          speculative_tokens=3, dtype="float32")


def test_speculators_reads_our_config(exported, trained_run, drafter_store):  # noqa: F811
    ours = read_trained(trained_run).config
    cfg = eagle3.Eagle3SpeculatorConfig.from_pretrained(str(exported))
    assert type(cfg).__name__ == "Eagle3SpeculatorConfig" and cfg.speculators_model_type == "eagle3"
    assert (cfg.draft_vocab_size, cfg.target_hidden_size, cfg.target_vocab_size) == (
        ours.draft_vocab_size, ours.target_hidden_size, ours.vocab_size)
    assert cfg.norm_before_residual is False and cfg.norm_before_fc is False and cfg.fc_norm is False
    # speculators numbers hidden_states entries (the INPUT of layer i): our layer outputs + 1
    assert cfg.eagle_aux_hidden_state_layer_ids == [i + 1 for i in ours.aux_layer_ids]
    layer = cfg.transformer_layer_config
    assert type(layer).__name__ == "LlamaConfig" and layer.num_hidden_layers == 1
    assert (layer.hidden_size, layer.intermediate_size, layer.num_attention_heads, layer.num_key_value_heads,
            layer.head_dim, layer.vocab_size, layer.max_position_embeddings, layer.hidden_act) == (
        ours.hidden_size, ours.intermediate_size, ours.num_attention_heads, ours.num_key_value_heads,
        ours.head_dim, ours.vocab_size, ours.max_position_embeddings, ours.hidden_act)
    assert layer.rms_norm_eps == pytest.approx(ours.rms_norm_eps)
    assert layer.rope_parameters["rope_theta"] == pytest.approx(ours.rope_theta)
    spec = cfg.speculators_config
    assert spec.algorithm == "eagle3" and spec.default_proposal_method == "greedy"
    assert [(p.proposal_type, p.speculative_tokens) for p in spec.proposal_methods] == [("greedy", 3)]
    assert spec.verifier.name_or_path == drafter_store.provenance.model_path
    assert spec.verifier.architectures == ["LlamaForCausalLM"]


def test_speculators_model_loads_our_weights_and_vocab_mapping(exported, trained_run, tiny_model_dir):  # noqa: F811
    ours = read_trained(trained_run)
    model = eagle3.Eagle3DraftModel.from_pretrained(str(exported), torch_dtype=torch.float32)
    assert model.config.eagle_aux_hidden_state_layer_ids == [i + 1 for i in ours.config.aux_layer_ids]
    got = model.state_dict()
    for name, want in ours.weights.items():  # every trained tensor, under vLLM's name, bit for bit (fp32 export)
        theirs = got[name.replace("midlayer.", "layers.0.")]
        assert theirs.dtype == want.dtype and torch.equal(theirs, want), name
    exported_names = set(load_file(str(exported / "model.safetensors")))
    assert exported_names == {n.replace("midlayer.", "layers.0.") for n in ours.weights}
    # vocabulary mapping: draft id d is target id d + d2t[d]; t2d marks exactly those target ids
    d2t, t2d = model.d2t, model.t2d
    targets = torch.arange(ours.config.draft_vocab_size) + d2t
    assert torch.equal(targets, torch.nonzero(t2d).flatten())
    assert int(t2d.sum()) == ours.config.draft_vocab_size == model.draft_vocab_size
    assert model.use_draft_vocab and model.verifier_vocab_size == ours.config.vocab_size
    # the verifier-owned tensors come from the target folder the config names: speculators' verifier head is
    # the target's LM head restricted to our draft vocabulary (through OUR t2d), its norm the target's
    model.load_verifier_weights()
    target = load_target_tensors(tiny_model_dir)
    assert torch.equal(model.verifier_lm_head.weight, target.lm_head[t2d].to(torch.float32))
    assert torch.equal(model.verifier_norm.weight, target.final_norm.to(torch.float32))
    assert torch.equal(model.lm_head.weight, ours.weights["lm_head.weight"])  # ours kept, not the target's
    # (embed_tokens is not in the export, by design: the engine shares the target's. speculators decides
    # whether to fill it by testing for NaN, but transformers 5.24 leaves a missing tensor uninitialized rather
    # than NaN (speculators pins <= 5.19), so its embedding is not compared here.)
    head = json.loads((exported / "config.json").read_text())
    assert head["architectures"] == ["Eagle3Speculator"]
