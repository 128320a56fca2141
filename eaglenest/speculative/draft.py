"""Loading an exported EAGLE-3 drafter folder (SGLang's format) for decoding, over eaglenest.drafter.

Owns the decode side's view of a drafter on disk: the SGLang export (``config.json`` with
``architectures == ["LlamaForCausalLMEagle3"]``, ``draft_vocab_size``, ``target_hidden_size``,
``eagle_config.eagle_aux_hidden_state_layer_ids``; weights ``fc``, ``midlayer.*`` (or SGLang's
internal ``layers.0.*``), ``norm``, ``lm_head``, ``d2t``, optional ``t2d``) becomes an
:class:`eaglenest.drafter.model.Eagle3Drafter` whose math is SGLang's. The token embedding is the
TARGET's (SGLang calls ``set_embed`` with it), passed in, never read from the draft folder.

:func:`write_random_draft` writes an UNTRAINED drafter in the same format (tests, smoke benches).

Invariant: a drafter is only paired with a target that captures the same aux layers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from eaglenest.atomic import atomic_write_bytes
from eaglenest.drafter.model import DrafterConfig, Eagle3Drafter
from eaglenest.drafter.target import load_target_tensors

ARCHITECTURE = "LlamaForCausalLMEagle3"


class DraftLoadError(ValueError):
    """The folder is not an EAGLE-3 drafter this decoder can run, or does not fit the target. Terminal."""


def read_draft_config(folder: str | Path) -> dict:
    path = Path(folder) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DraftLoadError(f"cannot read the drafter config {path}: {e}") from None
    arch = cfg.get("architectures") or []
    if ARCHITECTURE not in arch:
        raise DraftLoadError(f"{path}: architectures {arch} is not [{ARCHITECTURE!r}] (an EAGLE-3 export)")
    if int(cfg.get("num_hidden_layers", 1)) != 1:
        raise DraftLoadError(f"{path}: num_hidden_layers={cfg['num_hidden_layers']}; only 1-layer drafters run here")
    eagle = cfg.get("eagle_config") or {}
    if eagle.get("norm_before_fc") or cfg.get("norm_before_fc") or cfg.get("fc_norm") or cfg.get("use_aux_norm"):
        raise DraftLoadError(f"{path}: norm_before_fc / fc_norm drafters are not supported by the embedded decoder")
    if not eagle.get("eagle_aux_hidden_state_layer_ids"):
        raise DraftLoadError(f"{path}: eagle_config.eagle_aux_hidden_state_layer_ids is missing")
    return cfg


def draft_aux_layer_ids(folder: str | Path) -> tuple[int, ...]:
    """The target layers whose outputs the drafter reads (``eagle_config``)."""
    return tuple(int(i) for i in read_draft_config(folder)["eagle_config"]["eagle_aux_hidden_state_layer_ids"])


def drafter_config(cfg: dict) -> DrafterConfig:
    """SGLang export config -> :class:`DrafterConfig`."""
    heads = int(cfg["num_attention_heads"])
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise DraftLoadError(f"rope type {rope.get('rope_type')!r}: only default RoPE drafters run here")
    return DrafterConfig(
        hidden_size=int(cfg["hidden_size"]), intermediate_size=int(cfg["intermediate_size"]),
        num_attention_heads=heads, num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)), vocab_size=int(cfg["vocab_size"]),
        draft_vocab_size=int(cfg.get("draft_vocab_size") or cfg["vocab_size"]),
        target_hidden_size=int(cfg.get("target_hidden_size") or cfg["hidden_size"]),
        aux_layer_ids=tuple(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
        hidden_act=str(cfg.get("hidden_act", "silu")),
    )


def load_exported_drafter(
    folder: str | Path, *, embed_weight: torch.Tensor, dtype: torch.dtype = torch.float32,
    target_aux_layer_ids: Sequence[int] | None = None,
) -> Eagle3Drafter:
    """An exported folder as an :class:`Eagle3Drafter` in ``dtype`` with the target's embedding [V, H]."""
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg = drafter_config(read_draft_config(folder))
    if target_aux_layer_ids is not None and tuple(target_aux_layer_ids) != cfg.aux_layer_ids:
        raise DraftLoadError(
            f"{folder}: the drafter reads aux layers {list(cfg.aux_layer_ids)} but the target captures "
            f"{list(target_aux_layer_ids)}; run the target with aux layers {','.join(map(str, cfg.aux_layer_ids))}"
        )
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise DraftLoadError(f"{folder}: no *.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    renamed = {k.removeprefix("model.").replace("layers.0.", "midlayer."): v for k, v in weights.items()}
    try:
        model = Eagle3Drafter(cfg, embed_weight=embed_weight)
    except ValueError as e:
        raise DraftLoadError(f"{folder}: {e}") from None
    state = model.state_dict()
    if "t2d" not in renamed:  # SGLang ignores t2d; rebuild it from d2t
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        if "d2t" in renamed:
            t2d[renamed["d2t"].long() + torch.arange(cfg.draft_vocab_size)] = True
        renamed["t2d"] = t2d
    missing = sorted(set(state) - set(renamed))
    if missing:
        raise DraftLoadError(f"{folder}: missing drafter weights {missing}")
    bad = [f"{k} {list(renamed[k].shape)} != {list(v.shape)}" for k, v in state.items() if renamed[k].shape != v.shape]
    if bad:
        raise DraftLoadError(f"{folder}: wrong weight shapes: {bad}")
    model.load_state_dict({k: renamed[k] for k in state})
    model.requires_grad_(False)
    return model.to(dtype).eval()


def check_export_matches(folder: str | Path, target_dir: str | Path) -> None:
    """An eaglenest export (``eaglenest.json`` present) must have been trained for this target:
    :func:`eaglenest.drafter.export.check_compatible` (hidden size, vocabulary, aux layers, model hash).
    Third-party SGLang folders have no manifest and are only checked by shape when loaded."""
    manifest = Path(folder) / "eaglenest.json"
    if not manifest.is_file():
        return
    from eaglenest import contract
    from eaglenest.drafter.export import check_compatible

    try:
        check_compatible(json.loads(manifest.read_text()), target_dir=Path(target_dir))
    except (contract.ContractError, KeyError, ValueError) as e:
        raise DraftLoadError(f"{folder}: {e}") from None


def target_embedding(model_dir: str | Path) -> torch.Tensor:
    """The target's token embedding [V, H], read without building the model."""
    return load_target_tensors(model_dir).embed


def target_lm_head(model_dir: str | Path) -> torch.Tensor:
    """The target's LM head [V, H] (the embedding when tied)."""
    return load_target_tensors(model_dir).lm_head


def write_random_draft(
    target_dir: str | Path, out_dir: str | Path, *, draft_vocab: int | None = None, seed: int = 0,
    aux_layer_ids: Sequence[int] | None = None, std: float = 0.02, intermediate_size: int | None = None,
) -> Path:
    """An UNTRAINED drafter for ``target_dir`` in SGLang's export format (draft vocab = first ids; draft MLP
    ``intermediate_size`` wide, default the target's): the shape of a trained one, for timing a cycle."""
    from safetensors.torch import save_file

    from eaglenest import contract

    t = json.loads((Path(target_dir) / "config.json").read_text())
    aux = tuple(aux_layer_ids or contract.default_aux_layer_ids(int(t["num_hidden_layers"])))
    dv = min(draft_vocab or int(t["vocab_size"]), int(t["vocab_size"]))
    cfg = DrafterConfig.from_target(t, aux_layer_ids=aux, draft_vocab_size=dv, intermediate_size=intermediate_size)
    torch.manual_seed(seed)
    model = Eagle3Drafter(cfg)
    model.reset_parameters(std)
    ids = torch.arange(dv)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    model.load_vocab(ids - torch.arange(dv), t2d)
    weights = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
               for k, v in model.state_dict().items()}
    config = {"architectures": [ARCHITECTURE], "model_type": "llama", "hidden_size": cfg.hidden_size,
              "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 1,
              "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
              "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
              "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
              "draft_vocab_size": dv, "target_hidden_size": cfg.target_hidden_size, "hidden_act": "silu",
              "tie_word_embeddings": False, "dtype": "bfloat16", "bos_token_id": t.get("bos_token_id"),
              "eos_token_id": t.get("eos_token_id"), "pad_token_id": t.get("pad_token_id"),
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux), "use_aux_hidden_state": True}}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    atomic_write_bytes(out / "config.json", json.dumps(config, indent=2).encode())
    return out
