"""The EAGLE-3 draft model at decode time: an exported SGLang-format folder run with its own KV cache.

Owns the decode-time math of SGLang's ``LlamaForCausalLMEagle3`` (0.5.17, chain speculation) over
the weights of an exported draft folder (``config.json`` + ``*.safetensors``: ``fc``, ``midlayer.*``
or ``layers.0.*``, ``norm``, ``lm_head``, ``d2t``; ``t2d`` is ignored, as SGLang does):

- :meth:`Eagle3Draft.fuse` maps the target's aux states [N, k*H_t] to the draft width [N, H] (``fc``).
- One decoder layer whose attention reads ``[input_layernorm(embed(token)) ; hidden_norm(hidden)]``
  (2H) and whose residual stream starts at ``hidden``; the output hidden handed to the next draft step
  is the PRE-norm residual stream; logits come from ``lm_head(norm(.))`` over the draft vocabulary,
  and a draft id ``i`` means target id ``i + d2t[i]``.
- Token embeddings are the TARGET's (SGLang calls ``set_embed`` with the target's embedding).

The forward is split into :meth:`project` (q, k, v and the residual) and :meth:`finish` (attention
output -> hidden, logits) so the live decoder (:class:`DraftKV` cache, :meth:`step`) and the offline
teacher-forced simulation (parallel chains with their own attention mask) share every weight and op.

Invariants: positions are the target's token positions; the cache holds keys/values for positions
``[0, len)`` only, and :meth:`DraftKV.crop` is the only way back.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ARCHITECTURE = "LlamaForCausalLMEagle3"


class DraftLoadError(ValueError):
    """The draft folder is not an EAGLE-3 draft this decoder can run, or does not fit the target. Terminal."""


def read_draft_config(folder: str | Path) -> dict:
    path = Path(folder) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DraftLoadError(f"cannot read the draft config {path}: {e}") from None
    arch = cfg.get("architectures") or []
    if ARCHITECTURE not in arch:
        raise DraftLoadError(f"{path}: architectures {arch} is not [{ARCHITECTURE!r}] (an EAGLE-3 export)")
    if int(cfg.get("num_hidden_layers", 1)) != 1:
        raise DraftLoadError(f"{path}: num_hidden_layers={cfg['num_hidden_layers']}; only 1-layer drafts are supported")
    eagle = cfg.get("eagle_config") or {}
    if eagle.get("norm_before_fc") or cfg.get("norm_before_fc") or cfg.get("fc_norm") or cfg.get("use_aux_norm"):
        raise DraftLoadError(f"{path}: norm_before_fc / fc_norm drafts are not supported by the embedded decoder")
    if not eagle.get("eagle_aux_hidden_state_layer_ids"):
        raise DraftLoadError(f"{path}: eagle_config.eagle_aux_hidden_state_layer_ids is missing")
    return cfg


def draft_aux_layer_ids(folder: str | Path) -> tuple[int, ...]:
    """The target layers whose outputs the draft reads (from ``eagle_config``)."""
    return tuple(int(i) for i in read_draft_config(folder)["eagle_config"]["eagle_aux_hidden_state_layer_ids"])


class DraftKV:
    """Key/value cache of the single draft layer: k, v [1, n_kv, len, head_dim]."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else int(self.k.shape[2])

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def crop(self, length: int) -> None:
        if length < 0 or length > len(self):
            raise ValueError(f"cannot crop a draft cache of {len(self)} positions to {length}")
        if self.k is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]


