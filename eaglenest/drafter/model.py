"""The EAGLE-3 draft model, numerically the same network as SGLang 0.5.17's ``LlamaForCausalLMEagle3``.

Owns the drafter's architecture (its building blocks are in :mod:`eaglenest.drafter.layers`), its
inference step with a KV cache, and loading the frozen tensors it borrows from the target. Parameter
names are SGLang's checkpoint names (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``)
so export is a rename-free copy.

Math of one draft forward (sglang/srt/models/llama_eagle3.py, one decoder layer, ``norm_before_fc``
and ``fc_norm`` off, ``norm_output`` off):

    hidden   = fc(aux_hidden)                   # [.., k*Ht] -> [.., H]; skipped for a fed-back hidden
    residual = hidden
    x        = cat(input_layernorm(embed(ids)), hidden_norm(hidden))     # [.., 2H]  (embeds FIRST)
    a        = o_proj(attention(rope(q_proj x), rope(k_proj x), v_proj x))
    residual = a + residual;  m = mlp(post_attention_layernorm(residual))
    out      = m + residual                     # pre-norm: the hidden fed to the next draft step
    logits   = lm_head(norm(out))               # [.., draft_vocab]; draft id i is target id i + d2t[i]

RMSNorm computes in fp32 and casts back (SGLang ``forward_native``); RoPE is neox-style with the
default rope type; MLP is SiLU-gated. ``embed`` is the TARGET's input embedding (SGLang replaces the
draft's with the target's at load time), frozen, and not part of the drafter's state dict.

Shift convention (SGLang ``_draft_extend_for_prefill``; SpecForge after its "pe shift" fix): the
draft row at position ``p`` reads the target's aux states of token ``p`` and the embedding of token
``p + 1`` (input ids shifted left by one, the tail being the token the target just produced) and its
logits predict token ``p + 2``. Draft step ``i`` of a chain anchored at ``a`` runs at position
``a + i``, feeds back the previous step's ``out`` as ``hidden``, and attends to the extend keys at
positions ``<= a`` plus the keys of the chain's own earlier steps.

KV cache use (what a speculative decoder does, batch rows advancing together):

    cache = DraftKVCache()
    out = drafter.extend(ids[1:] + [new], aux[:n], positions=arange(n), cache=cache)   # prefill
    d1 = out.logits[:, -1].argmax(-1); h = out.hidden[:, -1:]
    out = drafter(to_target(d1)[:, None], h, positions=[[n]], cache=cache)              # step 1, ...
    cache.truncate(n)   # after verification: drop the draft steps, then extend the accepted tokens
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eaglenest import contract
from eaglenest.drafter.layers import DraftLayer, RMSNorm, repeat_kv, rope_cos_sin
from eaglenest.drafter.target import TargetTensors


@dataclass(frozen=True, kw_only=True, slots=True)
class DrafterConfig:
    """Shape of the drafter. Built from the target's config; saved beside every checkpoint and export."""

    hidden_size: int
    """Draft hidden size; equals the target's (the target's embeddings are concatenated in)."""
    intermediate_size: int
    """Width of the draft layer's MLP: the target's by default, wider for more capacity at little cost."""
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int
    """Target vocabulary size (embedding rows, t2d length)."""
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]
    """Target decoder layers whose OUTPUTS feed fc (the capture convention of eaglenest.contract)."""
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
        if self.hidden_act != "silu":
            raise contract.ContractError(f"hidden_act {self.hidden_act!r} is not supported (SGLang needs silu)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise contract.ContractError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise contract.ContractError(
                f"draft_vocab_size {self.draft_vocab_size} must be in 1..vocab_size ({self.vocab_size})"
            )

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> DrafterConfig:
        return cls(**d)

    @classmethod
    def from_target(
        cls, target_config: dict, *, aux_layer_ids: tuple[int, ...], draft_vocab_size: int,
        intermediate_size: int | None = None,
    ) -> DrafterConfig:
        """The drafter for a target (a Llama-style HF config dict): same width, heads and norms; the MLP
        ``intermediate_size`` wide (default: the target's).

        RoPE: the drafter always uses the default rope type with the target's ``rope_theta`` (SGLang
        reads the drafter's own config, so training and serving agree whatever the target's scaling).
        """
        t = target_config
        rope = t.get("rope_parameters") or {}
        theta = float(rope.get("rope_theta", t.get("rope_theta", 10000.0)))
        heads = int(t["num_attention_heads"])
        return cls(
            hidden_size=int(t["hidden_size"]),
            intermediate_size=int(intermediate_size or t["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(t.get("num_key_value_heads") or heads),
            head_dim=int(t.get("head_dim") or t["hidden_size"] // heads),
            rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(t.get("max_position_embeddings", 8192)),
            vocab_size=int(t["vocab_size"]),
            draft_vocab_size=int(draft_vocab_size),
            target_hidden_size=int(t["hidden_size"]),
            aux_layer_ids=tuple(aux_layer_ids),
            hidden_act=str(t.get("hidden_act", "silu")),
            bos_token_id=t.get("bos_token_id"),
            eos_token_id=t.get("eos_token_id"),
            pad_token_id=t.get("pad_token_id"),
        )


@dataclass(slots=True)
class DraftKVCache:
    """Keys/values of the draft layer for rows that advance together: [B, nkv, L, hd] each."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else int(self.k.shape[2])

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat((self.k, k), dim=2)
        self.v = v if self.v is None else torch.cat((self.v, v), dim=2)
        return self.k, self.v

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` entries (drop rejected / speculative steps)."""
        if self.k is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]


@dataclass(frozen=True, slots=True)
class DraftOutput:
    logits: torch.Tensor  # [B, S, draft_vocab]
    hidden: torch.Tensor  # [B, S, H] pre-norm output (fed back as the next step's hidden)


class Eagle3Drafter(nn.Module):
    """EAGLE-3 drafter: fc over the aux concatenation, one decoder layer, norm, draft LM head."""

    def __init__(self, cfg: DrafterConfig, *, embed_weight: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(cfg.num_aux * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = DraftLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        # The target's embedding: frozen, borrowed, never saved with the drafter.
        if embed_weight is None:
            embed_weight = torch.zeros(cfg.vocab_size, cfg.hidden_size)
        if tuple(embed_weight.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise contract.ContractError(
                f"target embedding is {list(embed_weight.shape)}, drafter expects "
                f"[{cfg.vocab_size}, {cfg.hidden_size}]"
            )
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for lin in (self.fc, self.lm_head, *[m for m in self.midlayer.modules() if isinstance(m, nn.Linear)]):
            nn.init.normal_(lin.weight, std=std)
        for m in self.modules():
            if isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    # ---- pieces ---------------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Target token ids [B, S] -> embeddings [B, S, H] (in the fc weight's dtype)."""
        return F.embedding(ids, self.embed_weight).to(self.fc.weight.dtype)

    def project(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """Fuse the target's aux states: [B, S, k*Ht] -> [B, S, H]."""
        return self.fc(aux_hidden)

    def head(self, out: torch.Tensor) -> torch.Tensor:
        """Pre-norm output [.., H] -> draft-vocab logits [.., Vd]."""
        return self.lm_head(self.norm(out))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids -> target ids (SGLang's hot_token_id = d2t + arange)."""
        return draft_ids + self.d2t[draft_ids]

    # ---- inference ------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: DraftKVCache | None = None,
    ) -> DraftOutput:
        """One draft forward over S new rows, SGLang's extend/decode math.

        input_ids [B, S] target ids; hidden [B, S, H] (fused aux or a fed-back output); positions
        [B, S] int. With a cache, the new rows attend to every cached row and causally to each other,
        and their keys/values are appended.
        """
        layer = self.midlayer
        x = layer.attn_input(self.embed(input_ids), hidden)  # [B, S, 2H]
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        q, k, v = layer.self_attn.qkv(x, cos, sin)
        past = cache.length if cache is not None else 0
        if cache is not None:
            k, v = cache.append(k, v)
        n_rep = self.config.num_attention_heads // self.config.num_key_value_heads
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        s = q.shape[2]
        if past == 0:
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=s > 1)
        else:
            # row j (absolute past + j) sees keys 0..past + j
            mask = torch.ones(s, past + s, dtype=torch.bool, device=q.device).tril(diagonal=past)
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = layer.finish(layer.self_attn.out(attn), hidden)  # [B, S, H]
        return DraftOutput(logits=self.head(out), hidden=out)

    def extend(
        self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, positions: torch.Tensor,
        cache: DraftKVCache | None = None,
    ) -> DraftOutput:
        """Draft extend over target aux states [B, S, k*Ht]: ``forward(ids, project(aux), ...)``."""
        return self(input_ids, self.project(aux_hidden), positions, cache)

    # ---- weights --------------------------------------------------------------------------------
    def load_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t.to(torch.int64))
        self.t2d.copy_(t2d.to(torch.bool))

    def init_from_target(self, target: TargetTensors) -> None:
        """Warm start (call after :meth:`load_vocab`): LM head = the target's rows of the draft
        vocabulary, norm = the target's final norm, fc reads the deepest aux layer through an identity
        (a "logit lens" from layer L-4)."""
        ids = self.to_target_ids(torch.arange(self.config.draft_vocab_size))
        with torch.no_grad():
            self.lm_head.weight.copy_(target.lm_head[ids].float())
            self.norm.weight.copy_(target.final_norm.float())
            h, ht = self.config.hidden_size, self.config.target_hidden_size
            if h == ht:
                self.fc.weight.mul_(0.1)
                self.fc.weight[:, -ht:] += torch.eye(h)
