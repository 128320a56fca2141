"""Exports of a trained drafter that serving engines load, and the loader that checks them.

Owns two folder layouts, both carrying the capture conventions and provenance (``eaglenest.json``,
written LAST, plus a small ``eaglenest`` block in config.json):

- ``sglang``: SGLang 0.5.17 ``--speculative-algorithm EAGLE3 --speculative-draft-model-path DIR``.
  config.json: architectures ["LlamaForCausalLMEagle3"], model_type llama, one layer,
  ``draft_vocab_size``, ``target_hidden_size``, ``tie_word_embeddings: false`` (true would make SGLang
  use the embedding as the head), ``eagle_config.eagle_aux_hidden_state_layer_ids`` = our aux ids
  (SGLang captures the OUTPUT of those layers, +1 internally). Weights: ``fc``, ``midlayer.*``,
  ``norm``, ``lm_head``, ``d2t`` (int64, target - draft), ``t2d`` (bool); no embedding (SGLang shares
  the target's).
- ``speculators``: the vLLM speculators layout (``speculators_model_type: eagle3``,
  ``transformer_layer_config``, ``speculators_config`` with a greedy proposal and the verifier).
  ``norm_before_residual: false`` is explicit (vLLM defaults it to true; SGLang's math is false).
  vLLM names the layer whose INPUT it takes: its ``eagle_aux_hidden_state_layer_ids`` = ours + 1.
  Weights as above with ``layers.0.*`` for ``midlayer.*``.

Invariants: an export folder appears atomically (built beside, renamed); :func:`load_drafter`
refuses a target or capture whose hidden size, vocabulary, aux layers or model hash differ from
those the drafter was trained on, naming the field.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load, load_file, save_file

from eaglenest import __version__, contract
from eaglenest import models as model_lib
from eaglenest.drafter.checkpoint import CheckpointManager
from eaglenest.drafter.model import DrafterConfig, Eagle3Drafter
from eaglenest.drafter.target import load_target_tensors

Format = Literal["sglang", "speculators"]
MANIFEST = "eaglenest.json"
EXPORT_SCHEMA = 1


@dataclass(frozen=True, slots=True)
class TrainedDrafter:
    """A drafter as training left it: weights (SGLang names), shape, provenance and a summary."""

    weights: dict[str, torch.Tensor]
    config: DrafterConfig
    provenance: contract.Provenance
    training: dict


def read_trained(path: str | Path) -> TrainedDrafter:
    """From a run folder (its latest checkpoint) or one checkpoint folder."""
    path = Path(path)
    ckpt_dir = path if (path / "state.json").is_file() else CheckpointManager(path).latest()
    if ckpt_dir is None:
        raise contract.ContractError(f"{path}: neither a checkpoint folder nor a run folder with checkpoints")
    state = json.loads((ckpt_dir / "state.json").read_text())
    training = {"checkpoint": str(ckpt_dir), "step": state["step"], "total_steps": state.get("total_steps"),
                "train_tokens": state.get("train_tokens"), "eval": state.get("last_eval"),
                "store_fingerprint": state.get("store_fingerprint"), "vocab_coverage": state.get("vocab_coverage"),
                "config": state.get("config")}
    return TrainedDrafter(weights=load_file(str(ckpt_dir / "model.safetensors")),
                          config=DrafterConfig.from_dict(state["drafter_config"]),
                          provenance=contract.Provenance.from_json(state["provenance"]), training=training)


def read_export(folder: str | Path, *, what: str = "not an eaglenest export (or an incomplete one)"
                ) -> tuple[dict, TrainedDrafter]:
    """An export folder (either format) as its manifest and the drafter in it (SGLang weight names); ContractError
    naming the folder (and ``what``, when it has no manifest) unless it is a complete, intact export."""
    folder = Path(folder)
    if not (folder / MANIFEST).is_file():
        raise contract.ContractError(f"{folder}: no {MANIFEST}; {what}")
    manifest = json.loads((folder / MANIFEST).read_text())
    if manifest.get("schema_version") != EXPORT_SCHEMA:
        raise contract.UnknownSchemaVersion(f"{folder}: export schema {manifest.get('schema_version')!r} unknown")
    data = (folder / "model.safetensors").read_bytes()
    if hashlib.sha256(data).hexdigest() != manifest["weights_sha256"]:
        raise contract.ContractError(f"{folder}/model.safetensors: sha256 differs from the manifest (corrupt copy)")
    weights = {k.replace("layers.0.", "midlayer."): v for k, v in load(data).items()}
    return manifest, TrainedDrafter(weights=weights, config=DrafterConfig.from_dict(manifest["drafter_config"]),
                                    provenance=contract.Provenance.from_json(manifest["provenance"]),
                                    training=dict(manifest.get("training") or {}))


def speculative_tokens(src: Path, fmt: str) -> dict:
    """``export_drafter``'s keywords that keep an export's own settings when it is written again (a speculators
    export keeps its proposal length)."""
    if fmt != "speculators":
        return {}
    methods = json.loads((src / "config.json").read_text())["speculators_config"]["proposal_methods"]
    return {"speculative_tokens": int(methods[0]["speculative_tokens"])}


def _llama_config(cfg: DrafterConfig, dtype: str) -> dict:
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {"model_type": "llama", "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": 1, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "hidden_act": cfg.hidden_act,
            "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "rope_parameters": rope,
            "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
            "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "dtype": dtype,
            "torch_dtype": dtype, "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
            "pad_token_id": cfg.pad_token_id}


def sglang_config(cfg: DrafterConfig, dtype: str = "bfloat16") -> dict:
    out = _llama_config(cfg, dtype)
    out.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=cfg.draft_vocab_size,
               target_hidden_size=cfg.target_hidden_size,
               eagle_config={"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids), "use_aux_hidden_state": True})
    return out


def speculators_config(cfg: DrafterConfig, *, verifier: str, verifier_arch: list[str], speculative_tokens: int,
                       dtype: str = "bfloat16") -> dict:
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "transformer_layer_config": _llama_config(cfg, dtype), "draft_vocab_size": cfg.draft_vocab_size,
            "norm_before_residual": False, "target_hidden_size": cfg.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": [i + 1 for i in cfg.aux_layer_ids],
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy",
                                                         "speculative_tokens": speculative_tokens}],
                                   "verifier": {"name_or_path": verifier, "architectures": verifier_arch}},
            "torch_dtype": dtype}


def export_drafter(src: str | Path | TrainedDrafter, out_dir: str | Path, *, fmt: Format = "sglang",
                   dtype: str = "bfloat16", speculative_tokens: int = 3, overwrite: bool = False) -> Path:
    """Write an engine-loadable folder for a trained drafter (``src``: run folder, checkpoint, or record)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:  # before reading the run: refuse at once
        raise FileExistsError(f"{out_dir} exists; pass overwrite=True (CLI: --overwrite) to replace it")
    trained = src if isinstance(src, TrainedDrafter) else read_trained(src)
    cfg, prov = trained.config, trained.provenance
    torch_dtype = getattr(torch, dtype)
    weights = {k: (v.to(torch_dtype) if v.is_floating_point() else v).contiguous() for k, v in trained.weights.items()}
    if fmt == "sglang":
        config = sglang_config(cfg, dtype)
        engine_ids = list(cfg.aux_layer_ids)
    elif fmt == "speculators":
        weights = {k.replace("midlayer.", "layers.0."): v for k, v in weights.items()}
        config = speculators_config(cfg, verifier=prov.model_path, verifier_arch=["LlamaForCausalLM"],
                                    speculative_tokens=speculative_tokens, dtype=dtype)
        engine_ids = [i + 1 for i in cfg.aux_layer_ids]
    else:
        raise ValueError(f"unknown export format {fmt!r} (sglang | speculators)")
    config["eaglenest"] = {"convention": prov.convention, "aux_layer_ids": list(cfg.aux_layer_ids),
                           "model_hash": prov.model_hash, "manifest": MANIFEST}
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = out_dir.with_name(f"{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}")
    work.mkdir()
    try:
        save_file(weights, str(work / "model.safetensors"), metadata={"format": "pt"})
        (work / "config.json").write_text(json.dumps(config, indent=2))
        manifest = {"schema_version": EXPORT_SCHEMA, "format": fmt, "eaglenest_version": __version__,
                    "convention": prov.convention, "provenance": json.loads(prov.to_json()),
                    "aux_layer_ids": list(cfg.aux_layer_ids), "engine_aux_layer_ids": engine_ids,
                    "drafter_config": cfg.to_dict(), "dtype": dtype, "training": trained.training,
                    "weights_sha256": hashlib.sha256((work / "model.safetensors").read_bytes()).hexdigest()}
        (work / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str))
        for f in work.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(work, out_dir)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return out_dir