class Eagle3Draft(nn.Module):
    """One-layer EAGLE-3 draft (SGLang's math), run token by token with a :class:`DraftKV`."""

    def __init__(self, config: dict, embed_weight: torch.Tensor) -> None:
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

        cfg = {k: v for k, v in config.items() if k not in ("architectures", "auto_map")}
        self.config = LlamaConfig(**cfg)
        c = self.config
        h, eps = int(c.hidden_size), float(c.rms_norm_eps)
        self.hidden_size = h
        self.num_heads, self.num_kv_heads = int(c.num_attention_heads), int(c.num_key_value_heads)
        self.head_dim = int(getattr(c, "head_dim", None) or h // self.num_heads)
        self.aux_layer_ids = tuple(int(i) for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        target_h = int(config.get("target_hidden_size") or h)
        self.draft_vocab_size = int(config.get("draft_vocab_size") or c.vocab_size)
        if embed_weight.shape[1] != h:
            raise DraftLoadError(f"target embedding width {embed_weight.shape[1]} != draft hidden_size {h}")
        self.embed = nn.Embedding.from_pretrained(embed_weight, freeze=True)  # [V, H], the target's
        self.fc = nn.Linear(len(self.aux_layer_ids) * target_h, h, bias=bool(config.get("bias", False)))
        self.hidden_norm = LlamaRMSNorm(h, eps)
        self.input_layernorm = LlamaRMSNorm(h, eps)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps)
        self.q_proj = nn.Linear(2 * h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * h, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * h, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        self.mlp = LlamaMLP(c)
        self.norm = LlamaRMSNorm(h, eps)
        self.lm_head = nn.Linear(h, self.draft_vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(c)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))  # target - draft id
        self.requires_grad_(False)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_folder(
        cls, folder: str | Path, *, embed_weight: torch.Tensor, dtype: torch.dtype = torch.float32,
        target_aux_layer_ids: Sequence[int] | None = None,
    ) -> Eagle3Draft:
        """Load an exported draft; ``target_aux_layer_ids`` (if given) must equal the draft's."""
        from safetensors.torch import load_file

        folder = Path(folder)
        cfg = read_draft_config(folder)
        model = cls(cfg, embed_weight)
        if target_aux_layer_ids is not None and tuple(target_aux_layer_ids) != model.aux_layer_ids:
            raise DraftLoadError(
                f"{folder}: the draft reads aux layers {list(model.aux_layer_ids)} but the target captures "
                f"{list(target_aux_layer_ids)}; serve the target with --aux-layers "
                f"{','.join(map(str, model.aux_layer_ids))}"
            )
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise DraftLoadError(f"{folder}: no *.safetensors weights")
        weights: dict[str, torch.Tensor] = {}
        for f in files:
            weights.update(load_file(str(f)))
        model.load_exported(weights, where=str(folder))
        return model.cast(dtype)

    def cast(self, dtype: torch.dtype) -> Eagle3Draft:
        """Weights to ``dtype``; the rotary frequencies stay fp32 (as in SGLang's cos/sin cache)."""
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.to(dtype)
        self.rotary = LlamaRotaryEmbedding(self.config)
        return self

    def load_exported(self, weights: dict[str, torch.Tensor], *, where: str = "draft") -> None:
        """Copy SGLang-format tensors (``midlayer.*`` or ``layers.0.*`` names) into this module."""
        own = {"fc.weight": self.fc.weight, "norm.weight": self.norm.weight, "lm_head.weight": self.lm_head.weight}
        if self.fc.bias is not None:
            own["fc.bias"] = self.fc.bias
        for name in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
            own[f"layer.{name}.weight"] = getattr(self, name).weight
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            own[f"layer.self_attn.{name}.weight"] = getattr(self, name).weight
        for name in ("gate_proj", "up_proj", "down_proj"):
            own[f"layer.mlp.{name}.weight"] = getattr(self.mlp, name).weight
        seen = set()
        for raw, tensor in weights.items():
            name = raw.removeprefix("model.").replace("midlayer.", "layer.").replace("layers.0.", "layer.")
            if name == "d2t":
                if tensor.shape != self.d2t.shape:
                    raise DraftLoadError(f"{where}: d2t has shape {list(tensor.shape)}, "
                                         f"expected {list(self.d2t.shape)}")
                self.d2t.copy_(tensor.to(torch.long))
                seen.add(name)
            elif name in own:
                if tensor.shape != own[name].shape:
                    raise DraftLoadError(f"{where}: {raw} has shape {list(tensor.shape)}, "
                                         f"expected {list(own[name].shape)}")
                own[name].data.copy_(tensor.to(own[name].dtype))
                seen.add(name)
        if self.lm_head.weight.shape[0] == self.embed.weight.shape[0] and "lm_head.weight" not in seen:
            self.lm_head.weight.data.copy_(self.embed.weight)  # tied draft head: SGLang uses the embedding
            seen.add("lm_head.weight")
        missing = sorted(set(own) - seen)
        if missing:
            raise DraftLoadError(f"{where}: missing draft weights {missing}")

    # ------------------------------------------------------------------ math
    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """Target aux states [N, k*H_t] -> draft hidden [N, H]."""
        return self.fc(aux_hidden.to(self.fc.weight.dtype))

    def project(
        self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens [N] (target ids), hidden [N, H], positions [N] -> q [1,nh,N,d], k/v [1,nkv,N,d], residual [N,H]."""
        n = tokens.shape[0]
        x = torch.cat([self.input_layernorm(self.embed(tokens)), self.hidden_norm(hidden)], dim=-1)  # [N, 2H]
        q = self.q_proj(x).view(1, n, self.num_heads, self.head_dim).transpose(1, 2)  # [1, nh, N, d]
        k = self.k_proj(x).view(1, n, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [1, nkv, N, d]
        v = self.v_proj(x).view(1, n, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [1, nkv, N, d]
        cos, sin = self.rotary(x, positions.view(1, n))  # [1, N, d]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        return q, k, v, hidden

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """attn [1, nh, N, d] -> (pre-norm hidden for the next step [N, H], draft logits [N, Vd])."""
        n = attn.shape[2]
        h = residual + self.o_proj(attn.transpose(1, 2).reshape(n, self.num_heads * self.head_dim))  # [N, H]
        h = h + self.mlp(self.post_attention_layernorm(h))  # [N, H]
        return h, self.lm_head(self.norm(h))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q [1,nh,N,d], k/v [1,nkv,L,d], mask bool [N, L] (True = may attend) or None (full) -> [1,nh,N,d]."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads)

    def step(
        self, tokens: torch.Tensor, hidden: torch.Tensor, cache: DraftKV
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run N new positions ``[len(cache), len(cache) + N)`` causally over the cache; returns (hidden, logits)."""
        start, n = len(cache), tokens.shape[0]
        positions = torch.arange(start, start + n, device=tokens.device)
        q, k, v, residual = self.project(tokens, hidden, positions)
        keys, values = cache.append(k, v)  # [1, nkv, start+N, d]
        mask = None
        if n > 1:
            mask = torch.ones(n, start + n, dtype=torch.bool, device=tokens.device).tril(diagonal=start)  # [N, L]
        return self.finish(self.attend(q, keys, values, mask), residual)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids (``id + d2t[id]``)."""
        return draft_ids + self.d2t[draft_ids]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def target_embedding(model_dir: str | Path) -> torch.Tensor:
    """The target's token embedding [V, H], read from its safetensors without building the model."""
    return _target_tensor(model_dir, ("model.embed_tokens.weight", "embed_tokens.weight"))


def target_lm_head(model_dir: str | Path) -> torch.Tensor:
    """The target's LM head [V, H] (the embedding when tied), read from its safetensors."""
    try:
        return _target_tensor(model_dir, ("lm_head.weight",))
    except DraftLoadError:
        return target_embedding(model_dir)


def _target_tensor(model_dir: str | Path, names: Sequence[str]) -> torch.Tensor:
    from safetensors import safe_open

    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in names:
                if name in st.keys():  # noqa: SIM118 (safe_open has no __contains__)
                    return st.get_tensor(name)
    raise DraftLoadError(f"{model_dir}: none of {list(names)} found in its *.safetensors files")


def write_random_draft(
    target_dir: str | Path, out_dir: str | Path, *, draft_vocab: int | None = None, seed: int = 0,
    aux_layer_ids: Sequence[int] | None = None, std: float = 0.02,
) -> Path:
    """An UNTRAINED EAGLE-3 draft for ``target_dir`` in SGLang's export format (tests and smoke benches).

    The draft vocabulary is the first ``draft_vocab`` target ids (all of them by default).
    """
    from safetensors.torch import save_file

    from eaglenest import contract

    t = json.loads((Path(target_dir) / "config.json").read_text())
    h, v, inter = int(t["hidden_size"]), int(t["vocab_size"]), int(t["intermediate_size"])
    nh, nkv = int(t["num_attention_heads"]), int(t["num_key_value_heads"])
    hd = int(t.get("head_dim") or h // nh)
    dv = min(draft_vocab or v, v)
    aux = list(aux_layer_ids or contract.default_aux_layer_ids(int(t["num_hidden_layers"])))
    cfg = {k: t[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings",
                             "rms_norm_eps", "hidden_act", "rope_parameters", "rope_theta", "rope_scaling") if k in t}
    cfg.update({"architectures": [ARCHITECTURE], "model_type": "llama", "hidden_size": h, "intermediate_size": inter,
                "num_hidden_layers": 1, "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": hd,
                "vocab_size": v, "draft_vocab_size": dv, "target_hidden_size": h, "tie_word_embeddings": False,
                "dtype": "bfloat16", "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux,
                                                      "use_aux_hidden_state": True}})
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    ones = torch.ones(h, dtype=torch.bfloat16)
    w = {"fc.weight": r(h, len(aux) * h), "norm.weight": ones.clone(), "lm_head.weight": r(dv, h),
         "midlayer.hidden_norm.weight": ones.clone(), "midlayer.input_layernorm.weight": ones.clone(),
         "midlayer.post_attention_layernorm.weight": ones.clone(),
         "midlayer.self_attn.q_proj.weight": r(nh * hd, 2 * h), "midlayer.self_attn.k_proj.weight": r(nkv * hd, 2 * h),
         "midlayer.self_attn.v_proj.weight": r(nkv * hd, 2 * h), "midlayer.self_attn.o_proj.weight": r(h, nh * hd),
         "midlayer.mlp.gate_proj.weight": r(inter, h), "midlayer.mlp.up_proj.weight": r(inter, h),
         "midlayer.mlp.down_proj.weight": r(h, inter),
         "d2t": torch.zeros(dv, dtype=torch.int64), "t2d": torch.arange(v) < dv}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    contract.atomic_write_bytes(out / "config.json", json.dumps(cfg, indent=2).encode())
    return out
