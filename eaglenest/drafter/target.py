"""The few tensors of a target model that an EAGLE-3 drafter borrows: its input embedding (the drafter reads the
target's embeddings of the tokens it drafts from), its LM head and final norm (a warm start, and the target's
distribution in training and evaluation), read from the safetensors of a Hugging Face folder without the rest of
the model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from eaglenest import contract


@dataclass(frozen=True, slots=True)
class TargetTensors:
    """The few target tensors the drafter needs, loaded without the rest of the model."""

    config: dict
    embed: torch.Tensor  # [V, H]
    lm_head: torch.Tensor  # [V, H]
    final_norm: torch.Tensor  # [H]


def _tensor_locations(model_dir: Path) -> dict[str, Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return {k: model_dir / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open

    out: dict[str, Path] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            out.update({k: f for k in fh.keys()})  # noqa: SIM118 (safe_open is not a Mapping)
    return out


def load_target_tensors(model_dir: str | Path) -> TargetTensors:
    """Embedding, LM head (= embedding when tied, as in SmolLM2) and final norm of a target folder."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    where = _tensor_locations(model_dir)
    names = {"embed": "model.embed_tokens.weight", "lm_head": "lm_head.weight", "final_norm": "model.norm.weight"}
    if config.get("tie_word_embeddings") or names["lm_head"] not in where:
        names["lm_head"] = names["embed"]
    missing = [n for n in names.values() if n not in where]
    if missing:
        raise contract.ContractError(
            f"{model_dir}: tensors {missing} not found; the drafter needs a Llama-style target folder "
            "(model.embed_tokens.weight, model.norm.weight, lm_head.weight or tied embeddings)"
        )
    got: dict[str, torch.Tensor] = {}
    for key, name in names.items():
        with safe_open(str(where[name]), framework="pt") as fh:
            got[key] = fh.get_tensor(name)
    return TargetTensors(config=config, **got)