@dataclass(frozen=True, slots=True)
class LoadedDrafter:
    model: Eagle3Drafter
    manifest: dict
    provenance: contract.Provenance


def check_compatible(manifest: dict, *, target_dir: Path | None = None,
                     provenance: contract.Provenance | None = None) -> None:
    """Refuse a target folder / capture provenance the drafter was not trained for (names the field)."""
    cfg, trained = manifest["drafter_config"], manifest["provenance"]
    problems = []
    if target_dir is not None:
        tcfg = model_lib.load_config(target_dir)
        for field, mine, theirs in (("hidden_size", cfg["target_hidden_size"], tcfg.get("hidden_size")),
                                    ("vocab_size", cfg["vocab_size"], tcfg.get("vocab_size")),
                                    ("model_hash", trained["model_hash"],
                                     model_lib.model_fingerprint(target_dir)["model_hash"])):
            if mine != theirs:
                problems.append(f"{field}: drafter {mine!r} != target {theirs!r}")
        if max(cfg["aux_layer_ids"]) > int(tcfg.get("num_hidden_layers", 0)) - 2:
            problems.append(f"aux_layer_ids {cfg['aux_layer_ids']} out of range for the target")
    if provenance is not None:
        for field, mine, theirs in (("aux_layer_ids", list(cfg["aux_layer_ids"]), list(provenance.aux_layer_ids)),
                                    ("hidden_size", cfg["target_hidden_size"], provenance.hidden_size),
                                    ("model_hash", trained["model_hash"], provenance.model_hash),
                                    ("convention", manifest["convention"], provenance.convention)):
            if mine != theirs:
                problems.append(f"{field}: drafter {mine!r} != capture {theirs!r}")
    if problems:
        raise contract.ContractError("drafter does not match the target: " + "; ".join(problems))


def load_drafter(folder: str | Path, *, target_dir: str | Path, provenance: contract.Provenance | None = None,
                 dtype: torch.dtype = torch.float32, device: str = "cpu") -> LoadedDrafter:
    """An exported folder (either format) -> a ready Eagle3Drafter with the target's embedding."""
    manifest, drafter = read_export(folder)
    target_dir = Path(target_dir)
    check_compatible(manifest, target_dir=target_dir, provenance=provenance)
    tt = load_target_tensors(target_dir)
    model = Eagle3Drafter(drafter.config, embed_weight=tt.embed)
    model.load_state_dict({k: (v.float() if v.is_floating_point() else v) for k, v in drafter.weights.items()})
    model.to(device=device, dtype=dtype)  # floating tensors only: d2t/t2d keep int64/bool
    return LoadedDrafter(model=model.eval(), manifest=manifest, provenance=drafter.provenance)
